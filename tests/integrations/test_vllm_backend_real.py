"""glm_fp8's vLLM weight-transfer backend through vLLM 0.34's own classes (skipped without vLLM 0.34).

Invariants:
- ``register()`` puts "glm_fp8" in ``WeightTransferEngineFactory`` and ``WeightTransferTrainerFactory``,
  idempotently; importing ``glm_fp8.integrations.vllm.backend`` registers it, and so does vLLM's own
  plugin loader (the ``vllm.general_plugins`` entry point); ``WeightTransferConfig(backend="glm_fp8")``
  is accepted and ``create_engine`` builds a ``GlmFp8WeightTransferEngine``.
- ``GlmFp8TrainerInitInfo`` is a ``TrainerInitInfo``: its ``backend`` a ClassVar, ``rank`` keyword-only
  and explicit, ``is_sender`` on rank 0 only; ``trainer_init`` dispatches on it.
- ``update_weights`` (vLLM's entry point) parses, receives and synchronizes an accelerator only: on a
  CPU worker it returns once the update has landed.
- Through vLLM's API end to end: every trainer rank calls ``WeightTransferTrainerFactory.trainer_init``
  and ``send_weights()``; every engine worker builds its engine with ``WeightTransferEngineFactory.
  create_engine`` and drives it as vLLM 0.34's ``Worker`` does (``v1/worker/gpu_worker.py``: init, start,
  draft start, update, finish). After each step every engine parameter equals the reference bit for
  bit (as test_vllm_backend.py checks it), in every mode, from glm_fp8's ``LayerSource`` and from
  vLLM's ``ModuleSource`` over FSDP2-style DTensors in Hugging Face's names; the MTP layer travels in
  vLLM's draft session; vLLM's ``finalize_model_weights`` rebuilds MLA's ``W_UK_T`` / ``W_UV``; two
  servers of two layouts (a fleet, each its own client) in one update on one link.
- A worker that cannot take part (its ``ParallelConfig`` has EPLB on) stops every rank at init.

Real: vLLM's factories, config classes (``WeightTransferConfig``, ``ParallelConfig``), ``ModuleSource``,
``set_current_vllm_config``, DeepGEMM probe, ``finalize_model_weights``; glm_fp8's ``vllm_updater``.
Stood in: the served model (test_vllm_worker.py's modules with vLLM's names), the rest of the
``VllmConfig`` (its ``model_config`` holds a transformers config), vLLM's TP / DP groups (which only
give ``vllm_updater`` this worker's ranks) and the RPC (queues, as in test_vllm_backend.py).
"""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.distributed.weight_transfer.base")
import vllm  # noqa: E402

if not vllm.__version__.startswith("0.34."):
    pytest.skip(
        f"written against vLLM 0.34's weight-transfer API, found {vllm.__version__}", allow_module_level=True
    )

from test_vllm_backend import MTP, NO_MTP, QueueClient, _as_module, _layouts, _module_params  # noqa: E402

from glm_fp8.model.families import REST
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.testing import free_port, launch, synthetic_layer  # noqa: E402

BACKEND = "glm_fp8"


def _hf_config(config: dict):
    """What vLLM's ``ModelConfig.hf_text_config`` holds: the transformers config of the model."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**config)
    except (KeyError, ValueError):  # a transformers without this model type: its to_dict() is what is read
        return SimpleNamespace(to_dict=lambda: dict(config))


def _vllm_config(layout, config: dict, *, mtp: bool, eplb: bool = False):
    """A ``VllmConfig`` as the engines read it: vLLM's own ``ParallelConfig`` for this worker (rank
    within its DP replica, ``data_parallel_index``), a ``model_config`` holding the transformers
    config, a ``speculative_config`` with a draft model when it runs MTP."""
    from vllm.config import ParallelConfig, WeightTransferConfig

    pc = ParallelConfig(
        tensor_parallel_size=layout.tp_size,
        data_parallel_size=layout.dp_size,
        data_parallel_rank=layout.dp_rank,
        enable_expert_parallel=layout.ep_size > 1,
        rank=layout.tp_rank,
    )
    if eplb:
        pc.enable_eplb = True  # vLLM refuses to build one without an accelerator
    hf = _hf_config(config)
    return SimpleNamespace(
        parallel_config=pc,
        model_config=SimpleNamespace(hf_config=hf, hf_text_config=hf),
        speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf)) if mtp else None,
        weight_transfer_config=WeightTransferConfig(backend=BACKEND),
    )


def _cpu_engine(device="cpu"):
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    import glm_fp8.integrations.vllm as integ
    from glm_fp8.engine import EngineLayout

    integ.register()
    return WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=BACKEND),
        _vllm_config(EngineLayout(), NO_MTP, mtp=False),
        torch.device(device),
        torch.nn.Module(),
    )


# --- registration and the classes -----------------------------------------------------------------


def test_register_fills_both_factories_idempotently_and_the_config_names_the_backend():
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    import glm_fp8.integrations.vllm as integ

    integ.register()
    integ.register()  # vLLM may load general plugins more than once per process
    from glm_fp8.integrations.vllm.backend import (
        GlmFp8TrainerWeightTransferEngine,
        GlmFp8WeightTransferEngine,
    )

    integ.register()
    assert WeightTransferEngineFactory._registry[BACKEND]() is GlmFp8WeightTransferEngine
    assert WeightTransferTrainerFactory._registry[BACKEND]() is GlmFp8TrainerWeightTransferEngine
    assert issubclass(GlmFp8WeightTransferEngine, WeightTransferEngine)
    assert issubclass(GlmFp8TrainerWeightTransferEngine, TrainerWeightTransferEngine)
    with pytest.raises(ValueError, match="already registered"):  # what register() must not do twice
        WeightTransferEngineFactory.register_engine(BACKEND, GlmFp8WeightTransferEngine)
    assert WeightTransferConfig(backend=BACKEND).backend == BACKEND
    assert WeightTransferConfig(**{"backend": "glm_fp8"}) == WeightTransferConfig(backend=BACKEND)  # CLI JSON
    engine = _cpu_engine()
    assert type(engine) is GlmFp8WeightTransferEngine and engine.supports_draft_weight_update
    assert engine.parallel_config.world_size == 1 and engine.model is engine._default_model


def _fresh_interpreter(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}  # VLLM_PLUGINS filters plugins
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


_REGISTERED = (
    "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as E, "
    "WeightTransferTrainerFactory as T\n"
    "def registered(): return [n in f._registry for f in (E, T) for n in ['glm_fp8']]\n"
)


def test_importing_the_backend_registers_it_and_importing_the_integration_does_not():
    got = _fresh_interpreter(
        _REGISTERED + "import glm_fp8.integrations.vllm\nbefore = registered()\n"
        "import glm_fp8.integrations.vllm.backend\nprint(before, registered())"
    )
    assert got == "[False, False] [True, True]", got


def test_vllms_plugin_loader_registers_it_in_every_vllm_process():
    """The ``vllm.general_plugins`` entry point (pyproject.toml): vLLM's workers import nothing of
    glm_fp8 before ``create_engine`` but this."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        eps = [ep for ep in distribution("glm_fp8").entry_points if ep.group == "vllm.general_plugins"]
    except PackageNotFoundError:
        pytest.skip("glm_fp8 is not installed (pip install -e .): no entry points to load")
    assert [(ep.name, ep.value) for ep in eps] == [("glm_fp8", "glm_fp8.integrations.vllm:register")], (
        "the installed glm_fp8 lacks its vllm.general_plugins entry point: reinstall it (pip install -e .)"
    )
    got = _fresh_interpreter(
        _REGISTERED + "from vllm.plugins import load_general_plugins\nload_general_plugins()\n"
        "print(registered())"
    )
    assert got == "[True, True]", got


def test_trainer_init_info_is_a_vllm_trainer_init_info():
    from dataclasses import fields

    from vllm.distributed.weight_transfer.base import TrainerInitInfo, VLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from glm_fp8.integrations.vllm.backend import GlmFp8TrainerInitInfo, GlmFp8TrainerWeightTransferEngine
    from glm_fp8.integrations.vllm.trainer_options import TrainerOptions

    info = GlmFp8TrainerInitInfo("127.0.0.1", 29500, 2, TINY_GLM5, rank=1)
    assert isinstance(info, TrainerInitInfo) and isinstance(info, TrainerOptions)
    assert GlmFp8TrainerInitInfo.backend == info.backend == BACKEND
    by_name = {f.name: f for f in fields(info)}
    assert "backend" not in by_name and by_name["rank"].kw_only
    assert not info.is_sender and GlmFp8TrainerInitInfo("127.0.0.1", 29500, 2, TINY_GLM5, rank=0).is_sender
    with pytest.raises(TypeError, match="rank"):  # explicit on every rank, never read from a group
        GlmFp8TrainerInitInfo("127.0.0.1", 29500, 2, TINY_GLM5)
    assert GlmFp8TrainerWeightTransferEngine.init_info_cls is GlmFp8TrainerInitInfo
    assert WeightTransferTrainerFactory._registry[info.backend]() is GlmFp8TrainerWeightTransferEngine
    with pytest.raises(ValueError, match="source: glm_fp8's trainer engine needs"):
        WeightTransferTrainerFactory.trainer_init(info, client=None)
    assert isinstance(QueueClient([]), VLLMWeightSyncClient)


def test_update_weights_parses_receives_and_synchronizes_only_an_accelerator(monkeypatch):
    """vLLM's base ``update_weights`` ends in ``torch.accelerator.synchronize()``, which raises on a
    machine without one (vLLM's CPU worker) after the update landed; glm_fp8's syncs the worker's
    accelerator only."""
    synced, received = [], []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: synced.append(a))
    for device in ("cpu", "cuda"):  # a torch.device only: nothing touches it
        engine = _cpu_engine(device)
        engine.side.receive = received.append
        engine.update_weights({"session": "target", "step": 3})
        assert received[-1] == {"session": "target", "step": 3}
        assert len(synced) == (device == "cuda")
    with pytest.raises(ValueError, match="update_info.session"):
        engine.update_weights({"session": "everything"})
    with pytest.raises(ValueError, match="init_info.master_port: missing"):
        engine.parse_init_info({"master_address": "127.0.0.1"})


# --- vLLM's worker, as far as weight transfer goes ------------------------------------------------


class VllmWorker:
    """vLLM 0.34's ``Worker`` (``v1/worker/gpu_worker.py``) around its weight-transfer engine: built
    after the model loads (``create_engine``), each call inside ``set_current_vllm_config``, a draft
    session retargeting the engine at the drafter, a failed update ending the session unfinished."""

    def __init__(self, vllm_config, target, drafter, device):
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        self.vllm_config, self.target, self.drafter = vllm_config, target, drafter
        self.rank = vllm_config.parallel_config.rank
        self.engine = WeightTransferEngineFactory.create_engine(
            vllm_config.weight_transfer_config, vllm_config, device, target
        )
        self.active = self.is_draft = False
        self.updates: list[tuple[str, str]] = []  # (the update's session, the model it went to)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self._start(is_draft=False)

    def start_draft_weight_update(self) -> None:
        self._start(is_draft=True)

    def _start(self, is_draft: bool) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            if is_draft and not self.engine.supports_draft_weight_update:
                raise RuntimeError("does not support draft model weight updates")
            if self.active:
                raise RuntimeError("start_weight_update called while a weight update is already active")
            try:
                if is_draft:
                    if self.drafter is None:
                        raise RuntimeError("Draft model weight update requested, but no draft model")
                    spec = self.vllm_config.speculative_config
                    self.engine.set_weight_update_target(self.drafter, spec.draft_model_config)
                self.engine.start_weight_update()
            except BaseException:
                self.engine.reset_weight_update_target()
                raise
            self.active, self.is_draft = True, is_draft

    def update_weights(self, update_info) -> None:
        from vllm.config import set_current_vllm_config

        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        with set_current_vllm_config(self.vllm_config):
            try:
                if isinstance(update_info, list):
                    pc = self.vllm_config.parallel_config
                    update_info = update_info[pc.data_parallel_index * pc.world_size + self.rank]
                into = "drafter" if self.engine.model is self.drafter else "target"
                self.updates.append((update_info.get("session"), into))
                self.engine.update_weights(update_info)
            except BaseException:
                self._end()
                raise

    def finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config

        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        with set_current_vllm_config(self.vllm_config):
            try:
                self.engine.finish_weight_update()
            finally:
                self._end()

    def _end(self) -> None:
        self.active = False
        self.engine.reset_weight_update_target()


def _serve(worker, inbox, outbox, log):
    """``collective_rpc`` of the client's calls (test_vllm_backend.py's ``QueueClient``)."""
    calls = {
        "init": worker.init_weight_transfer_engine,
        "start": worker.start_weight_update,
        "start_draft": worker.start_draft_weight_update,
        "receive": worker.update_weights,
        "finish": worker.finish_weight_update,
    }
    while True:
        cmd, args = inbox.get()
        if cmd == "stop":
            return
        try:
            calls[cmd](*args)
            outbox.put(("ok", None))
        except BaseException as exc:  # noqa: BLE001 - reported to the client, as vLLM's RPC does
            log.append(f"{type(exc).__name__}: {exc}")
            outbox.put(("error", f"{type(exc).__name__}: {exc}"))


class _Group:
    """vLLM's ``GroupCoordinator`` as ``vllm_updater`` reads it: this worker's rank in the group."""

    def __init__(self, rank_in_group: int):
        self.rank_in_group = rank_in_group


# --- one process of a run -------------------------------------------------------------------------


def _rank(rank, world, trainers, port, boxes, case, opts):
    config = TINY_GLM5 if opts.get("mtp") else NO_MTP
    dtype = opts.get("dtype", torch.bfloat16)
    steps = opts.get("steps", 2)
    module = opts.get("source") == "module"
    mesh_params = _module_params(config, trainers, "hf", dtype) if module else None  # every rank: the mesh
    if rank < trainers:
        return _trainer(rank, world, trainers, port, boxes, config, dtype, steps, mesh_params, opts)
    return _engine_worker(rank - trainers, trainers, boxes, case, config, dtype, steps, opts)


def _case_layouts(case: str):
    """The workers' layouts of ``case``: one server ("tp2"), or a fleet ("tp2+ep2"), in link order."""
    return [layout for server in case.split("+") for layout in _layouts(server)]


def _trainer(rank, world, trainers, port, boxes, config, dtype, steps, mesh_params, opts):
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from glm_fp8.integrations.vllm import LayerSource
    from glm_fp8.integrations.vllm.backend import GlmFp8TrainerInitInfo, GlmFp8TrainerWeightTransferEngine

    if mesh_params is not None:
        source = ModuleSource(_as_module(mesh_params))
    else:
        source = LayerSource(
            lambda ids: ((i, synthetic_layer(config, i, dtype)) for i in ids),
            rest=lambda: synthetic_layer(config, REST, dtype),
            mtp=bool(opts.get("mtp")),
            experts_whole=True,
        )
    client = QueueClient(boxes) if rank == 0 else None
    engine_ranks, fleet = world - trainers, {}
    if opts.get("fleet"):  # one client per server, each over its own workers' queues
        engine_ranks = [len(_layouts(server)) for server in opts["fleet"]]
        starts = [sum(engine_ranks[:k]) for k in range(len(engine_ranks))]
        clients = [QueueClient(boxes[a : a + n]) for a, n in zip(starts, engine_ranks)]
        fleet = {"server_names": list(opts["fleet"])}
        client = clients if rank == 0 else None
    hf_config = _hf_config(config) if opts.get("hf_trainer_config") else config
    info = GlmFp8TrainerInitInfo(
        "127.0.0.1",
        port,
        engine_ranks=engine_ranks,
        config=hf_config,
        mode=opts.get("mode", "auto"),
        trainer_ranks=trainers,
        timeout_s=60,
        rank=rank,
        **fleet,
    )
    try:
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        assert type(engine) is GlmFp8TrainerWeightTransferEngine
        assert (engine.is_sender, engine.rank) == (rank == 0, rank) and engine.source is source
        results = []
        for _step in range(steps):
            try:
                out = engine.send_weights()
                results.append(("ok", [(o["session"], o["bytes"]) for o in out], engine.side.mode))
            except Exception as exc:  # noqa: BLE001 - the test reads every rank's outcome
                results.append((type(exc).__name__, str(exc) + "".join(getattr(exc, "__notes__", []))))
        engine.shutdown()
        return results
    finally:
        if rank == 0:
            for inbox, _ in boxes:
                inbox.put(("stop", ()))


def _engine_worker(r, trainers, boxes, case, config, dtype, steps, opts):
    import vllm.distributed.parallel_state as parallel_state
    from test_vllm_worker import StandInMLA, _engine

    import glm_fp8.integrations.vllm as integ
    from glm_fp8.engine.postload import mla_absorbed_ref
    from glm_fp8.integrations.vllm.backend import GlmFp8WeightTransferEngine

    integ.register()  # what vLLM's plugin loader does in every worker process
    layout = _case_layouts(case)[r]
    # vllm_updater reads this worker's ranks from vLLM's TP and DP groups, which need vLLM's
    # distributed init; they are the ParallelConfig's rank and data_parallel_index.
    parallel_state.get_tp_group = lambda: _Group(layout.tp_rank)
    parallel_state.get_dp_group = lambda: _Group(layout.dp_rank)
    target, drafter = _engine(layout)
    mtp = bool(opts.get("mtp"))
    drafter = drafter if mtp else None
    vllm_config = _vllm_config(layout, config, mtp=mtp, eplb=bool(opts.get("refuse_init")) and r == 1)
    worker = VllmWorker(vllm_config, target, drafter, torch.device("cpu"))
    assert type(worker.engine) is GlmFp8WeightTransferEngine
    log: list[str] = []
    _serve(worker, *boxes[r], log)
    side = worker.engine.side
    if side.updater is None:
        return {"log": log}
    assert side.updater.layout == layout, (side.updater.layout, layout)  # vllm_updater's, from the config
    ids = [*range(config["num_hidden_layers"]), *([MTP] if mtp else []), REST]
    want = _expected(config, layout, ids, dtype, module=opts.get("source") == "module")
    params, aliases = side.updater.engine.params, side.updater.engine.aliases
    same = lambda a, b: torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))  # noqa: E731
    bad = [n for n, w in want.items() if n not in aliases and not same(params[n], w)]
    # vLLM's finalize_model_weights ran each MLA module's own hook, which rebuilt W_UK_T / W_UV.
    hooks = {}
    for key, model in (("target", target), ("drafter", drafter)):
        for m in model.modules() if model is not None else ():
            if isinstance(m, StandInMLA):
                hooks.setdefault(key, []).append(m.hook_calls)
                proj = m.kv_b_proj
                w_uk_t, w_uv = mla_absorbed_ref(proj.weight, proj.weight_scale_inv, config, layout)
                if not (same(m.W_UK_T, w_uk_t) and same(m.W_UV, w_uv)):
                    bad.append(f"{key} MLA W_UK_T / W_UV")
    return {
        "bad": bad,
        "checked": len(want),
        "log": log,
        "hooks": hooks,
        "model_is_target": worker.engine.model is target,
        "updates": worker.updates,
    }


def _expected(config, layout, ids, dtype, *, module: bool):
    """test_vllm_backend.py's ``_expected``, for a module in Hugging Face's names too: its
    router keeps the routing bias in float32 whatever the other tensors' dtype."""
    from test_vllm_worker import _vllm_swap_w13_to_w31

    from glm_fp8.testing import reference_engine_params

    # no cast before quantizing (gather_dtype=None): fp32 masters give the bytes of the fp32 values
    want = reference_engine_params(
        config, layout, ids, dtype=dtype, bias_dtype=torch.float32 if module else None
    )
    for name in list(want):
        if "routed_experts.w13_weight" in name:
            want[name] = _vllm_swap_w13_to_w31(want[name])
        if "routed_experts.w" in name and name.endswith("_scale_inv"):
            want[name] = want[name].clamp(min=1e-10)
    return want


def _run(trainers, case, **opts):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    engines = len(_case_layouts(case))
    if "+" in case:
        opts = {**opts, "fleet": case.split("+")}
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in range(engines)]
    return launch(trainers + engines, _rank, (trainers, free_port(), boxes, case, opts), timeout_s=150)


def _landed(results, trainers, steps=2):
    for r, (status, out) in results.items():
        assert status == "ok", (r, status, out)
        if r >= trainers:
            assert out["bad"] == [] and out["checked"] > 50 and out["log"] == [], (r, out)
            # one target update a step, each followed by the hooks of every MLA module of the target
            assert out["hooks"]["target"] == [steps] * 4 and out["model_is_target"], (r, out)


@pytest.mark.parametrize(
    "trainers, case, mode",
    [(1, "tp2", "broadcast"), (1, "tp2xdp2", "scatter"), (2, "ep2", "senders")],
)
def test_every_mode_lands_every_byte_through_vllms_api(trainers, case, mode):
    results = _run(trainers, case, mode=mode, hf_trainer_config=mode == "scatter")
    _landed(results, trainers)
    for t in range(trainers):
        assert [s[0] for s in results[t][1]] == ["ok", "ok"] and results[t][1][0][2] == mode, results[t]


def test_two_servers_of_two_layouts_land_every_byte_in_one_update_through_vllms_api():
    """A fleet (docs/vllm.md#fleet): a TP 2 server and an EP 2 server, each its own client, on one
    link (the second's workers at rank_offset 3), vLLM's worker engine in each."""
    results = _run(1, "tp2+ep2", mode="scatter")
    _landed(results, 1)
    assert [s[0] for s in results[0][1]] == ["ok", "ok"], results[0]


def test_vllms_module_source_over_fsdp2_dtensors_in_hf_names_lands_with_many_senders():
    """Every trainer rank holds whole experts (``Shard(0)`` over both): "auto" picks many senders and
    each sends ``ModuleSource.iter_local()``'s pieces; fp32 masters, the routing bias included."""
    results = _run(2, "ep2", source="module", dtype=torch.float32)
    _landed(results, 2)
    assert all(results[t][1][0][2] == "senders" for t in range(2)), results


def test_vllms_module_source_read_whole_by_one_sender_while_the_other_rank_gathers():
    results = _run(2, "tp2", source="module", mode="scatter", dtype=torch.float32)
    _landed(results, 2)
    assert results[1][1] == [("ok", [("target", 0)], "scatter")] * 2, results[1]  # off the link: sent nothing


def test_vllms_module_source_over_a_transformers_like_module_is_refused_at_trainer_init():
    """vLLM's ``ModuleSource`` reads ``named_parameters()`` only; a transformers model's routing
    bias is a buffer. ``trainer_init`` refuses it before the link opens (no engine is waiting
    here: a refusal after the rendezvous would hang), naming the tensor and glm_fp8's
    ``ModuleStateSource``, which reads vLLM's ``ModuleSource``'s module with its buffers."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from glm_fp8.integrations.vllm import ModuleStateSource
    from glm_fp8.integrations.vllm.backend import GlmFp8TrainerInitInfo

    params = {}
    for i in [*range(NO_MTP["num_hidden_layers"]), REST]:
        params.update(synthetic_layer(NO_MTP, i, torch.float32, "hf"))
    module = _as_module(params)
    for mod in module.modules():  # the bias as transformers holds it: a buffer
        if hasattr(mod, "e_score_correction_bias"):
            bias = mod._parameters.pop("e_score_correction_bias")
            mod.register_buffer("e_score_correction_bias", bias.detach())
    info = GlmFp8TrainerInitInfo("127.0.0.1", free_port(), 2, NO_MTP, trainer_ranks=1, rank=0)
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.gate\.e_score_correction_bias: missing") as err:
        WeightTransferTrainerFactory.trainer_init(info, client=QueueClient([]), source=ModuleSource(module))
    assert "ModuleStateSource(model)" in str(err.value)
    names = [m.name for m in ModuleStateSource(ModuleSource(module)).metadata]
    assert names == [n for n, _ in module.state_dict().items()]


def test_the_mtp_layer_travels_in_vllms_draft_session():
    results = _run(1, "ep2", mtp=True)
    _landed(results, 1)
    assert [s for s, _ in results[0][1][0][1]] == ["target", "draft"], results[0]
    for r in (1, 2):
        out = results[r][1]
        assert out["updates"] == [("target", "target"), ("draft", "drafter")] * 2, out
        assert len(out["hooks"]["drafter"]) == 1 and out["hooks"]["drafter"][0] >= 2, out


def test_a_worker_that_cannot_take_part_stops_every_rank_at_init():
    results = _run(1, "tp2", refuse_init=True, steps=0)
    assert results[0][0] == "RuntimeError" and "engine rank 2 refused the weight transfer" in results[0][1]
    assert "enable_eplb" in results[0][1], results[0]
    assert any("engine rank 2 refused" in m for m in results[1][1]["log"]), results[1]
    assert any("EngineNotSupported" in m and "enable_eplb" in m for m in results[2][1]["log"]), results[2]
