"""A fleet behind one trainer (#32): one link carries one update into several vLLM servers of
different parallel layouts, in every mode.

Invariant: with three servers on one link, A (TP 2), B (TP 2 with expert parallelism, EP 2) and
C (TP 2 x DP 2 without EP), 8 engine ranks, every engine rank's parameters after ``load_into``
equal the reference conversion of the trainer's own tensors (``glm_fp8.kernels.reference``) cut by that
rank's shard, bit for bit, after a full broadcast, a scatter and an update from 2 senders; and
each sender puts on the link exactly the data bytes the transfer plan predicts for that fleet
(``glm_fp8.transfer.pack``'s regions, ``glm_fp8.transfer.routes.transfer_plan``), counted at the
link's interface (a group broadcast once, a point-to-point message once per receiving rank):
- full broadcast: one broadcast of each whole converted layer (and its checksum word) on the link;
- scatter: each distinct piece (an entry's cut) goes once to the ranks that hold it, the pieces of
  one holder set in one segment: one group broadcast when it has several ranks (the replicated
  entries: all 8 ranks, on the link itself; attention, the shared expert, embeddings and lm_head:
  the 4 ranks of one TP position across A, B and C), point to point when it has one (the routed
  experts: no two ranks of these layouts hold the same expert cut, not even C's DP replicas); so
  the sender sends each layer's dense part about once, not once per layout;
- many senders: a segment to a class of several ranks (ranks of several servers whose whole region
  is equal) as one group broadcast per (sender, class), the others point to point, once per rank
  of its class: the senders' NICs bound these updates (``glm_fp8.transfer.topology``). With A, B
  and C the dense layer's and the non-layer tensors' classes are the 4 ranks of one TP position,
  the sparse layer's each rank alone (group broadcasts and point-to-point messages in one
  update); a fourth update into A, B and replicas of them, A' and B', also sends each sparse
  layer segment once to the two ranks, of two servers, that hold the same experts.
Each layer is converted once per sender whatever the number of servers (a single sender all of
it, each of many senders its share), then cut into every class's region.

One set of processes (2 trainer ranks, 8 engine ranks, gloo, CPU) runs the three updates: the
single-sender ones on a ``StoreLink`` of rank 0 and the engine ranks (a link that can make
groups of some of its ranks), then the 2-sender one on the default group. A tiny GLM-5: a dense
layer, a sparse layer and the non-layer tensors.
"""

import torch

from glm_fp8.model.families import REST
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.model.trainer_layouts import layer_prefix
from glm_fp8.testing import free_port, launch

FILL = 0x5A  # every parameter starts as this byte before each update: an unwritten one shows
IDS = [0, 2]  # a dense layer, a sparse one; then the non-layer tensors (rest=True)
N_TRAINER = 2


def _fleet(replicas: bool = False):
    """Servers A (TP 2), B (TP 2, EP 2), C (TP 2 x DP 2), or with ``replicas`` A, B and replicas of
    them in C's place, A' and B': the 8 engine ranks' layouts, in order, and each one's server."""
    from glm_fp8.engine import EngineLayout

    servers = {
        "A": EngineLayout.all_ranks(2),
        "B": EngineLayout.all_ranks(2, 1, enable_expert_parallel=True),
        "C": EngineLayout.all_ranks(2, 2),
    }
    if replicas:
        servers = {"A": servers["A"], "B": servers["B"], "A'": servers["A"], "B'": servers["B"]}
    layouts = [lay for lays in servers.values() for lay in lays]
    names = [s for s, lays in servers.items() for _ in lays]
    return layouts, names


def _counted(link):
    """``link`` with its data messages recorded in ``link.log`` as (kind, peers, bytes): a group
    broadcast from this rank once (``"group"``, its ranks), each point-to-point send once per
    peer (``"p2p"``), each message that arrives (``"recv"``, from its sender). Headers, manifests
    and votes are not data."""
    group_broadcast, exchange = link.group_broadcast, link.exchange

    def counted_group_broadcast(tensor, src, ranks):
        link.log.append(
            ("group", tuple(ranks), tensor.nbytes) if src == link.rank else ("recv", (src,), tensor.nbytes)
        )
        return group_broadcast(tensor, src, ranks)

    def counted_exchange(sends, recvs):
        link.log.extend(("p2p", (peer,), t.nbytes) for t, peer in sends)
        link.log.extend(("recv", (peer,), t.nbytes) for t, peer in recvs)
        return exchange(sends, recvs)

    link.group_broadcast, link.exchange, link.log = counted_group_broadcast, counted_exchange, []
    return link


def _count_conversions(calls: list) -> None:
    """Record in ``calls`` the layer (its prefix) of every conversion a sender runs: a single
    sender's in ``gather``, a sender's share in ``share``, each through ``convert_checked`` (or,
    before it existed, ``convert_layer``, which takes the layer's index)."""
    import glm_fp8.transfer.gather as gather
    import glm_fp8.transfer.share as share

    def counting(convert, checked: bool):
        def counted(layer, plan_or_idx, *a, **k):
            calls.append(a[0] if checked else layer_prefix(plan_or_idx))
            return convert(layer, plan_or_idx, *a, **k)

        return counted

    for module in (gather, share):
        name = "convert_checked" if hasattr(module, "convert_checked") else "convert_layer"
        setattr(module, name, counting(getattr(module, name), name == "convert_checked"))


def _reference() -> dict[str, torch.Tensor]:
    """The reference conversion (``glm_fp8.kernels.reference``) of the trainer's own tensors, whole, by
    kernel-format name: made once here, each engine rank cuts its shards from it."""
    from glm_fp8.kernels.reference import convert_layer_ref
    from glm_fp8.model.plans import plan_from_config
    from glm_fp8.model.trainer_layouts import strip_layer
    from glm_fp8.testing import synthetic_layer

    out = {}
    for i in [*IDS, REST]:
        layer = strip_layer(synthetic_layer(TINY_GLM5, i), i)
        out.update(convert_layer_ref(layer, i, plan_from_config(TINY_GLM5, i)))
    return out


def _rank(rank, world, port, reference):
    from datetime import timedelta

    from torch.distributed.device_mesh import DeviceMesh

    from glm_fp8.engine import engine_params, take_shard
    from glm_fp8.kernels.backends import set_default_backend
    from glm_fp8.testing import sharded_layer, synthetic_layer
    from glm_fp8.transfer import Receiver, Sender
    from glm_fp8.transfer.link import StoreLink, TorchLink

    # The transfer is under test here, not the kernels (tests/kernels compares every backend with
    # the reference): the eager backend converts 10x faster than Triton's CPU interpreter.
    set_default_backend("torch")
    layouts, _ = _fleet()
    twins, _ = _fleet(replicas=True)
    mesh = DeviceMesh("cpu", torch.arange(N_TRAINER))  # every rank makes the mesh's group
    kw = dict(config=TINY_GLM5, layer_ids=IDS, rest=True, device="cpu")
    one_rank = 0 if rank == 0 else rank - 1  # link rank on the single sender's link (rank 1 is not on it)
    runs = [  # (mode, engines, senders): one sender on the StoreLink, then both on the default group
        ("broadcast", None, [0]),
        ("scatter", [None, *layouts], [0]),
        ("many senders", [None] * N_TRAINER + layouts, list(range(N_TRAINER))),
        ("many senders, replicas", [None] * N_TRAINER + twins, list(range(N_TRAINER))),
    ]
    store = None
    if rank != 1:
        wait = timedelta(seconds=120)
        store = StoreLink("127.0.0.1", port, one_rank, world - 1, backend="gloo", timeout=wait)
        store = _counted(store)
    out = {}
    if rank < N_TRAINER:
        calls: list = []
        _count_conversions(calls)
        for mode, engines, senders in runs:
            if rank not in senders:
                continue
            calls.clear()
            link = _counted(TorchLink(None)) if len(senders) > 1 else store
            link.log = []
            sender = Sender(link, 0, engines=engines, senders=senders, **kw)
            if len(senders) > 1:
                layers = ((i, sharded_layer(TINY_GLM5, i, mesh)) for i in IDS)
                rest = sharded_layer(TINY_GLM5, REST, mesh)
            else:
                layers = ((i, synthetic_layer(TINY_GLM5, i)) for i in IDS)
                rest = synthetic_layer(TINY_GLM5, REST)
            stats = sender.send_model(layers, rest=rest)
            per_layer = [s.nbytes for s in stats.layers]
            out[mode] = {
                "stats": stats.nbytes,
                "per_layer": per_layer,
                "log": link.log,
                "converted": list(calls),
            }
        return out
    for mode, engines, senders in runs:
        layout = (twins if mode.endswith("replicas") else layouts)[rank - N_TRAINER]
        # What the rank must hold, by vLLM's name and dtype (as glm_fp8.testing.reference_engine_params).
        want, params = {}, {}
        for p in engine_params(TINY_GLM5, layout).values():
            if p.kernel_name in reference:
                want[p.name] = take_shard(reference[p.kernel_name], p.shard).to(p.dtype)
                params[p.name] = torch.empty(p.shape, dtype=p.dtype)
        assert len(want) == len(reference)  # every entry of the update lands in a parameter of this rank
        for p in params.values():
            p.view(torch.uint8).fill_(FILL)
        link = store if len(senders) == 1 else _counted(TorchLink(None))
        link.log = []
        stats = Receiver(link, 0, layout=layout, engines=engines, senders=senders, **kw).load_into(params)
        differ = [
            n
            for n, w in want.items()
            if not torch.equal(params[n].contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))
        ]
        out[mode] = {"differ": differ, "received": sum(n for _, _, n in link.log), "stats": stats.nbytes}
    return out


def _predicted():
    """What each sender sends per mode, from the plan alone (what the update-time model reads):
    the full broadcast its whole layers once (``full_pack``), the scatter each class's region once
    (``layer_scatter``: group broadcasts on a link that makes groups), many senders the transfer
    plan's segments (``TransferPlan.sent_bytes``), into A, B, C and into A, B, A', B'."""
    from glm_fp8.model.plans import plans_for_model
    from glm_fp8.transfer.pack import full_pack, layer_scatter
    from glm_fp8.transfer.routes import transfer_plan

    layouts, _ = _fleet()
    ids = [*IDS, REST]
    plans = plans_for_model(TINY_GLM5, "fp8", layer_ids=ids)
    full = [full_pack(p, i).nbytes for p, i in zip(plans, ids)]
    scatters = [layer_scatter(p, i, TINY_GLM5, [None, *layouts]) for p, i in zip(plans, ids)]
    many = {
        mode: transfer_plan(TINY_GLM5, plans, ids, [None] * N_TRAINER + lays, range(N_TRAINER))
        for mode, lays in (("many senders", layouts), ("many senders, replicas", _fleet(replicas=True)[0]))
    }
    # The one function for every mode: the plan's count, on a link that makes groups (StoreLink).
    for engines, want in (([None] + ["full"] * len(layouts), full), ([None, *layouts], scatters)):
        one = transfer_plan(TINY_GLM5, plans, ids, engines, [0], groups=True)
        assert one.sent_bytes() == [sum(w if isinstance(w, int) else w.wire_nbytes for w in want)]
    return full, scatters, many


def _distinct() -> int:
    """What one sender sends for the scatter, counted from each rank's own shards (``shard_pack``):
    each distinct piece (``cut_key``: an entry's bytes, whatever the rule that cut them) once at a
    multiple of 256 bytes, plus a checksum word per set of ranks that hold the same pieces."""
    from glm_fp8.model.layer_plan import align
    from glm_fp8.model.plans import plans_for_model
    from glm_fp8.transfer.pack import cut_key, shard_pack

    layouts, _ = _fleet()
    ids = [*IDS, REST]
    total = 0
    for plan, i in zip(plans_for_model(TINY_GLM5, "fp8", layer_ids=ids), ids):
        holders: dict[tuple, set] = {}
        size: dict[tuple, int] = {}
        for r, layout in enumerate(layouts):
            for p in shard_pack(plan, i, TINY_GLM5, layout).pieces:
                holders.setdefault(cut_key(p), set()).add(r)
                size[cut_key(p)] = align(p.nbytes)
        total += sum(size.values()) + 8 * len({frozenset(h) for h in holders.values()})
    return total


def _whole_regions() -> int:
    """The scatter's bytes when only ranks whose whole region is equal share a broadcast (before
    #32's per-piece classes: 10,896,480 bytes here; per piece 7,433,608)."""
    from glm_fp8.model.plans import plans_for_model
    from glm_fp8.transfer.pack import layer_scatter

    layouts, _ = _fleet()
    ids = [*IDS, REST]
    plans = plans_for_model(TINY_GLM5, "fp8", layer_ids=ids)
    return sum(
        layer_scatter(p, i, TINY_GLM5, [None, *layouts], per_piece=False).wire_nbytes
        for p, i in zip(plans, ids)
    )


def test_three_servers_of_different_layouts_in_every_mode():
    layouts, servers = _fleet()
    world = N_TRAINER + len(layouts)
    results = launch(world, _rank, (free_port(), _reference()), timeout_s=240)
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    for r in range(N_TRAINER, world):  # every engine rank, every mode: the reference's bytes
        for mode, run in results[r][1].items():
            assert run["differ"] == [], (r, servers[r - N_TRAINER], mode, run["differ"][:3])
            assert run["stats"] == run["received"], (r, mode)  # what arrived, not its padded buffer

    full, scatters, many = _predicted()
    layers = [layer_prefix(i) for i in [*IDS, REST]]
    for mode in ("broadcast", "scatter"):  # the one sender converts each layer once, for 8 ranks of 3 layouts
        assert results[0][1][mode]["converted"] == layers, (mode, results[0][1][mode]["converted"])
    # Many senders: each converts its share of a layer at most once (none where it has nothing).
    shares = [results[t][1]["many senders"]["converted"] for t in range(N_TRAINER)]
    assert all(share == [x for x in layers if x in share] for share in shares), shares
    assert set().union(*shares) == set(layers), shares
    sent = {t: results[t][1] for t in range(N_TRAINER)}
    for t, modes in sent.items():  # measured at the link = the update's own count
        for mode, run in modes.items():
            assert sum(n for _, _, n in run["log"]) == run["stats"], (t, mode)

    # Full broadcast: each layer once, on the whole link (8 engine ranks of 3 layouts).
    run = sent[0]["broadcast"]
    assert run["per_layer"] == full and run["stats"] == sum(full)
    assert [kind for kind, _, _ in run["log"]] == ["group"] * len(full)
    assert all(len(ranks) == 1 + len(layouts) for _, ranks, _ in run["log"])

    # Scatter: each holder set's pieces once; a holder set of several ranks in one group broadcast
    # (every engine rank: the link's own), those first, then the point-to-point ones.
    run = sent[0]["scatter"]
    assert run["per_layer"] == [s.wire_nbytes for s in scatters]
    every, tp0, tp1 = tuple(range(1, 9)), (1, 3, 5, 7), (2, 4, 6, 8)
    dense, sparse, rest = scatters
    for scatter in (dense, rest):  # the replicated entries, then one class per TP position
        assert sorted(scatter.classes) == [every, tp0, tp1]
    assert {servers[r - 1] for r in tp0} == {"A", "B", "C"}
    # The sparse layer: the same three, then each rank's own expert cut
    assert sparse.classes == (every, tp0, tp1, *((r,) for r in every))
    kinds = [(kind, len(ranks)) for kind, ranks, _ in run["log"]]
    every_tp = [("group", 9), ("group", 5), ("group", 5)]  # the rest's embeddings come before its norm
    assert kinds == every_tp + every_tp + [("p2p", 1)] * 8 + [("group", 5), ("group", 9), ("group", 5)], kinds
    # Each distinct piece once (its bytes counted once over the 8 ranks' shards, whatever their
    # layouts), plus each segment's alignment and checksum word: far below one region per class
    # of whole-region-equal ranks (a sparse layer's regions, each rank's own, share nothing).
    assert run["stats"] == _distinct() < 0.7 * _whole_regions()
    # One sender's fewest bytes are the full broadcast's; scatter into 3 layouts sends the dense
    # parts about once and the routed experts once per expert cut, to spare the engine ranks.
    assert sum(full) < run["stats"] < 2 * sum(full)
    for r in range(N_TRAINER, world):  # each engine rank: the whole layers, or its classes' packs
        link_rank = r - N_TRAINER + 1
        assert results[r][1]["broadcast"]["received"] == sum(full)
        mine = [pk.nbytes for s in scatters for ranks, pk in zip(s.classes, s.packs) if link_rank in ranks]
        assert results[r][1]["scatter"]["received"] == sum(mine) < sum(full)
        assert len(mine) == 2 + 3 + 2  # every rank's pieces, its TP position's; sparse: its experts too

    # Many senders: the senders' NICs bound both updates (each would send its share to every rank
    # of a class), so each (sender, class of several ranks) segment is one group broadcast in the
    # group of that sender and that class, posted in class order, then one exchange of the
    # segments to a class of one rank, once per rank.
    twins, twin_servers = _fleet(replicas=True)
    tp0, tp1 = (2, 4, 6, 8), (3, 5, 7, 9)  # link ranks 2..9 now
    sparse = {
        "many senders": tuple((r,) for r in range(2, 10)),
        "many senders, replicas": ((2, 6), (3, 7), (4, 8), (5, 9)),
    }
    for mode, plan in many.items():
        assert [lay.classes for lay in plan.layers] == [(tp0, tp1), sparse[mode], (tp0, tp1)]
        for t in range(N_TRAINER):
            run = sent[t][mode]
            assert run["per_layer"] == [lay.sent_nbytes(t) for lay in plan.layers]
            assert run["stats"] == plan.sent_bytes()[t] > 0
            want = []
            for lay in plan.layers:
                mine = lay.of_sender(t)
                assert all(s.group == tuple(sorted((t, *lay.classes[s.cls]))) for s in mine if s.group)
                want += [("group", s.group, s.nbytes) for s in mine if len(lay.classes[s.cls]) > 1]
                want += [("p2p", lay.classes[s.cls], s.nbytes) for s in mine if len(lay.classes[s.cls]) == 1]
            assert run["log"] == want, (t, mode, run["log"])
            assert len(set(want)) == len(want)  # one group broadcast per (sender, class) and layer
        for r in range(N_TRAINER, world):  # each engine rank: its class's segments, from both senders
            mine = [
                s.nbytes
                for lay in plan.layers
                for k, ranks in enumerate(lay.classes)
                if r in ranks
                for s in lay.of_class(k)
            ]
            assert results[r][1][mode]["received"] == sum(mine)
    # into A, B, A', B': the sparse layer's experts go once to the two servers that hold them alike
    log = [x for t in range(N_TRAINER) for x in sent[t]["many senders, replicas"]["log"]]
    assert {kind for kind, _, _ in log} == {"group"}
    pairs = {ranks[1:] for _, ranks, _ in log if len(ranks) == 3}  # a sender and two engine ranks
    assert pairs == set(sparse["many senders, replicas"])
    assert all(twins[a - N_TRAINER] == twins[b - N_TRAINER] for a, b in pairs)  # the same experts
    assert {twin_servers[r - N_TRAINER] for pair in pairs for r in pair} == {"A", "B", "A'", "B'"}


def test_scatter_sends_each_piece_once_per_holder_set():
    """The scatter's plan alone (no link): every engine rank's segments hold exactly its own shard
    (each of its pieces once, side by side in its layer buffer), on a link that makes groups and on
    one that cannot (there only the pieces every rank holds are shared, by the link's own
    broadcast); and for GLM-5 the sender sends each distinct piece once per holder set: into 4
    servers of EP 8 the model once (706.1 GiB; 722.3 GiB when only whole equal regions were shared),
    into prime-rl's fleet (prefill TP 8 x DP 4 with EP, decode DP 32 with EP, 2 of each) 1.03 times
    the model (722.3 GiB, was 2140.3 GiB: the attention's TP 8 cuts and the decode ranks' whole
    copies differ, the routed experts' EP 32 cut is the same in both)."""
    from glm_fp8.model.families import model_layer_ids
    from glm_fp8.model.plans import plans_for_model
    from glm_fp8.model.presets import PRESETS
    from glm_fp8.planning.fleet import fleet_preset
    from glm_fp8.transfer.pack import cut_key, shard_pack
    from glm_fp8.transfer.routes import transfer_plan

    layouts, _ = _fleet()
    ids = [*IDS, REST]
    plans = plans_for_model(TINY_GLM5, "fp8", layer_ids=ids)
    engines = [None, *layouts]
    for groups in (True, False):
        tp = transfer_plan(TINY_GLM5, plans, ids, engines, [0], groups=groups)
        for plan, i, lay in zip(plans, ids, tp.layers):
            if not groups:  # every rank's pieces by the link's broadcast, each rank's others its own
                assert lay.classes[0] == tuple(range(1, 9))
                assert [s.group for s in lay.of_class(0)] == [tuple(range(9))]
                assert all(len(lay.classes[s.cls]) == 1 and s.group is None for s in lay.segments[1:])
            for r, layout in enumerate(layouts, start=1):
                mine = lay.of_rank(r)
                got = sorted(cut_key(p) for s in mine for p in s.pieces)
                assert got == sorted(cut_key(p) for p in shard_pack(plan, i, TINY_GLM5, layout).pieces)
                ends = [0] + [x for s in mine for x in (s.recv_offset, s.recv_offset + s.nbytes)]
                assert ends == sorted(ends) and ends[-1] <= lay.rank_nbytes(r), (groups, i, r)
        assert tp.sent_bytes() == [sum(lay.sent_nbytes(0) for lay in tp.layers)]
    assert tp.sent_bytes()[0] > transfer_plan(TINY_GLM5, plans, ids, engines, [0]).sent_bytes()[0]

    glm5 = PRESETS["glm-5"]
    ids = [*model_layer_ids(glm5), REST]
    plans = plans_for_model(glm5, "fp8", layer_ids=ids)
    full = sum(p.nbytes for p in plans)
    for name, most in (("glm-5-4xep8", 1.0001), ("prime-rl-glm-5.2", 1.03)):
        sent = transfer_plan(glm5, plans, ids, [None, *fleet_preset(name).layouts()], [0]).sent_bytes()[0]
        assert full < sent < most * full, (name, sent / full)


def test_a_link_without_groups_takes_the_scatter_plan():
    """On a link that cannot make groups (an object like vLLM's PyNcclCommunicator) the scatter's
    only broadcast is the link's own, to the pieces every engine rank holds: the plan's groups are
    that one, which such a link accepts (it refused every group, the whole link's too), while a
    group of some ranks is still refused."""
    import pytest

    from glm_fp8.model.plans import plans_for_model
    from glm_fp8.transfer.link import ObjectLink
    from glm_fp8.transfer.routes import transfer_plan

    class Comm:  # the methods ObjectLink needs
        rank, world_size = 0, 9

        def broadcast(self, tensor, src):
            pass

        def all_reduce(self, tensor, op=None):
            return tensor

    layouts, _ = _fleet()
    ids = [*IDS, REST]
    plans = plans_for_model(TINY_GLM5, "fp8", layer_ids=ids)
    link = ObjectLink(Comm())
    plan = transfer_plan(TINY_GLM5, plans, ids, [None, *layouts], [0], groups=link.groups_supported)
    groups = plan.groups()
    assert groups == [tuple(range(9))]
    link.make_groups(groups)
    with pytest.raises(ValueError, match=r"cannot make groups of ranks \(\(0, 1, 3\)\)"):
        link.make_groups([(0, 1, 3)])
