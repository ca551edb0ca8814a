"""glm_fp8's vLLM weight-transfer backend, both sides, through a ``VLLMWeightSyncClient`` stand-in.

Invariants:
- Every mode (one sender's full broadcast and scatter, many senders) into TP, EP and TP x DP
  engines: after ``send_weights`` on every trainer rank, every engine parameter equals the
  reference conversion cut by its shard and rewritten as the engine's MoE backend holds it
  (FlashInfer CUTLASS: [w3; w1], scales >= 1e-10), bit for bit, step after step.
- Sources: glm_fp8's ``LayerSource`` and vLLM's ``WeightSource`` (``iter_full`` for one sender,
  ``iter_local``'s pieces made DTensors again for many), prime-rl's and Hugging Face's layouts.
- The MTP layer travels in vLLM's draft session (the drafter handed over then), or in the same
  update as the target ("stream", the worker extension's way).
- A worker's refusal reaches every rank: ``send_weights()`` raises on every trainer rank and the
  client's ``update_weights`` on every worker, naming the rank; the next update then lands. A
  worker that cannot take part refuses at init, and every rank raises naming it.

No vLLM: the engine side is ``WorkerSide`` over stand-in modules with vLLM's names (as in
test_vllm_worker.py); each worker process serves the client's calls from a queue, as
``collective_rpc`` would. Processes share a gloo default group (the DTensors' meshes); the link
is the backend's own store-made group.
"""

import time
from dataclasses import dataclass
from functools import cached_property

import pytest
import torch

from glm_fp8.model.families import REST
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.testing import free_port, launch, moved_layer, reference_engine_params, synthetic_layer

NO_MTP = {**TINY_GLM5, "num_nextn_predict_layers": 0}
MTP = TINY_GLM5["num_hidden_layers"]


# --- the client stand-in and the worker loop ------------------------------------------------------


class QueueClient:
    """``VLLMWeightSyncClient`` over queues: each call runs on every worker, as ``collective_rpc``;
    a worker's error is raised here naming it."""

    def __init__(self, boxes, draft: bool = True):
        self.boxes = boxes
        if not draft:
            self.start_draft_weight_update = None

    def _rpc(self, cmd, *args):
        for inbox, _ in self.boxes:
            inbox.put((cmd, args))
        errors = [
            f"worker {w}: {msg}"
            for w, (status, msg) in enumerate(out.get(timeout=120) for _, out in self.boxes)
            if status != "ok"
        ]
        if errors:
            raise RuntimeError("; ".join(errors))

    def init_weight_transfer_engine(self, init_info):
        self._rpc("init", init_info)

    def start_weight_update(self):
        self._rpc("start")

    def start_draft_weight_update(self):
        self._rpc("start_draft")

    def update_weights(self, update_info):
        self._rpc("receive", update_info)

    def finish_weight_update(self, weight_version=None):
        self._rpc("finish")


class SkippingClient(QueueClient):
    """A client whose first two updates never reach a session: step 1's ``start_weight_update``
    does nothing (each worker's own ``receive`` refuses), step 2's too and its ``update_weights``
    is refused by the worker before glm_fp8 sees it (vLLM's ``Worker.update_weights`` outside a
    session); step 3 is whole."""

    def __init__(self, boxes):
        super().__init__(boxes)
        self.steps = 0

    def start_weight_update(self):
        self.steps += 1
        if self.steps > 2:
            self._rpc("start")

    def update_weights(self, update_info):
        self._rpc("vllm_refuse" if self.steps == 2 else "receive", update_info)


def _serve(side, drafter, inbox, outbox, log):
    """The worker: what vLLM's worker does with each call (a draft session hands the drafter over)."""
    while True:
        cmd, args = inbox.get()
        if cmd == "stop":
            return
        try:
            if cmd == "start_draft":
                side.start(drafter)
            elif cmd == "vllm_refuse":  # vLLM's Worker.update_weights without a session
                raise RuntimeError("start_weight_update must be called before update_weights.")
            else:
                getattr(side, cmd)(*args)
            outbox.put(("ok", None))
        except BaseException as exc:  # noqa: BLE001 - reported to the client, as vLLM's RPC does
            log.append(f"{type(exc).__name__}: {exc}")
            outbox.put(("error", f"{type(exc).__name__}: {exc}"))


def _layouts(case: str):
    from glm_fp8.engine import EngineLayout

    if case == "tp2":
        return EngineLayout.all_ranks(2)
    if case == "ep2":
        return EngineLayout.all_ranks(2, 1, True)
    return EngineLayout.all_ranks(2, 2)  # tp2 x dp2


def _expected(config, layout, ids, dtype, gathered):
    """The reference an engine rank holds after an update, as the FlashInfer backend stores it."""

    return _as_flashinfer(reference_engine_params(config, layout, ids, dtype=dtype, gathered_dtype=gathered))


def _as_flashinfer(want: dict) -> dict:
    """What the FlashInfer CUTLASS backend holds after loading ``want``: w13 halves swapped, the
    routed experts' scales clamped to >= 1e-10."""
    from test_vllm_worker import _vllm_swap_w13_to_w31

    for name in list(want):
        if "routed_experts.w13_weight" in name:
            want[name] = _vllm_swap_w13_to_w31(want[name])
        if "routed_experts.w" in name and name.endswith("_scale_inv"):
            want[name] = want[name].clamp(min=1e-10)
    return want


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _delta_outcome(config, layout, ids, snapshots, aliases, log, layer, backend) -> dict:
    """Per update this worker landed: its session, the bytes it took off the link, and the
    parameters of that session's layers that differ from the reference of the trainer's step
    (``layer(i, step)``), as the MoE ``backend`` holds them (FlashInfer CUTLASS: rewritten after
    loading; DeepGEMM: UE8M0 scales, sent as such)."""
    fmt = "ue8m0" if backend == "DEEPGEMM" else None
    per_update, step, checked = [], -1, 0
    for session, nbytes, params in snapshots:
        step += session != "draft"  # a draft session follows its step's target session
        mine = [MTP] if session == "draft" else [i for i in ids if i != MTP]
        moved = lambda i, step=step: layer(i, step)  # noqa: E731
        want = reference_engine_params(config, layout, mine, scale_fmt=fmt, layer=moved)
        want = _as_flashinfer(want) if backend == "FLASHINFER_CUTLASS" else want
        bad = [n for n, w in want.items() if n not in aliases and not _same_bytes(params[n], w)]
        checked += len(want)
        per_update.append((session, nbytes, bad))
    return {"updates": per_update, "checked": checked, "log": log}


# --- a vLLM WeightSource stand-in (vllm/distributed/weight_transfer/base.py's ModuleSource) -------


@dataclass(frozen=True)
class Shard:
    dim: int


@dataclass(frozen=True)
class Replicate:
    pass


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple
    owners: tuple | None = None
    mesh_shape: tuple | None = None
    placements: tuple | None = None


class StandInModuleSource:
    """vLLM 0.34's ``ModuleSource`` over ``{name: tensor or DTensor}``: the same metadata (owners,
    mesh shape, placements), ``iter_full`` (``full_tensor()``), ``iter_local`` (``to_local()``)."""

    def __init__(self, params: dict):
        self.params = params

    @cached_property
    def metadata(self):
        from torch.distributed.tensor import DTensor

        out = []
        for name, p in self.params.items():
            if not isinstance(p, DTensor):
                out.append(ParamMeta(name, p.dtype, tuple(p.shape)))
                continue
            grid = p.device_mesh.mesh
            places = tuple(Shard(q.dim) if hasattr(q, "dim") else Replicate() for q in p.placements)
            places = None if all(isinstance(q, Replicate) for q in places) else places
            owners = tuple(grid.flatten().tolist())
            out.append(ParamMeta(name, p.dtype, tuple(p.shape), owners, tuple(grid.shape), places))
        return out

    def iter_full(self):
        for name, p in self.params.items():
            yield name, p.full_tensor() if hasattr(p, "full_tensor") else p

    def iter_local(self):
        for name, p in self.params.items():
            yield name, p.to_local() if hasattr(p, "to_local") else p


def _module_params(config, trainers: int, layout: str, dtype):
    """A trainer model's parameters in named_parameters order (embeddings, layers, norm, head),
    as FSDP2 holds them over the trainer ranks: >= 2-D ``Shard(0)``, 1-D replicated."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate as TRep
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor

    mesh = DeviceMesh("cpu", torch.arange(trainers))
    rest = synthetic_layer(config, REST, dtype)
    params = {"model.embed_tokens.weight": rest["model.embed_tokens.weight"]}
    for i in range(config["num_hidden_layers"]):
        params.update(synthetic_layer(config, i, dtype, layout))
    params.update({k: rest[k] for k in ("model.norm.weight", "lm_head.weight")})
    return {k: distribute_tensor(t, mesh, [TShard(0) if t.dim() >= 2 else TRep()]) for k, t in params.items()}


def _as_module(tensors: dict, buffers: frozenset = frozenset()) -> torch.nn.Module:
    """A trainer model holding ``{name: tensor}`` under the module's own names: parameters (FSDP2's
    ``fully_shard`` leaves DTensor parameters there), except the leaves named in ``buffers``,
    plain buffers of the whole tensor (``.full_tensor()``: FSDP2 does not shard buffers)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        if leaf in buffers:
            mod.register_buffer(leaf, t.full_tensor())
        else:
            mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def _hf_like_module(mesh_params: dict) -> torch.nn.Module:
    """A module as a transformers model holds these tensors: parameters, except the routing bias
    ``mlp.gate.e_score_correction_bias``, a plain buffer (FSDP2 does not shard buffers)."""
    return _as_module(mesh_params, frozenset({"e_score_correction_bias"}))


# --- one process of a run -------------------------------------------------------------------------


def _rank(rank, world, trainers, port, boxes, case, opts):
    from test_vllm_worker import _engine, _finalize

    from glm_fp8.core.errors import EngineNotSupported
    from glm_fp8.integrations.vllm.probe import engine_postload_plan
    from glm_fp8.integrations.vllm.sources import LayerSource
    from glm_fp8.integrations.vllm.trainer import TrainerSide
    from glm_fp8.integrations.vllm.trainer_options import TrainerOptions
    from glm_fp8.integrations.vllm.updater import EngineUpdater
    from glm_fp8.integrations.vllm.worker import WorkerSide

    config = TINY_GLM5 if opts.get("mtp") else NO_MTP
    dtype = opts.get("dtype", torch.bfloat16)
    steps = opts.get("steps", 2)
    source_kind = opts.get("source", "layers")
    layout_name = opts.get("layout", "prime_rl")
    module = source_kind in ("module", "module_state")
    mesh_params = _module_params(config, trainers, layout_name, dtype) if module else None
    delta = opts.get("delta", False)
    if delta:  # the transfer is under test, not the kernels (tests/kernels): the torch backend, faster
        from glm_fp8.kernels.backends import set_default_backend

        set_default_backend("torch")
    at = [0]  # the trainer's step: its layers change with it when delta is on

    def moved(i, step):
        sd = moved_layer(config, i, step, dtype)
        for name in sd if opts.get("zero_block") else ():  # an all-zero block: the floor scale
            if name.endswith("mlp.experts.w1"):
                sd[name][1, :128, :128] = 0
        return sd

    def layer(i):
        return moved(i, at[0]) if delta else synthetic_layer(config, i, dtype)

    if rank < trainers:
        if source_kind == "module":
            source = StandInModuleSource(mesh_params)
        elif source_kind == "module_state":
            from glm_fp8.integrations.vllm import ModuleStateSource

            source = ModuleStateSource(_hf_like_module(mesh_params))
        else:
            source = LayerSource(
                lambda ids: ((i, layer(i)) for i in ids),
                rest=lambda: layer(REST),
                mtp=bool(opts.get("mtp")),
                experts_whole=True,
            )
        client = None
        if rank == 0:
            draft = opts.get("draft") != "stream"
            client = SkippingClient(boxes) if opts.get("skip") else QueueClient(boxes, draft=draft)
        options = TrainerOptions(
            "127.0.0.1",
            port,
            engine_ranks=world - trainers,
            config=config,
            mode=opts.get("mode", "auto"),
            draft=opts.get("draft", "auto"),
            rank=rank,
            trainer_ranks=trainers,
            timeout_s=60,
            delta=delta,
            delta_resync_every=opts.get("resync"),
        )
        try:
            side = TrainerSide(options, client, source, torch.device("cpu")).connect()
            results = []
            for step in range(steps):
                at[0] = step
                t0 = time.monotonic()
                try:
                    out = side.send()
                    results.append(("ok", [(o["session"], o["bytes"]) for o in out], side.mode, out))
                except Exception as exc:  # noqa: BLE001 - the test reads every rank's outcome
                    results.append(
                        (
                            type(exc).__name__,
                            str(exc) + "".join(getattr(exc, "__notes__", [])),
                            time.monotonic() - t0,
                        )
                    )
            return results
        finally:
            if rank == 0:
                for inbox, _ in boxes:
                    inbox.put(("stop", ()))
    r = rank - trainers
    layout = _layouts(case)[r]
    target, drafter = _engine(layout, opts.get("backend", "FLASHINFER_CUTLASS"))
    if not opts.get("mtp"):
        drafter = None
    log: list[str] = []

    def make():
        if opts.get("refuse_init") and r == 1:
            raise EngineNotSupported("parallel_config.enable_eplb: not supported (a stand-in refusal)")
        plan = engine_postload_plan(config, target, drafter, deepgemm_e8m0=True)
        attached = drafter if opts.get("draft") == "stream" else None  # the extension sees it from the start
        return EngineUpdater(target, attached, config, layout, plan, finalize=_finalize)

    side = WorkerSide(
        make, lambda senders: senders + r, has_drafter=drafter is not None, device=torch.device("cpu")
    )
    if opts.get("refuse_step") and r == 1:  # its first update's parameters are refused; the next are fine
        real = side.receive

        def refuse_once(info):
            if len(log) == 0 and not hasattr(refuse_once, "done"):
                refuse_once.done = True
                name = "model.layers.2.self_attn.o_proj.weight"
                good = side.updater.engine.params[name]
                side.updater.engine.params[name] = good[:, :-128]
                try:
                    return real(info)
                finally:
                    side.updater.engine.params[name] = good
            return real(info)

        side.receive = refuse_once
    if opts.get("fail_early") and r == 1:  # its first update fails before its receiver exists
        where = opts["fail_early"]
        if where == "gate":  # working out the update's holders, before the gate
            import glm_fp8.integrations.vllm.worker as worker_module

            real_holders = worker_module.session_holders

            def holders_once(*args):
                if not hasattr(holders_once, "done"):
                    holders_once.done = True
                    raise KeyError("a stand-in failure of session_holders")
                return real_holders(*args)

            worker_module.session_holders = holders_once
        else:  # inside EngineUpdater.update, after the gate, before its receiver is built
            real_update = None

            def update_once(comm, src=0, **kw):
                if not hasattr(update_once, "done"):
                    update_once.done = True
                    kw["layer_ids"] = ["not a layer"]
                return real_update(comm, src, **kw)

            real_make = make

            def make_patched():
                nonlocal real_update
                updater = real_make()
                real_update = updater.update
                updater.update = update_once
                return updater

            side.make_updater = make_patched
    snapshots = []  # delta: every parameter after each update, checked against that step's reference
    if delta:
        real_receive = side.receive

        def receive_and_keep(info):
            out = real_receive(info)
            params = {n: p.clone() for n, p in side.updater.engine.params.items()}
            snapshots.append((side.session, out["bytes"], params))
            return out

        side.receive = receive_and_keep
    _serve(side, drafter, *boxes[r], log)
    if side.updater is None:
        return log
    ids = [*range(config["num_hidden_layers"]), *([MTP] if opts.get("mtp") else []), REST]
    if delta:
        aliases = side.updater.engine.aliases
        return _delta_outcome(config, layout, ids, snapshots, aliases, log, moved, opts.get("backend"))
    # No cast before quantizing in any mode (gather_dtype=None): the reference reads the trainer's
    # own dtype, as a checkpoint quantized from the fp32 masters holds them.
    want = _expected(config, layout, ids, dtype, None)
    params = side.updater.engine.params
    aliases = side.updater.engine.aliases
    bad = [n for n, w in want.items() if n not in aliases and not _same_bytes(params[n], w)]
    return {"bad": bad, "checked": len(want), "log": log}


def _run(trainers, case, **opts):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    engines = len(_layouts(case))
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in range(engines)]
    return launch(trainers + engines, _rank, (trainers, free_port(), boxes, case, opts), timeout_s=120)


def _landed(results, trainers):
    for r, (status, out) in results.items():
        assert status == "ok", (r, status, out)
        if r >= trainers:
            assert out["bad"] == [] and out["checked"] > 50 and out["log"] == [], (r, out)


@pytest.mark.parametrize(
    "trainers, case, mode",
    [
        (1, "tp2", "broadcast"),
        (1, "ep2", "scatter"),
        (1, "tp2xdp2", "scatter"),
        (2, "ep2", "senders"),
        (3, "tp2xdp2", "senders"),
    ],
)
def test_every_mode_lands_every_byte_step_after_step(trainers, case, mode):
    results = _run(trainers, case, mode=mode)
    _landed(results, trainers)
    for t in range(trainers):
        assert [s[0] for s in results[t][1]] == ["ok", "ok"] and results[t][1][0][2] == mode, results[t]


@pytest.mark.parametrize(
    "trainers, mode, backend",
    [
        (1, "scatter", "TRITON"),
        (2, "senders", "TRITON"),
        (2, "senders", "FLASHINFER_CUTLASS"),
        (1, "scatter", "DEEPGEMM"),
    ],
)
@pytest.mark.slow
def test_delta_updates_through_the_backend_land_every_byte_and_send_only_what_changed(
    trainers, mode, backend
):
    """delta=True (one sender scattering, or two senders, into EP 2; the Triton MoE backend,
    FlashInfer CUTLASS, which swaps the w13 halves and clamps the expert scales in place after
    loading: the worker undoes both on the copy it rebuilds, or DeepGEMM, whose UE8M0 scales the
    trainer sends as such), three steps whose weights change a
    little each (an expert block all zero: its floor scale is clamped), the MTP layer in the draft
    session: after every update each engine parameter equals the reference of that step's
    weights, as the backend holds them, bit for bit. The target session's steps 2 and 3 send (and
    each worker takes) under a tenth of step 1's bytes: the worker kept its receivers (what they
    hold) across updates, and no layer was resent. So does the draft session (the MTP layer):
    vLLM's drafter aliases the target's lm_head as its shared_head.head, and the worker rebuilds
    that region from lm_head, exact since the trainer ties the two (docs/delta.md)."""
    results = _run(
        trainers, "ep2", delta=True, backend=backend, mtp=True, steps=3, mode=mode, zero_block=True
    )
    assert all(status == "ok" for status, _ in results.values()), results
    for t in range(trainers):  # each sender: its own share, a small fraction of it after step 1
        trainer = results[t][1]
        assert [s[0] for s in trainer] == ["ok"] * 3 and trainer[0][2] == mode, trainer
        sent = [dict(s[1]) for s in trainer]  # per step: {session: bytes}
        target, draft = [s["target"] for s in sent], [s["draft"] for s in sent]
        assert target[0] > 0 and all(b * 10 < target[0] for b in target[1:]), target
        assert draft[0] > 0 and all(b * 10 < draft[0] for b in draft[1:]), draft
    for r in (trainers, trainers + 1):
        out = results[r][1]
        assert out["log"] == [] and out["checked"] > 50, out
        assert [u[0] for u in out["updates"]] == ["target", "draft"] * 3, out["updates"]
        assert all(u[2] == [] for u in out["updates"]), out["updates"]
        for session in ("target", "draft"):
            took = [u[1] for u in out["updates"] if u[0] == session]
            assert took[0] > 0 and all(b * 10 < took[0] for b in took[1:]), (session, took)


def test_fp32_masters_of_a_transformers_like_module_land_unrounded_with_many_senders():
    """A module as transformers holds GLM-5 (HF's names, fp32 masters, FSDP2-style DTensors, the
    fp32 routing bias a plain buffer) through glm_fp8's ``ModuleStateSource``: "auto" picks many
    senders and each rank sends its own pieces; every FP8 byte is the quantization of the fp32
    masters themselves (the reference casts nothing), the bias included."""
    results = _run(2, "ep2", source="module_state", layout="hf", dtype=torch.float32)
    _landed(results, 2)
    assert all(results[t][1][0][2] == "senders" for t in range(2)), results
    # send_weights() reports what each rank sent: its experts and its part of every other entry
    # (each step's balanced between them, glm_fp8.transfer.owners); both the same whole update
    (stats0,), (stats1,) = results[0][1][0][3], results[1][1][0][3]
    assert stats0["sender"] and stats1["sender"] and stats0["update_bytes"] == stats1["update_bytes"] > 0
    assert stats0["bytes"] > 0 and stats1["bytes"] > 0, (stats0, stats1)


def test_fp32_masters_read_whole_by_one_sender_land_unrounded_the_other_rank_reports_no_bytes():
    """The same fp32 masters through vLLM's ``ModuleSource`` (stand-in; the bias a parameter), one
    sender: the same bytes as many senders give (each compared with the uncast reference). The
    rank off the link takes part in the gathers and reports that it sent nothing."""
    results = _run(2, "tp2", source="module", mode="scatter", dtype=torch.float32, layout="hf")
    _landed(results, 2)
    for row in results[1][1]:
        assert row[0] == "ok", row  # a failed step is (kind, text, seconds): its error, not an unpacking's
        status, sent, mode, stats = row
        assert (sent, mode) == ([("target", 0)], "scatter"), results[1]
        assert stats[0]["sender"] is False and stats[0]["update_bytes"] is None, stats
    assert results[0][1][0][3][0]["bytes"] > 0


def test_draft_auto_is_decided_by_the_clients_rank_for_a_rank_off_the_link():
    """Only trainer rank 0 holds the client; rank 1, off the link (one sender), passes client=None
    and takes rank 0's decision through the link's store: both run the draft session."""
    results = _run(2, "ep2", mode="scatter", mtp=True, steps=1)
    _landed(results, 2)
    for t in range(2):
        assert [s for s, _ in results[t][1][0][1]] == ["target", "draft"], results[t]


def test_a_refusal_before_the_transfer_stops_every_rank_at_once_and_the_link_stays_whole():
    """Step 1: the client's start_weight_update never reached the workers, whose update_weights
    refuses ("start_weight_update first"); step 2: vLLM's own worker refuses update_weights before
    glm_fp8 sees it. Both trainer ranks (many senders) raise at once naming the refusal, not
    after the link's timeout (60 s here), and step 3 lands every byte on the same link."""
    results = _run(2, "ep2", mode="senders", skip=True, steps=3)
    for t in (0, 1):
        (kind1, msg1, sec1), (kind2, msg2, sec2), third = results[t][1]
        assert kind1 == kind2 == "RuntimeError" and sec1 < 20 and sec2 < 20, results[t]
        # Whichever reaches rank 0 first names the refusal: every worker's word at the gate ("engine
        # rank N refused"), or the client's error carrying the workers' own ("worker 0: ...").
        assert "start_weight_update first" in msg1 and ("engine rank" in msg1 or "worker 0" in msg1), msg1
        assert "start_weight_update must be called before update_weights" in msg2, msg2
        assert third[0] == "ok", results[t]
    for r in (2, 3):
        status, out = results[r]
        assert status == "ok" and out["bad"] == [] and out["checked"] > 50, (r, out)
        assert len(out["log"]) == 2 and "start_weight_update first" in out["log"][0], out["log"]


@pytest.mark.parametrize("draft", ["auto", "stream"])
@pytest.mark.slow
def test_the_mtp_layer_travels_in_the_draft_session_or_with_the_target(draft):
    """draft="auto" with two trainer ranks (many senders), only rank 0 holding the client (rank 1
    passes client=None): rank 0 decides the draft session, for both ranks."""
    trainers = 2 if draft == "auto" else 1
    results = _run(trainers, "ep2", draft=draft, mtp=True)
    _landed(results, trainers)
    for t in range(trainers):
        sessions = [s for s, _ in results[t][1][0][1]]
        assert sessions == (["target", "draft"] if draft == "auto" else ["stream"]), results[t]


def test_a_workers_refusal_stops_every_rank_and_the_next_update_lands():
    """Engine rank 1 (link rank 3) refuses its parameters at the first update's manifest vote:
    both trainer ranks' ``send_weights`` raise naming it, every worker's ``update_weights``
    raised; the second update lands every byte."""
    results = _run(2, "ep2", mode="senders", refuse_step=True)
    for t in (0, 1):
        first, second = results[t][1]
        assert first[0] == "ManifestMismatch" and "rank 3 refused its parameters" in first[1], results[t]
        assert second[0] == "ok", results[t]
    assert "engine's update_weights raised" in results[0][1][0][1]
    for r in (2, 3):
        status, out = results[r]
        assert status == "ok" and out["bad"] == [], (r, out)
        assert len(out["log"]) == 1, out["log"]
    assert "o_proj.weight" in results[3][1]["log"][0]
    assert "rank 3 refused its parameters" in results[2][1]["log"][0]


@pytest.mark.parametrize("where", ["gate", "update"])
def test_a_worker_error_before_its_receiver_exists_stops_every_rank_at_once(where):
    """Engine rank 1 fails its first update before its receiver joins the link: while working out
    what the update holds (a refusal at the gate), or inside ``EngineUpdater.update`` after the
    "go", where the other ranks are already in the transfer (voted at the update's first vote).
    Both trainer ranks raise naming it within seconds, not after the link's timeout (60 s here),
    and the next update lands every byte on the same link."""
    results = _run(2, "ep2", mode="senders", fail_early=where, steps=2)
    said = "a stand-in failure of session_holders" if where == "gate" else "not a layer"
    for t in (0, 1):
        (kind, msg, sec), second = results[t][1]
        assert said in msg and sec < 20, results[t]
        assert second[0] == "ok", results[t]
    for r in (2, 3):
        status, out = results[r]
        assert status == "ok" and out["bad"] == [] and out["checked"] > 50, (r, out)
        assert len(out["log"]) == 1 and said in out["log"][0], out["log"]


def test_a_worker_that_cannot_take_part_stops_every_rank_at_init():
    results = _run(1, "tp2", refuse_init=True, steps=0)
    assert results[0][0] == "RuntimeError" and "engine rank 2 refused the weight transfer" in results[0][1]
    assert "enable_eplb" in results[0][1], results[0]
    assert any("engine rank 2 refused" in m for m in results[1][1]["log"]), results[1]  # its init raised too
    assert any("EngineNotSupported" in m for m in results[2][1]), results[2]  # the refusing worker's own


class _NoDraftClient:
    """vLLM's HTTP and Ray clients: the four methods, no draft session."""

    def init_weight_transfer_engine(self, init_info): ...
    def start_weight_update(self): ...
    def update_weights(self, update_info): ...
    def finish_weight_update(self, weight_version=None): ...


def test_auto_draft_says_so_when_the_client_cannot_send_the_mtp_layer():
    """draft='auto' with a source that holds the MTP layer and a client without
    ``start_draft_weight_update`` sends the target only, and warns, so that a drafter left on its
    old weights is not a surprise; draft='none' is silent."""
    import warnings

    from glm_fp8.integrations.vllm import LayerSource
    from glm_fp8.integrations.vllm.trainer import TrainerSide
    from glm_fp8.integrations.vllm.trainer_options import TrainerOptions

    source = LayerSource(layers=lambda ids: iter(()), mtp=True)
    opts = dict(master_address="127.0.0.1", master_port=1, engine_ranks=1, config=TINY_GLM5, rank=0)
    with pytest.warns(UserWarning, match=r"_NoDraftClient has no start_draft_weight_update"):
        side = TrainerSide(TrainerOptions(**opts), _NoDraftClient(), source, torch.device("cpu"))
    assert side.init.draft == "none" and side.sessions() == ["target"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        side = TrainerSide(
            TrainerOptions(**opts, draft="none"), _NoDraftClient(), source, torch.device("cpu")
        )
    assert side.sessions() == ["target"]


def test_worker_link_index_is_the_workers_place_in_vllms_world():
    """Each worker of a TP 2 x DP 2 engine gets link index dp * 2 + tp_rank, under vLLM's executors
    (``rank`` within the replica, ``world_size`` = TP x PP) and under ``external_launcher``
    (``rank`` = torchrun's global RANK, ``world_size`` spanning the replicas)."""
    from types import SimpleNamespace

    from glm_fp8.integrations.vllm.worker import worker_index

    def pc(backend: str, dp: int, world_size: int, rank: int) -> SimpleNamespace:
        return SimpleNamespace(
            distributed_executor_backend=backend, data_parallel_index=dp, world_size=world_size, rank=rank
        )

    for dp in range(2):
        for tp in range(2):
            want = dp * 2 + tp
            assert worker_index(pc("mp", dp, 2, tp)) == want
            assert worker_index(pc("external_launcher", dp, 4, want)) == want


# --- refused before anything moves: no process needed ----------------------------------------------


class NamedParametersSource(StandInModuleSource):
    """vLLM 0.34's ``ModuleSource`` as it reads a module: ``named_parameters()`` only."""

    def __init__(self, module):
        self._module = module
        super().__init__(dict(module.named_parameters()))


NamedParametersSource.__name__ = "ModuleSource"


def _hf_module(dtype=torch.float32) -> torch.nn.Module:
    """A one-rank transformers-like module of NO_MTP (the routing bias a buffer)."""
    params = {"model.embed_tokens.weight": synthetic_layer(NO_MTP, REST, dtype)["model.embed_tokens.weight"]}
    for i in range(NO_MTP["num_hidden_layers"]):
        params.update(synthetic_layer(NO_MTP, i, dtype, "hf"))
    rest = synthetic_layer(NO_MTP, REST, dtype)
    params.update({k: rest[k] for k in ("model.norm.weight", "lm_head.weight")})

    class Plain:  # what _hf_like_module reads of a DTensor
        def __init__(self, t):
            self.t = t

        def full_tensor(self):
            return self.t

    module = _hf_like_module(
        {k: Plain(t) if k.endswith("e_score_correction_bias") else t for k, t in params.items()}
    )
    module.register_buffer("rotary_inv_freq", torch.ones(4), persistent=False)  # never sent
    return module


def _trainer_side(source, **kw):
    from glm_fp8.integrations.vllm.trainer import TrainerSide
    from glm_fp8.integrations.vllm.trainer_options import TrainerOptions

    opts = dict(master_address="127.0.0.1", master_port=1, engine_ranks=1, config=NO_MTP, rank=0)
    return TrainerSide(TrainerOptions(**{**opts, **kw}), _NoDraftClient(), source, torch.device("cpu"))


def test_a_source_without_the_buffers_is_refused_at_init_naming_the_tensor_and_the_fix():
    """vLLM's ModuleSource over a transformers model lacks the routing-bias buffer: refused when
    the trainer side is built (before the link, before any engine is touched), naming the
    tensor and glm_fp8's ModuleStateSource, which reads it and is accepted."""
    from glm_fp8.integrations.vllm import ModuleStateSource

    module = _hf_module()
    missing = r"model\.layers\.2\.mlp\.gate\.e_score_correction_bias: missing"
    with pytest.raises(ValueError, match=missing) as err:
        _trainer_side(NamedParametersSource(module))
    assert "named_parameters() only" in str(err.value) and "ModuleStateSource(model)" in str(err.value)
    src = ModuleStateSource(NamedParametersSource(module))  # or ModuleStateSource(module)
    names = [m.name for m in src.metadata]
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in names and "rotary_inv_freq" not in names
    assert [n for n, _ in src.iter_full()] == names == [n for n, _ in src.iter_local()]
    side = _trainer_side(src)
    assert side.init.layer_ids == [0, 1, 2, 3] and side.init.rest
    # a tensor of the wrong global shape is refused the same way
    module.model.norm.weight = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: expected global shape \(256,\)"):
        _trainer_side(ModuleStateSource(module))


def test_send_refuses_before_connect_and_after_shutdown():
    from glm_fp8.integrations.vllm import LayerSource

    side = _trainer_side(LayerSource(layers=lambda ids: iter(())))
    with pytest.raises(RuntimeError, match=r"call connect\(\) first"):
        side.send()
    side.shutdown()
    with pytest.raises(RuntimeError, match=r"shut down .*build a new one with trainer_init"):
        side.send()
    with pytest.raises(RuntimeError, match=r"connect\(\): this trainer side is shut down"):
        side.connect()


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("master_port", 29500.9, r"init_info\.master_port: expected an integer in \[1, 65535\]"),
        ("master_port", "abc", r"init_info\.master_port: expected an integer"),
        ("master_port", True, r"init_info\.master_port: expected an integer"),
        ("engine_ranks", 10**12, r"init_info\.engine_ranks: expected an integer in \[1, 65535\]"),
        ("trainer_ranks", 0, r"init_info\.trainer_ranks: expected an integer in \[1, 65535\] \(or None"),
        ("trainer_ranks", -2, r"init_info\.trainer_ranks: expected an integer"),
        ("rank", 1, r"init_info\.rank: expected a trainer rank below trainer_ranks=1"),
        ("rank", 0.0, r"init_info\.rank: expected an integer"),
        ("timeout_s", float("inf"), r"init_info\.timeout_s: expected seconds in \(0, 604800\]"),
        ("timeout_s", float("nan"), r"init_info\.timeout_s: expected seconds"),
        ("timeout_s", "60", r"init_info\.timeout_s: expected seconds"),
        ("ring", 10**12, r"init_info\.ring: expected an integer in \[2, 16\]"),
        ("checksum", 1, r"init_info\.checksum: expected True or False"),
        ("master_address", None, r"init_info\.master_address: expected a host name"),
        ("delta", 1, r"init_info\.delta: expected True or False"),
        ("delta_resync_every", 0, r"init_info\.delta_resync_every: expected an integer >= 1"),
        ("delta_resync_every", 2.0, r"init_info\.delta_resync_every: expected an integer"),
        ("delta_resync_every", 2, r"init_info\.delta_resync_every: 2 without delta=True"),
        ("step_layers", 0, r"init_info\.step_layers: expected an integer in \[1, 64\]"),
        ("step_layers", 2, r"init_info\.step_layers: 2 needs holders \(a Megatron-Core source's"),
    ],
)
def test_trainer_init_info_numbers_are_refused_naming_the_field(field, value, match):
    from glm_fp8.integrations.vllm import LayerSource

    with pytest.raises(ValueError, match=match):
        _trainer_side(LayerSource(layers=lambda ids: iter(())), **{field: value})


@pytest.mark.parametrize(
    "layer_ids, match",
    [
        ([1.9], r"source\.layer_ids\[0\]: expected an integer in \[0, 3\]"),
        ([True], "source.layer_ids"),
        ([0, 4], r"source\.layer_ids\[1\]: expected an integer in \[0, 3\]"),
        ("01", "source.layer_ids"),
    ],
)
def test_layer_source_layer_ids_are_integers_of_the_model(layer_ids, match):
    from glm_fp8.integrations.vllm import LayerSource

    with pytest.raises(ValueError, match=match):
        _trainer_side(LayerSource(layers=lambda ids: iter(()), layer_ids=layer_ids))


def test_delta_is_refused_at_init_where_it_is_not_built():
    """Before the link opens: the full broadcast, no checksums. A Triton worker takes delta, and so
    does a FlashInfer CUTLASS one (its rewrites after loading are undone on the rebuilt copy)."""
    from dataclasses import replace

    from test_vllm_worker import _updater

    from glm_fp8.engine import EngineLayout
    from glm_fp8.integrations.vllm import LayerSource
    from glm_fp8.integrations.vllm.trainer_options import delta_options
    from glm_fp8.transfer import DeltaOptions

    src = LayerSource(layers=lambda ids: iter(()), experts_whole=True)
    for kw, match in [
        (dict(mode="broadcast"), r"init_info\.mode: delta=True needs each engine rank to receive its own"),
        (dict(mode="scatter", checksum=False), r"init_info\.checksum: delta=True needs checksum=True"),
    ]:
        with pytest.raises(ValueError, match=match):
            _trainer_side(src, delta=True, **kw)
    for kw, match in [
        (dict(delta_kept="disk"), r"init_info\.delta_kept: expected one of 'gpu', 'host', got 'disk'"),
        (dict(delta=False, delta_kept="host"), r"init_info\.delta_kept: 'host' without delta=True"),
    ]:
        with pytest.raises(ValueError, match=match):
            _trainer_side(src, **{"delta": True, **kw})
    side = _trainer_side(src, delta=True, delta_resync_every=4, delta_kept="host")
    assert side.init.delta and side.mode == "scatter"  # built; nothing opened yet
    assert delta_options(side.opts) == DeltaOptions(resync_every=4, kept="host")
    assert delta_options(replace(side.opts, delta=False, delta_resync_every=None)) is None
    layout = EngineLayout.all_ranks(2, 1, True)[0]
    assert _updater(layout).delta_refusal() is None  # FlashInfer CUTLASS: its rewrites are undone
    assert _updater(layout, "TRITON").delta_refusal() is None


def test_init_and_update_infos_from_the_wire_are_checked_naming_the_field():
    """What a worker is sent (a dict, or JSON text from the dev server's routes): every field's
    type and range, a ValueError naming it, before the worker joins anything."""
    from glm_fp8.integrations.vllm.sync import SyncInit, SyncUpdate, from_json

    good = SyncInit(
        "127.0.0.1", 29500, world_size=3, senders=1, mode="scatter", link_backend="gloo", layer_ids=[0, 1]
    ).to_dict()
    assert SyncInit.from_dict(good) == SyncInit.from_dict(
        from_json("init_info", __import__("json").dumps(good))
    )
    for key, value, match in [
        ("layer_ids", [1.9], r"init_info\.layer_ids\[0\]: expected an integer >= 0"),
        ("layer_ids", [-1], r"init_info\.layer_ids\[0\]: expected an integer >= 0"),
        ("master_port", 29500.9, r"init_info\.master_port: expected the TCP store's port"),
        ("world_size", 10**30, r"init_info\.world_size: expected an integer in \[2, 65536\]"),
        ("ring", 10**12, r"init_info\.ring: expected an integer in \[2, 16\]"),
        ("timeout_s", float("inf"), r"init_info\.timeout_s: expected seconds"),
        ("senders", 3, r"init_info\.senders: expected an integer in \[1, 2\]"),
        ("version", 1, r"init_info\.version: expected 2"),
        ("delta", 1, r"init_info\.delta: expected a bool"),
        ("step_layers", 65, r"init_info\.step_layers: expected an integer in \[1, 64\]"),
        ("step_layers", 2, r"init_info\.step_layers: 2 needs holders"),
    ]:
        with pytest.raises(ValueError, match=match):
            SyncInit.from_dict({**good, key: value})
    with pytest.raises(ValueError, match=r"init_info\.mode: delta=True needs each engine rank to receive"):
        SyncInit.from_dict({**good, "delta": True, "mode": "broadcast"})
    assert SyncInit.from_dict({**good, "delta": True, "mode": "senders", "senders": 2}).delta
    assert SyncInit.from_dict({**good, "delta": True}).delta
    with pytest.raises(ValueError, match=r"init_info: not valid JSON"):
        from_json("init_info", '{"master_address": ')
    with pytest.raises(ValueError, match=r"init_info: expected a mapping"):
        SyncInit.from_dict([1, 2])
    with pytest.raises(
        ValueError, match=r"init_info: expected a mapping of glm_fp8's fields, got str \(JSON text"
    ):
        SyncInit.from_dict(__import__("json").dumps(good))
    with pytest.raises(ValueError, match=r"update_info\.step: expected an integer >= 0"):
        SyncUpdate.from_dict({"session": "target", "step": 1.5})
    with pytest.raises(ValueError, match=r"update_info: not valid JSON"):
        from_json("update_info", "target")
    with pytest.raises(ValueError, match=r"update_info: expected a mapping of glm_fp8's fields, got str"):
        SyncUpdate.from_dict('{"session": "target"}')


def test_worker_link_index_refuses_what_is_not_an_index():
    from types import SimpleNamespace

    from glm_fp8.integrations.vllm.worker import worker_index

    pc = dict(distributed_executor_backend="mp", data_parallel_index=0, world_size=2, rank=1)
    assert worker_index(SimpleNamespace(**pc)) == 1
    with pytest.raises(ValueError, match=r"parallel_config\.data_parallel_index: expected an integer"):
        worker_index(SimpleNamespace(**{**pc, "data_parallel_index": None}))
    with pytest.raises(ValueError, match=r"parallel_config\.rank: expected an integer"):
        worker_index(SimpleNamespace(**{**pc, "rank": 1.0}))
    # a rank at or past its world would collide with another worker's link index: refused
    for kind, rank in (("mp", 2), ("external_launcher", 5)):
        with pytest.raises(ValueError, match=r"parallel_config\.rank: .*world_size=2"):
            worker_index(SimpleNamespace(**{**pc, "distributed_executor_backend": kind, "rank": rank}))


def test_gather_dtype_default_is_no_cast():
    """fp32 masters are quantized from fp32 in every mode unless bf16 gathers are asked for."""
    from glm_fp8.integrations.vllm.trainer_options import TrainerOptions

    assert TrainerOptions.__dataclass_fields__["gather_dtype"].default is None
