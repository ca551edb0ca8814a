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
tests/test_vllm_worker.py); each worker process serves the client's calls from a queue, as
``collective_rpc`` would. Processes share a gloo default group (the DTensors' meshes); the link
is the backend's own store-made group.
"""

from dataclasses import dataclass
from functools import cached_property

import pytest
import torch

from glm_fp8.models import REST, TINY_GLM5
from glm_fp8.testing import free_port, launch, synthetic_layer

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
        errors = [f"worker {w}: {msg}" for w, (status, msg) in
                  enumerate(out.get(timeout=120) for _, out in self.boxes) if status != "ok"]  # fmt: skip
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


def _serve(side, drafter, inbox, outbox, log):
    """The worker: what vLLM's worker does with each call (a draft session hands the drafter over)."""
    while True:
        cmd, args = inbox.get()
        if cmd == "stop":
            return
        try:
            if cmd == "start_draft":
                side.start(drafter)
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
    from test_vllm_worker import _vllm_swap_w13_to_w31

    from glm_fp8.testing import reference_engine_params

    want = reference_engine_params(config, layout, ids, dtype=dtype, gathered_dtype=gathered)
    for name in list(want):
        if "routed_experts.w13_weight" in name:
            want[name] = _vllm_swap_w13_to_w31(want[name])
        if "routed_experts.w" in name and name.endswith("_scale_inv"):
            want[name] = want[name].clamp(min=1e-10)
    return want


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


# --- one process of a run -------------------------------------------------------------------------


def _rank(rank, world, trainers, port, boxes, case, opts):
    from test_vllm_worker import _engine, _finalize

    from glm_fp8.integrations.vllm.engine import EngineNotSupported, EngineUpdater, engine_postload_plan
    from glm_fp8.integrations.vllm.sources import LayerSource
    from glm_fp8.integrations.vllm.trainer import TrainerOptions, TrainerSide
    from glm_fp8.integrations.vllm.worker import WorkerSide

    config = TINY_GLM5 if opts.get("mtp") else NO_MTP
    dtype = opts.get("dtype", torch.bfloat16)
    steps = opts.get("steps", 2)
    source_kind = opts.get("source", "layers")
    layout_name = opts.get("layout", "prime_rl")
    mesh_params = _module_params(config, trainers, layout_name, dtype) if source_kind == "module" else None
    if rank < trainers:
        if source_kind == "module":
            source = StandInModuleSource(mesh_params)
        else:
            source = LayerSource(lambda ids: ((i, synthetic_layer(config, i, dtype)) for i in ids),
                                 rest=lambda: synthetic_layer(config, REST, dtype), mtp=bool(opts.get("mtp")),
                                 experts_whole=True)  # fmt: skip
        client = QueueClient(boxes, draft=opts.get("draft") != "stream") if rank == 0 else None
        options = TrainerOptions("127.0.0.1", port, engine_ranks=world - trainers, config=config,
                                 mode=opts.get("mode", "auto"), draft=opts.get("draft", "auto"), rank=rank,
                                 trainer_ranks=trainers, timeout_s=60)  # fmt: skip
        try:
            side = TrainerSide(options, client, source, torch.device("cpu")).connect()
            results = []
            for _step in range(steps):
                try:
                    results.append(("ok", [(o["session"], o["bytes"]) for o in side.send()], side.mode))
                except Exception as exc:  # noqa: BLE001 - the test reads every rank's outcome
                    results.append((type(exc).__name__, str(exc) + "".join(getattr(exc, "__notes__", []))))
            return results
        finally:
            if rank == 0:
                for inbox, _ in boxes:
                    inbox.put(("stop", ()))
    r = rank - trainers
    layout = _layouts(case)[r]
    target, drafter = _engine(layout)
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
    _serve(side, drafter, *boxes[r], log)
    if side.updater is None:
        return log
    ids = [*range(config["num_hidden_layers"]), *([MTP] if opts.get("mtp") else []), REST]
    gathered = torch.bfloat16 if dtype != torch.bfloat16 and source_kind == "module" else None
    want = _expected(config, layout, ids, dtype, gathered)
    params = side.updater.engine.params
    aliases = side.updater.engine.aliases
    same = lambda a, b: torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))  # noqa: E731
    bad = [n for n, w in want.items() if n not in aliases and not same(params[n], w)]
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
    ],  # fmt: skip
)
def test_every_mode_lands_every_byte_step_after_step(trainers, case, mode):
    results = _run(trainers, case, mode=mode)
    _landed(results, trainers)
    for t in range(trainers):
        assert [s[0] for s in results[t][1]] == ["ok", "ok"] and results[t][1][0][2] == mode, results[t]


def test_auto_picks_many_senders_from_a_module_source_and_fp32_masters_land():
    """vLLM's ModuleSource over FSDP2-style DTensors (HF's module names, fp32 masters and bias):
    every trainer rank holds whole experts, so "auto" picks many senders and each rank sends its
    own pieces (``iter_local`` made DTensors again)."""
    results = _run(2, "ep2", source="module", layout="hf", dtype=torch.float32)
    _landed(results, 2)
    assert all(results[t][1][0][2] == "senders" for t in range(2)), results


def test_one_sender_reads_a_module_source_whole_the_other_trainer_rank_gathers():
    results = _run(2, "tp2", source="module", mode="scatter")
    _landed(results, 2)
    assert results[1][1] == [("ok", [], "scatter")] * 2, results[1]  # off the link: its gathers only


@pytest.mark.parametrize("draft", ["session", "stream"])
def test_the_mtp_layer_travels_in_the_draft_session_or_with_the_target(draft):
    results = _run(1, "ep2", draft=draft, mtp=True)
    _landed(results, 1)
    sessions = [s for s, _ in results[0][1][0][1]]
    assert sessions == (["target", "draft"] if draft == "session" else ["stream"]), results[0]


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
    from glm_fp8.integrations.vllm.trainer import TrainerOptions, TrainerSide

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
