"""Delta across links (glm_fp8.transfer.delta.carry, docs/delta.md#across-links).

Invariant: a fleet rebuilt between updates (a new link, a server added, the old ranks at other link
ranks) keeps its deltas. Server A (TP 2, link ranks 1 and 2) takes two updates from one sender on
a first link; then a second link adds server B (TP 1, a layout no old rank had) at link rank 1 and
moves A's ranks to 2 and 3; the sender (its kept copy in host memory) and A's ranks carry their
state over (``detach_kept`` / ``adopt_kept``, ``detach_held`` / ``adopt_held``). The first update
on the new link: A's ranks take their own cut pieces as deltas (point to point) and the pieces B
shares with them dense (one group broadcast, B holds nothing), B takes everything dense; the next
update is a delta for every rank. After every update every engine byte equals the reference of
that step's weights. A copy goes only to an endpoint like its own (the same kept place, layout).
"""

import weakref

import pytest
import torch

from glm_fp8.engine import EngineLayout
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.testing import free_port, launch, moved_layer, reference_engine_params

CONFIG = {**TINY_GLM5, "num_nextn_predict_layers": 0}
IDS = list(range(CONFIG["num_hidden_layers"]))
A = EngineLayout.all_ranks(2)  # server A, TP 2: on both links
B = EngineLayout()  # server B, TP 1: added on the second link
# On a GPU machine every rank works on the one GPU (bench/gpu_run.sh's GPU_TESTS) with the Triton
# kernels, the kept copy and the held parameters in GPU memory; else on the CPU with the torch path.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _port(rank: int, key: str) -> int:
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set(f"carry_test/{key}", str(free_port()))
    return int(store.get(f"carry_test/{key}").decode())


def _link(rank: int, key: str, link_rank: int | None, size: int):
    from datetime import timedelta

    from glm_fp8.transfer.link import StoreLink

    port = _port(rank, key)
    if link_rank is None:
        return None
    return StoreLink(
        "127.0.0.1",
        port,
        link_rank,
        size,
        backend="gloo",
        timeout=timedelta(seconds=60),
        device=torch.device(DEV),
    )


def _rank(rank, world):
    from glm_fp8.kernels.backends import set_default_backend
    from glm_fp8.transfer import DeltaOptions, Receiver, Sender
    from glm_fp8.transfer.delta.carry import adopt_held, adopt_kept, detach_held, detach_kept

    if DEV == "cpu":  # the transfer is under test, not the kernels (tests/kernels): the torch path
        set_default_backend("torch")
    else:
        torch.cuda.set_device(0)
    torch.set_num_threads(1)
    kw = dict(config=CONFIG, layer_ids=IDS, device=DEV)
    first = [None, *A]  # link 1: the sender, A's two ranks
    second = [None, B, *A]  # link 2: B at link rank 1, A's ranks moved to 2 and 3
    link1 = _link(rank, "one", rank if rank < 3 else None, 3)
    link2 = _link(rank, "two", [0, 2, 3, 1][rank], 4)
    layer = lambda step: lambda i: moved_layer(CONFIG, i, step)  # noqa: E731

    def send(sender, step: int) -> int:  # the bytes this sender put on the link
        layers = ((i, {k: t.to(DEV) for k, t in layer(step)(i).items()}) for i in IDS)
        return sum(s.nbytes for s in sender.send_model(layers).layers)

    out: dict = {"sent": [], "dense": [], "got": [], "bad": []}
    if rank == 0:
        host = DeltaOptions(kept="host")  # pinned host memory on a GPU machine
        sender = Sender(link1, 0, engines=first, delta=host, **kw)
        for step in (0, 1):
            out["sent"].append(send(sender, step))
        copy = detach_kept(sender)
        out["copy_nbytes"] = copy.nbytes
        with pytest.raises(ValueError, match="has no delta state"):
            detach_kept(Sender(link2, 0, engines=second, **kw))
        with pytest.raises(ValueError, match="the same DeltaOptions.kept"):
            adopt_kept(Sender(link2, 0, engines=second, delta=DeltaOptions(kept="gpu"), **kw), copy)
        sender = Sender(link2, 0, engines=second, delta=host, **kw)
        out["carried"] = adopt_kept(sender, copy)
        for step in (2, 3):
            out["sent"].append(send(sender, step))
        out["dense"] = sum(lay.sent_nbytes(0) for lay in sender.routes.layers)
        with pytest.raises(ValueError, match="has sent already"):
            adopt_kept(sender, copy)
        return out
    layout = B if rank == 3 else A[rank - 1]
    want0 = reference_engine_params(CONFIG, layout, IDS, layer=layer(0))
    params = {n: torch.full(w.shape, float("nan"), device=DEV).to(w.dtype) for n, w in want0.items()}

    def update(recv, step):
        stats = recv.load_into(params)
        want = reference_engine_params(CONFIG, layout, IDS, layer=layer(step))
        out["got"].append(sum(s.nbytes for s in stats.layers))
        same = {
            n: torch.equal(params[n].cpu().view(torch.uint8), w.view(torch.uint8)) for n, w in want.items()
        }
        out["bad"].append([n for n, ok in same.items() if not ok])

    if rank < 3:
        recv = Receiver(link1, 0, layout=layout, engines=first, delta=True, **kw)
        for step in (0, 1):
            update(recv, step)
        copy = detach_held(recv)
        wrong = Receiver(link2, 0, layout=A[2 - rank], engines=second, delta=True, **kw)
        with pytest.raises(ValueError, match="same parameters"):
            adopt_held(wrong, copy)
        recv = Receiver(link2, 0, layout=layout, engines=second, delta=True, **kw)
        out["carried"] = adopt_held(recv, copy)
    else:
        recv = Receiver(link2, 0, layout=layout, engines=second, delta=True, **kw)
    for step in (2, 3):
        update(recv, step)
    return out


def test_a_rebuilt_fleet_keeps_its_deltas_where_both_ends_agree():
    results = launch(4, _rank, timeout_s=120)
    assert all(status == "ok" for status, _ in results.values()), results
    sender, a0, a1, b = (results[r][1] for r in range(4))
    assert sender["carried"] == IDS and a0["carried"] == IDS and a1["carried"] == IDS
    for got in (a0, a1, b):
        assert all(bad == [] for bad in got["bad"]), got["bad"]
    dense1, delta1, mixed, delta2 = sender["sent"]
    assert delta1 * 10 < dense1, sender["sent"]
    assert 0 < sender["copy_nbytes"] <= dense1
    # the first update on link 2: dense to B and to the class B shares with A, deltas elsewhere
    assert delta2 * 10 < mixed < sender["dense"], sender["sent"]
    for a in (a0, a1):
        dense_a, delta_a, mixed_a, last_a = a["got"]
        assert delta_a * 10 < dense_a and delta_a < mixed_a < dense_a and last_a * 10 < dense_a, a["got"]
    dense_b, last_b = b["got"]
    assert last_b * 10 < dense_b, b["got"]


def test_a_regrouped_layer_is_assembled_piece_by_piece():
    """A new link's segments from the old kept bytes: an equal segment is the old tensor itself
    (once; a second equal segment is a copy), a regrouped one has each piece's old bytes at its new
    offset, zeros between pieces and for a piece new to the link; a piece another sender sent on
    the old link leaves the layer uncarried."""
    from glm_fp8.engine.layout import Shard
    from glm_fp8.transfer.delta.carry import KeptLayer, assemble_kept, piece_key
    from glm_fp8.transfer.pack import ShardPack, ShardPiece
    from glm_fp8.transfer.wire import CHECKSUM_BYTES

    def piece(name, offset, n=96):
        return ShardPiece(name, torch.uint8, (n,), offset, Shard("replicated"))

    def pack(*pieces, nbytes=512):
        return ShardPack(tuple(pieces), nbytes + CHECKSUM_BYTES)

    x, y, z = piece("x", 0), piece("y", 128), piece("z", 0)
    old_xy, old_z = pack(x, y), pack(z)
    kept_xy = torch.randint(1, 256, (512,), dtype=torch.uint8)
    kept_xy[96:128], kept_xy[224:] = 0, 0  # between and after the pieces: zero, as a delta keeps them
    kept_z = torch.randint(0, 256, (512,), dtype=torch.uint8)
    on_link = frozenset(piece_key(p) for p in (x, y, z, piece("v", 0)))  # v: another sender sent it
    old = KeptLayer(7, [(old_xy.pieces, kept_xy), (old_z.pieces, kept_z)], on_link)
    new_y_w = pack(piece("y", 256), piece("w", 0))  # y moved, w new to the link
    poisoned = lambda n: torch.full((n,), 0xFF, dtype=torch.uint8)  # noqa: E731
    got = assemble_kept([old_xy, new_y_w, old_xy], old, poisoned)
    assert got[0] is kept_xy
    assert got[2] is not kept_xy and torch.equal(got[2], kept_xy)
    want = torch.zeros(512, dtype=torch.uint8)
    want[256:352] = kept_xy[128:224]
    assert torch.equal(got[1], want)
    # a piece another sender sent on the old link (its owner moved): not carried, dense for all
    assert assemble_kept([pack(piece("v", 0))], old, poisoned) is None


def test_many_senders_carry_only_layers_whose_pieces_stay_with_their_sender():
    """Three senders into EP 2, then a TP 1 server added: the senders' share of the non-split
    entries is rebalanced within each step (glm_fp8.transfer.owners), so pieces move to another
    sender. A
    sender carries a layer only where each piece it now sends is one it sent before or one no
    sender sent (new to the link); the others go dense for every rank (delta_layers needs every
    sender's version). A dropped Sender is freed at once. Runs the Senders' planning only: a
    stand-in link, kept copies of zeros."""
    from glm_fp8.transfer import DeltaOptions, HostSinkComm, Sender
    from glm_fp8.transfer.delta.carry import adopt_kept, detach_kept, piece_key

    config = {**CONFIG, "num_hidden_layers": 16}
    ids, n = list(range(16)), 3
    before, after = (
        [None] * n + EngineLayout.all_ranks(2, 1, True),
        [None] * n + [B, *EngineLayout.all_ranks(2, 1, True)],
    )

    def sender(engines, me):
        link = HostSinkComm(rank=me, size=len(engines))
        return Sender(
            link,
            me,
            config=config,
            layer_ids=ids,
            engines=engines,
            senders=list(range(n)),
            device="cpu",
            delta=DeltaOptions(),
        )

    dense = set()
    for me in range(n):
        old = sender(before, me)
        for pos, lay in enumerate(old.routes.layers):
            old.delta.kept[pos] = [torch.zeros(s.data_nbytes, dtype=torch.uint8) for s in lay.of_sender(me)]
            old.delta.versions.compared(pos, 5)
        mine = [{piece_key(p) for s in lay.of_sender(me) for p in s.pieces} for lay in old.routes.layers]
        sent = [{piece_key(p) for s in lay.segments for p in s.pieces} for lay in old.routes.layers]
        new = sender(after, me)
        carried, dropped = adopt_kept(new, detach_kept(old)), weakref.ref(old)
        del old  # freed at once (its delta state holds it weakly): its rings do not outlive it
        assert dropped() is None
        for pos, lay in enumerate(new.routes.layers):
            keys = {piece_key(p) for s in lay.of_sender(me) for p in s.pieces}
            stays = all(k in mine[pos] or k not in sent[pos] for k in keys)
            assert (lay.layer_idx in carried) == stays, (me, lay.layer_idx)
            assert new.delta.versions.kept[pos] == (5 if stays else -1)
        dense |= set(ids) - set(carried)
    assert dense, dense  # some owners moved: each step's owners are balanced for the new fleet
