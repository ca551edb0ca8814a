"""Delta updates through Sender / Receiver (docs/delta.md#in-the-transfer) over gloo, in every mode
(one sender into "full" receivers, one sender into engine layouts, two senders into EP 2, and
into TP 2, where each sender's pieces are some rows of every routed-expert stack): a sequence of
updates whose weights change a little each time, with a restarted engine rank, a manifest refused,
an update that fails midway (NaN weights), an engine parameter written behind the update's back
(the rebuilt segment's checksum differs, so every rank takes that layer again, dense, in the same
update), a rebuild that raises on one rank (the link stays in step; that layer is resent dense,
and that rank takes it dense from then on),
a resync, and a layer to resend in an update where an engine rank fails
while landing an earlier layer (every rank stops at the first resent step); after every update
that passed, every engine byte equals the reference conversion of the current weights, and delta
steps put a small fraction of a dense step's bytes on the link. Plus the pieces both ends derive alike
(glm_fp8.transfer.delta.segments) and the refusals at construction."""

import contextlib

import pytest
import torch

from glm_fp8.engine import EngineLayout
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.testing import launch, moved_layer, reference_engine_params
from glm_fp8.transfer.delta.segments import delta_layers, versions_row
from glm_fp8.transfer.delta.versions import NONE

CONFIG = {**TINY_GLM5, "num_nextn_predict_layers": 0}
IDS = list(range(CONFIG["num_hidden_layers"]))  # two dense MLP layers, two MoE layers
NAN_LAYER = 2
FAIL_LAYER = IDS[-2]  # an engine rank fails landing it while the last layer is to be resent
REBUILD_LAYER = 1  # an engine rank's rebuild of it raises ("after tamper"): resent dense, then dense to it
# (what happens at each update); the sender's update index is the position in this list
SCRIPT = [
    "mismatch",
    "first",
    "delta",
    "restart",
    "delta",
    "nan",
    "after nan",
    "tamper",
    "after tamper",
    "resync",
    "fail",
    "after fail",
]
# On a GPU machine every rank works on the one GPU (the H200 run: bench/gpu_run.sh's GPU_TESTS),
# with the Triton kernels; else on the CPU with the torch path.
GPU = "cuda" if torch.cuda.is_available() else "cpu"
DEV = GPU  # this process's mode's device (set by _rank): the senders' mode runs on the CPU
RESYNC = {"full": None, "scatter": 8, "senders": 8, "senders tp": None}  # 8: the 9th update ("resync") dense
KEPT = {"full": "host", "scatter": "gpu", "senders": "gpu", "senders tp": "host"}  # DeltaOptions.kept
SENDERS = {"full": 1, "scatter": 1, "senders": 2, "senders tp": 2}  # two trainer ranks, each its own experts


def _weights(step: int, layer_idx: int, nan: bool = False) -> dict[str, torch.Tensor]:
    """The trainer's layer at update ``step`` (``moved_layer``: 0.2 % of each tensor's elements
    scaled by 0.7, which changes their fp8 bytes and rarely a block's scale); ``nan``: one NaN in
    layer ``NAN_LAYER``."""
    sd = moved_layer(CONFIG, layer_idx, step)
    if nan and layer_idx == NAN_LAYER:
        sd[f"model.layers.{layer_idx}.self_attn.o_proj.weight"][3, 5] = float("nan")
    return sd


def _reference(step: int, layout: EngineLayout | None) -> dict[str, torch.Tensor]:
    """What an engine rank holds after update ``step``: the reference conversion, whole under the
    kernel-format names (layout None), or cut by the rank's shards under vLLM's names."""
    from glm_fp8.kernels.reference import convert_layer_ref
    from glm_fp8.model.plans import plan_from_config
    from glm_fp8.model.trainer_layouts import strip_layer

    if layout is not None:
        return reference_engine_params(CONFIG, layout, IDS, layer=lambda i: _weights(step, i))
    full = {}
    for i in IDS:
        full.update(convert_layer_ref(strip_layer(_weights(step, i), i), i, plan_from_config(CONFIG, i)))
    return full


def _poisoned(want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    params = {n: torch.empty(w.shape, dtype=w.dtype, device=DEV) for n, w in want.items()}
    for p in params.values():
        p.view(torch.uint8).fill_(0xFF)  # NaN in every float dtype
    return params


def _trainer_layer(step: int, layer_idx: int, mesh, nan: bool) -> dict[str, torch.Tensor]:
    """``_weights`` on ``DEV``; with a ``mesh`` (many senders) as FSDP2 holds it over the senders
    (every tensor of two or more dims ``Shard(0)``: each sender whole experts)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    sd = {k: t.to(DEV) for k, t in _weights(step, layer_idx, nan).items()}
    if mesh is None:
        return sd
    return {k: distribute_tensor(t, mesh, [Shard(0) if t.dim() >= 2 else Replicate()]) for k, t in sd.items()}


def _rank(rank, world, mode):
    from glm_fp8.kernels.backends import set_default_backend
    from glm_fp8.transfer import Receiver, Sender
    from glm_fp8.transfer.options import DeltaOptions

    global DEV
    # Two senders on one GPU would run their own collectives over gloo on CUDA tensors, which
    # failed on the H200 ("writev: Bad address"); bench/scripts/pipeline.py runs a sender of many
    # on the GPU.
    DEV = "cpu" if mode.startswith("senders") else GPU
    if DEV == "cpu":  # the transfer is under test, not the kernels (tests/kernels): the torch path
        set_default_backend("torch")
    else:  # every rank on the one GPU (gloo stages point-to-point messages through the host)
        torch.cuda.set_device(0)
    torch.set_num_threads(1)  # three or four processes on two cores
    n = SENDERS[mode]
    engines = [None] * n + ([] if mode == "full" else _layouts(mode))
    kw = dict(config=CONFIG, layer_ids=IDS, engines=None if mode == "full" else engines, device=DEV)
    if n > 1:
        kw["senders"] = list(range(n))
    out = []
    if rank < n:
        mesh = None
        if n > 1:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh(DEV, torch.arange(n))
        sender = Sender(None, 0, delta=DeltaOptions(resync_every=RESYNC[mode], kept=KEPT[mode]), **kw)
        if DEV == "cpu" and mode == "scatter":  # the sender's Triton packing too, in the interpreter
            sender.delta.backend = "triton"
        for step, what in enumerate(SCRIPT):
            nan = what == "nan"
            layers = ((i, _trainer_layer(step, i, mesh, nan)) for i in IDS)
            try:
                out.append(("ok", [s.nbytes for s in sender.send_model(layers).layers]))
            except Exception as exc:  # noqa: BLE001 - compared by the test
                out.append((type(exc).__name__, str(exc)))
        return out
    layout = None if mode == "full" else engines[rank]
    want = _reference(0, layout)
    recv, params = Receiver(None, 0, layout=layout, delta=True, **kw), _poisoned(want)
    for step, what in enumerate(SCRIPT):
        if what == "restart" and rank == n + 1:  # a new engine process: nothing held, poisoned parameters
            recv, params = Receiver(None, 0, layout=layout, delta=True, **kw), _poisoned(want)
        this = recv
        if what == "tamper" and rank == n:  # a layer-0 byte written outside an update: resent dense
            name = next(n for n in params if ".layers.0." in n)
            params[name].view(torch.uint8).view(-1)[0] ^= 1
        if what == "fail" and rank == n:  # a byte of the last layer written outside an update: resent
            name = next(n for n in params if f".layers.{IDS[-1]}." in n)
            params[name].view(torch.uint8).view(-1)[0] ^= 1
        if what == "mismatch" and rank == n:
            this = Receiver(None, 0, layout=layout, **kw)  # no delta=: refuses the manifest
        try:
            land = FAIL_LAYER if what == "fail" and rank == n + 1 else None
            rebuild = REBUILD_LAYER if what == "after tamper" and rank == n + 1 else None
            with _failing_landing(land), _failing_rebuild(rebuild):
                stats = this.load_into(params)
        except Exception as exc:  # noqa: BLE001 - compared by the test
            out.append((type(exc).__name__, str(exc)))
            continue
        want = _reference(step, layout)
        same = {
            n: torch.equal(params[n].cpu().view(torch.uint8), w.view(torch.uint8)) for n, w in want.items()
        }
        differ = [n for n, ok in same.items() if not ok]
        out.append(("ok", differ, [s.nbytes for s in stats.layers]))
    return out


@contextlib.contextmanager
def _failing_landing(layer_idx: int | None):
    """The receiver's landing raises at layer ``layer_idx`` (None: lands as usual)."""
    from glm_fp8.transfer import receiver

    land = receiver.land_layer

    def failing(views, *args, **kw):
        if layer_idx is not None and any(f".layers.{layer_idx}." in name for name, _, _ in views):
            raise RuntimeError(f"landing layer {layer_idx} failed (injected)")
        return land(views, *args, **kw)

    receiver.land_layer = failing
    try:
        yield
    finally:
        receiver.land_layer = land


@contextlib.contextmanager
def _failing_rebuild(layer_idx: int | None):
    """The receiver's rebuild of layer ``layer_idx`` from its parameters raises (None: as usual)."""
    from glm_fp8.transfer.delta.receive import ReceiverDelta

    rebuild = ReceiverDelta._rebuild

    def failing(self, pos, *args):
        if layer_idx is not None and self.layer_ids[pos] == layer_idx:
            raise RuntimeError(f"rebuilding layer {layer_idx} failed (injected)")
        return rebuild(self, pos, *args)

    ReceiverDelta._rebuild = failing
    try:
        yield
    finally:
        ReceiverDelta._rebuild = rebuild


def _layouts(mode: str) -> list[EngineLayout]:
    if mode == "scatter":
        return EngineLayout.all_ranks(2)
    if mode == "senders tp":  # many senders, each a part of every routed expert stack's rows
        return EngineLayout.all_ranks(2)
    return [EngineLayout(dp_size=2, dp_rank=r, ep_size=2, ep_rank=r) for r in range(2)]  # EP 2, many senders


@pytest.mark.parametrize("mode", ["full", "scatter", "senders", "senders tp"])
@pytest.mark.slow
def test_delta_updates_land_exactly_the_dense_bytes(mode):
    n = SENDERS[mode]
    results = launch(n + 2, _rank, (mode,), timeout_s=120)
    assert all(status == "ok" for status, _ in results.values()), results
    sender = results[0][1]
    engines = [results[r][1] for r in (n, n + 1)]
    assert sender[0][0] == "ManifestMismatch" and "refused the manifest" in sender[0][1]
    assert engines[0][0][0] == "ManifestMismatch" and "delta" in engines[0][0][1]
    assert engines[1][0][0] == "UpdateAborted"
    nan, fail = SCRIPT.index("nan"), SCRIPT.index("fail")
    # each sender that converts o_proj (one, or one per class of engine ranks: owners.Owner) finds
    # its NaN; every other sender is stopped by its vote
    found = [results[t][1][nan] for t in range(n)]
    assert any(got[0] == "NonFiniteError" and "o_proj" in got[1] for got in found), found
    assert all(got[0] in ("NonFiniteError", "UpdateAborted") for got in found), found
    for got in engines:
        assert got[nan][0] == "UpdateAborted" and f"layer {NAN_LAYER}" in got[nan][1], got[nan]
    # the failure is voted at the first resent step (the last layer), where every rank stops
    refused = f"rank {n + 1} failed while landing a layer in its parameters (layer {IDS[-1]})"
    assert sender[fail][0] == "ReceiverRefused" and refused in sender[fail][1], sender[fail]
    assert engines[1][fail] == ("RuntimeError", f"landing layer {FAIL_LAYER} failed (injected)"), engines[1]
    assert engines[0][fail][0] == "UpdateAborted" and refused in engines[0][fail][1], engines[0][fail]
    for other in range(1, n):  # every other sender stops at the same updates, and only there
        got = results[other][1]
        assert [status == "ok" for status, _ in got] == [status == "ok" for status, _ in sender], got
    for step in range(1, len(SCRIPT)):
        if step in (nan, fail):
            continue
        for r, got in enumerate(engines, n):
            assert got[step][0] == "ok" and got[step][1] == [], (mode, step, r, got[step])
    for k in range(n):
        _check_bytes(mode, results[k][1], engines)


def _check_bytes(mode: str, sender: list, engines: list) -> None:
    """What went dense and what as a delta at each update, per layer, as the sender and each engine
    rank counted it: a delta is small; "mixed" (a layer one engine rank holds and the other does
    not) is a delta to the first and dense to the second wherever their segments travel point to
    point, dense for both in a shared broadcast (the full broadcast: dense)."""
    nan, fail = SCRIPT.index("nan"), SCRIPT.index("fail")
    dense = sender[1][1]  # the first update: every layer dense (no kept copy)
    resync = RESYNC[mode] is not None and SCRIPT.index("resync")
    mixed = "dense" if mode == "full" else "mixed"

    def small(n, d, w):
        both = d < n < d * 11 // 10  # a delta, then the layer dense
        # a delta: a fifth of dense at most (one sender's share: the passthrough entries it owns
        # go dense, and which it owns follows the step's balance, glm_fp8.transfer.owners)
        return {"dense": n == d, "delta": 0 < n * 5 < d, "both": both, "mixed": 0 < n <= d}[w]

    for step, what in enumerate(SCRIPT):
        if step in (0, nan, fail):
            continue
        if what == "first" or step == resync:
            want = [["dense"] * len(IDS)] * 3  # (the sender, engine rank n, engine rank n + 1)
        elif what == "restart":  # rank n + 1 holds nothing: dense to it, deltas to rank n
            want = [[mixed] * len(IDS), [mixed] * len(IDS), ["dense"] * len(IDS)]
        elif what == "after nan":  # layers from NAN_LAYER on were compared, not landed: dense
            want = [["dense" if i >= NAN_LAYER else "delta" for i in IDS]] * 3
        elif what == "tamper":  # layer 0's delta, then layer 0 again, dense, for every rank
            want = [["both" if i == 0 else "delta" for i in IDS]] * 3
        elif what == "after tamper":  # rank n + 1's rebuild of REBUILD_LAYER failed: resent dense
            want = [["both" if i == REBUILD_LAYER else "delta" for i in IDS]] * 3
        elif what == "after fail":  # rank n + 1 did not land FAIL_LAYER, no rank the last layer
            last = ["dense" if i == IDS[-1] else "delta" for i in IDS]
            want = [[mixed if i == FAIL_LAYER else w for i, w in zip(IDS, last)] for _ in range(2)]
            want.append(["dense" if i >= FAIL_LAYER else "delta" for i in IDS])
        else:
            want = [["delta"] * len(IDS)] * 3
        if step > SCRIPT.index("after tamper"):  # rank n + 1 takes REBUILD_LAYER dense from then on
            k = IDS.index(REBUILD_LAYER)
            want = [list(w) for w in want]
            if want[2][k] == "delta":
                want[0][k], want[1][k], want[2][k] = mixed, mixed, "dense"
        # (a sender may own nothing of a layer: 0 bytes either way)
        got = sender[step][1]
        assert all(small(n, d, w) for n, d, w in zip(got, dense, want[0]) if d), (mode, step, got, dense)
        for got_r, want_r in zip(engines, want[1:]):  # what each engine rank took off the link
            received, first = got_r[step][2], got_r[1][2]
            assert all(small(n, d, w) for n, d, w in zip(received, first, want_r)), (mode, step, received)
    if mode != "full":  # the rank that held its layers took part of them as deltas
        restart = SCRIPT.index("restart")
        assert any(n < d for n, d in zip(engines[0][restart][2], engines[0][1][2])), engines[0][restart]


def test_every_rank_decides_each_layer_from_the_versions_table():
    """Rank 0 sends (kept versions, update number last); ranks 1 and 2 hold. A layer goes as a
    delta to each engine rank that holds the sender's kept version, dense to the others; nowhere
    where the sender has no kept copy."""
    rows = [
        versions_row(3, 0, [5, 5, NONE, 5, 9], "cpu"),
        versions_row(3, 1, [5, 5, 5, 4, NONE], "cpu"),
        versions_row(3, 2, [5, NONE, 5, 5, NONE], "cpu"),
    ]
    table = torch.stack(rows).amax(dim=0)
    both, one, two, none = frozenset({1, 2}), frozenset({1}), frozenset({2}), frozenset()
    assert delta_layers(table, [0], [1, 2]) == (9, [both, one, none, two])
    assert delta_layers(table, [0], [1]) == (9, [one, one, none, none])


def test_a_segment_goes_as_a_delta_to_each_rank_that_holds_its_version():
    """Point to point, each rank of a segment's class that holds the version takes it as a delta,
    the others dense; a group broadcast (one message for the class) is a delta only when every
    rank of its class holds the version."""
    from types import SimpleNamespace

    from glm_fp8.transfer.delta.segments import delta_to

    lay = SimpleNamespace(classes=[(1, 2, 3)])
    p2p, group = SimpleNamespace(cls=0, group=None), SimpleNamespace(cls=0, group=(0, 1, 2, 3))
    assert delta_to(lay, p2p, frozenset({1, 3})) == (1, 3)
    assert delta_to(lay, group, frozenset({1, 3})) == ()
    assert delta_to(lay, group, frozenset({1, 2, 3})) == (1, 2, 3)
    assert delta_to(lay, p2p, frozenset()) == ()


def test_many_senders_agree_on_the_update_and_move_each_layer_together():
    """Senders 0 and 1 each propose an update number (the largest is the update's) and vote their
    kept versions; a layer is a delta only where both keep the same version and the engine rank
    holds it: one sender out of step (rebuilt: no kept copy; or behind) makes that layer dense."""
    rows = [
        versions_row(3, 0, [5, 5, 5, NONE, 11], "cpu"),
        versions_row(3, 1, [5, NONE, 4, NONE, 12], "cpu"),
        versions_row(3, 2, [5, 5, 5, NONE, NONE], "cpu"),
    ]
    table = torch.stack(rows).amax(dim=0)
    one, none = frozenset({2}), frozenset()
    assert delta_layers(table, [0, 1], [2]) == (12, [one, none, none, none])
    assert delta_layers(table, [0], [2]) == (11, [one, one, one, none])


def test_delta_is_refused_where_it_is_not_built():
    from glm_fp8.transfer import HostSinkComm, Sender
    from glm_fp8.transfer.options import DeltaOptions

    with pytest.raises(ValueError, match="resync_every"):
        DeltaOptions(resync_every=0)
    with pytest.raises(ValueError, match="wire='fp8'"):
        Sender(HostSinkComm(), 0, config=CONFIG, wire="bf16", device="cpu", delta=DeltaOptions())
    with pytest.raises(ValueError, match="checksum=True"):
        Sender(HostSinkComm(), 0, config=CONFIG, checksum=False, device="cpu", delta=DeltaOptions())
    with pytest.raises(TypeError, match="DeltaOptions"):
        Sender(HostSinkComm(), 0, config=CONFIG, device="cpu", delta=True)


def test_an_engine_rank_whose_landing_converts_refuses_delta():
    """Delta rebuilds the old segment from the parameters, so landing must be a plain byte copy:
    a 'full' rank with a layout (landing cuts whole entries), a widening dtype pair and the bf16
    wire (landing quantizes) are refused at construction, naming why."""
    from types import SimpleNamespace

    from glm_fp8.engine import engine_params
    from glm_fp8.model.plans import plan_from_config
    from glm_fp8.model.trainer_layouts import layer_prefix
    from glm_fp8.transfer import HostSinkComm, Receiver
    from glm_fp8.transfer.delta.receive import check_receiver_delta

    layout = EngineLayout.all_ranks(2)[0]
    with pytest.raises(ValueError, match="'full' with a layout: landing cuts"):
        Receiver(
            HostSinkComm(rank=1, size=2),
            0,
            config=CONFIG,
            layout=layout,
            engines=[None, "full"],
            device="cpu",
            delta=True,
        )
    with pytest.raises(ValueError, match="wire='fp8'"):
        Receiver(HostSinkComm(rank=1, size=2), 0, config=CONFIG, wire="bf16", device="cpu", delta=True)
    with pytest.raises(ValueError, match="delta: expected True or False"):
        Receiver(HostSinkComm(rank=1, size=2), 0, config=CONFIG, device="cpu", delta="yes")
    plan = plan_from_config(CONFIG, 3)
    targets = {p.kernel_name: p for p in engine_params(CONFIG, layout).values()}
    bias = next(e for e in plan.entries if e.name.endswith("e_score_correction_bias"))
    name = layer_prefix(3) + bias.name
    targets[name] = SimpleNamespace(name=targets[name].name, dtype=torch.float64)  # a widening landing
    with pytest.raises(ValueError, match="lands widened"):
        check_receiver_delta(
            wire="fp8",
            checksum=True,
            full=False,
            layout=layout,
            rank=1,
            layer_ids=[3],
            plans=[plan],
            targets=targets,
        )


def test_a_layer_with_an_aliased_parameter_goes_dense_once_its_rebuild_differed():
    """Landing skips an alias (it holds another parameter's bytes), so its layer is rebuilt from
    that parameter: exact where the trainer ties the two (the MTP head and lm_head). The rank votes
    the layer as held until a rebuild of it differed (a resend), and as held by no update (dense)
    from then on; a resent layer without an alias stays a delta."""
    from glm_fp8.transfer import HostSinkComm, Receiver

    recv = Receiver(HostSinkComm(rank=1, size=2), 0, config=CONFIG, device="cpu", delta=True)
    recv.delta.held.held = [5] * len(IDS)
    recv.delta.aliases = {"model.layers.1.self_attn.o_proj.weight": "model.layers.0.self_attn.o_proj.weight"}
    assert recv.delta.row() == [5] * len(IDS)
    recv.delta.resend(2)
    recv.delta.resend(1)
    assert recv.delta.resends() == [1, 2] and recv.delta.is_delta == [False] * len(IDS)
    assert recv.delta.row() == [5, NONE, 5, 5]


def test_a_resend_vote_is_outranked_by_every_refusal():
    """A vote is an all-reduce MAX: RESEND_DENSE (a delta layer to take again, dense) is the lowest
    reason, so a refusal of any rank at the same step, whatever its rank number, is what every
    rank reads."""
    from glm_fp8.transfer.wire import REFUSAL_REASONS, RESEND_DENSE, refusal_code

    assert RESEND_DENSE == min(REFUSAL_REASONS)
    highest_rank = (1 << 20) - 1
    assert all(
        refusal_code(RESEND_DENSE, highest_rank) < refusal_code(r, 0)
        for r in REFUSAL_REASONS
        if r != RESEND_DENSE
    )
