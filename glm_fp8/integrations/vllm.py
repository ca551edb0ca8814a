"""vLLM 0.34 integration: a worker extension that receives a glm_fp8 update into the engine's own
parameters (target model and MTP drafter) and runs the post-load step (docs/vllm.md).

Start the engine with ``--worker-extension-cls glm_fp8.integrations.vllm.GlmFp8WorkerExtension``
(``LLM(..., worker_extension_cls=...)``); vLLM adds the class to its worker's bases
(``v1/worker/worker_base.py::WorkerWrapperBase.init_worker``), and ``collective_rpc("glm_fp8_...")``
runs a method on every worker (``v1/serial_utils.py::run_method``).

vLLM is imported only inside ``GlmFp8WorkerExtension``'s methods. Everything those methods
decide is in plain functions and ``EngineUpdater`` here, which take any ``torch.nn.Module`` tree
with vLLM's parameter names, so they are tested without vLLM (tests/test_vllm_worker.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from glm_fp8.engine.layout import EngineLayout, split_name
from glm_fp8.engine.postload import PostLoadPlan, apply_postload_, postload_plan
from glm_fp8.engine.specs import engine_param_specs, mtp_layer_index
from glm_fp8.models import REST, model_layer_ids
from glm_fp8.transfer.receiver import Receiver


class EngineNotSupported(ValueError):
    """The engine holds its weights in a form glm_fp8 cannot update in place (the reason names
    the setting and the vLLM source it was read from)."""


# --- parallel layout ------------------------------------------------------------------------------


def layout_from_parallel_config(
    parallel_config: object, *, tp_rank: int, dp_rank: int, config: Mapping | None = None
) -> EngineLayout:
    """This worker's ``EngineLayout`` from vLLM's ``ParallelConfig`` (``config/parallel.py``) and its
    ranks in the attention TP group (``get_tp_group().rank_in_group``) and the DP group
    (``get_dp_group().rank_in_group``, 0 when ``data_parallel_size`` is 1, as
    ``fused_moe/config.py::FusedMoEParallelConfig.make`` takes it).

    Raises ``EngineNotSupported`` for what ``EngineLayout`` does not model: pipeline parallelism,
    prefill context parallelism, EPLB, and round-robin expert placement where vLLM honours it
    (``expert_map_manager.py::determine_expert_placement_strategy``: only with ``n_group > 1``)."""
    pc = parallel_config
    for attr, why in (("pipeline_parallel_size", "pipeline parallelism"),
                      ("prefill_context_parallel_size", "prefill context parallelism")):  # fmt: skip
        if getattr(pc, attr, 1) != 1:
            raise EngineNotSupported(f"parallel_config.{attr}={getattr(pc, attr)}: {why} is not supported "
                                     "(EngineLayout models pipeline_parallel_size 1, pcp 1)")  # fmt: skip
    if getattr(pc, "enable_eplb", False):
        raise EngineNotSupported(
            "parallel_config.enable_eplb: EPLB moves experts at run time and adds "
            "redundant ones; glm_fp8's expert placement is vLLM's static 'linear' one"
        )
    if (getattr(pc, "expert_placement_strategy", "linear") == "round_robin"
            and config is not None and (config.get("n_group") or 1) > 1):  # fmt: skip
        raise EngineNotSupported("parallel_config.expert_placement_strategy='round_robin' with n_group > 1: "
                                 "only the 'linear' placement is supported")  # fmt: skip
    return EngineLayout.from_vllm(
        tp_size=int(pc.tensor_parallel_size),
        tp_rank=int(tp_rank),
        dp_size=int(pc.data_parallel_size),
        dp_rank=int(dp_rank) if pc.data_parallel_size > 1 else 0,
        enable_expert_parallel=bool(pc.enable_expert_parallel),
        all2all_backend=str(getattr(pc, "all2all_backend", "allgather_reducescatter")),
    )


def check_moe_parallel(layout: EngineLayout, model: torch.nn.Module) -> int:
    """Compare ``layout`` with what every routed-experts module of ``model`` was built with
    (``module.moe_config.moe_parallel_config``: ``fused_moe/config.py::FusedMoEParallelConfig``,
    whose ``tp_*`` are the MoE TP group and ``ep_*`` the expert-parallel one). Returns how many
    modules were checked; raises ``EngineNotSupported`` naming the first that differs."""
    checked = 0
    for name, module in model.named_modules():
        mpc = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
        if mpc is None:
            continue
        want = {"ep_size": layout.ep_size, "ep_rank": layout.ep_rank, "tp_size": layout.moe_tp_size,
                "tp_rank": layout.moe_tp_rank}  # fmt: skip
        got = {k: getattr(mpc, k, None) for k in want}
        if got != want:
            raise EngineNotSupported(
                f"{name}.moe_config.moe_parallel_config: the engine built {got}, glm_fp8's layout "
                f"{layout} gives {want}"
            )
        checked += 1
    return checked


# --- what the engine's kernels did to its weights -------------------------------------------------


def _modules(models: Sequence[torch.nn.Module | None]) -> Iterator[tuple[str, torch.nn.Module]]:
    seen: set[int] = set()
    for model in models:
        if model is None:
            continue
        for name, module in model.named_modules():
            if id(module) not in seen:
                seen.add(id(module))
                yield name, module


def moe_backends(*models: torch.nn.Module | None) -> dict[str, str]:
    """{module name: ``Fp8MoeBackend`` value} of every routed-experts module whose quant method
    chose a backend (``quantization/fp8.py::Fp8MoEMethod.fp8_backend``, from
    ``fused_moe/oracle/fp8.py::select_fp8_moe_backend``)."""
    out = {}
    for name, module in _modules(models):
        backend = getattr(getattr(module, "quant_method", None), "fp8_backend", None)
        if backend is not None:
            out[name] = str(getattr(backend, "value", backend))
    return out


def deepgemm_requantized_linears(*models: torch.nn.Module | None) -> list[str]:
    """Names of the linear modules whose block-FP8 weights vLLM re-quantized to power-of-two scales
    after loading: their kernel (``Fp8LinearMethod.fp8_linear``) is DeepGEMM's, or FlashInfer's
    dispatcher with a DeepGEMM ``fallback``, and had DeepGEMM and its E8M0 mode on
    (``kernels/linear/scaled_mm/deep_gemm.py::DeepGemmFp8BlockScaledMMKernel.
    process_weights_after_loading`` -> ``fp8_utils.py::deepgemm_post_process_fp8_weight_block``)."""
    out = []
    for name, module in _modules(models):
        kernel = getattr(getattr(module, "quant_method", None), "fp8_linear", None)
        if kernel is None:
            continue
        for k in (kernel, getattr(kernel, "base", None), getattr(kernel, "fallback", None)):
            deepgemm = getattr(k, "is_deep_gemm_supported", False) is True
            if deepgemm and getattr(k, "use_deep_gemm_e8m0", False):
                out.append(name)
                break
    return out


def engine_postload_plan(
    config: Mapping, target: torch.nn.Module, drafter: torch.nn.Module | None, *, deepgemm_e8m0: bool
) -> PostLoadPlan:
    """The ``PostLoadPlan`` of this engine: its routed experts' backend (one for every MoE module of
    target and drafter) and whether DeepGEMM re-quantized any linear."""
    backends = moe_backends(target, drafter)
    kinds = sorted(set(backends.values()))
    if len(kinds) > 1:
        raise EngineNotSupported(
            f"routed experts run on several fused-MoE backends {kinds}; glm_fp8 plans one post-load "
            "step for all of them"
        )
    if not kinds:
        raise EngineNotSupported(
            "no routed-experts module with an FP8 MoE backend (quant_method.fp8_backend) was found: the "
            "engine does not serve a block-FP8 checkpoint, which glm_fp8's updates are"
        )
    return postload_plan(
        config,
        moe_backend=kinds[0],
        deepgemm_linears=bool(deepgemm_requantized_linears(target, drafter)),
        deepgemm_e8m0=deepgemm_e8m0,
    )


# --- the parameters -------------------------------------------------------------------------------


@dataclass
class EngineParams:
    """The engine's tensors under vLLM's names, as ``Receiver.load_into`` takes them.

    ``aliases`` maps a drafter name to the target name of the same tensor (vLLM 0.34 shares the
    target's ``lm_head`` with the GLM-5 drafter's ``shared_head.head``:
    ``v1/worker/gpu/spec_decode/eagle/utils.py::load_eagle_model``); ``missing`` lists spec names
    neither model holds; ``not_in_specs`` counts engine parameters outside the update (derived
    ones such as MLA's ``W_UK_T``)."""

    params: dict[str, torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    not_in_specs: int = 0


def _named_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    # LoRA wraps layers as ``<name>.base_layer``; vLLM's own reload strips that level too
    # (model_loader/reload/inplace.py::reload_weights).
    return {n.replace(".base_layer.", "."): p for n, p in model.named_parameters()}


def collect_params(
    target: torch.nn.Module, drafter: torch.nn.Module | None, specs: Mapping[str, object]
) -> EngineParams:
    """The tensors of ``target`` (then ``drafter``, the MTP draft model) named in ``specs``
    (``engine_param_specs``), detached views of the real parameters: writing them updates the
    engine. A name both models hold must be one shared tensor (vLLM shares ``embed_tokens``,
    ``maybe_share_target_embed``); a drafter name holding a target tensor under another name is
    recorded in ``aliases``."""
    tp = _named_params(target)
    by_id = {id(p): n for n, p in tp.items()}
    params: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    outside = sum(1 for n in tp if n not in specs)
    for n, p in tp.items():
        if n in specs:
            params[n] = p.detach()
    if drafter is not None:
        for n, p in _named_params(drafter).items():
            if n in tp:
                if tp[n] is not p:
                    raise EngineNotSupported(
                        f"drafter {n}: a tensor of its own where vLLM 0.34 shares the target's "
                        "(maybe_share_target_embed); one name cannot carry two tensors in an update"
                    )
                continue
            if n not in specs:
                outside += 1
                continue
            if id(p) in by_id:
                aliases[n] = by_id[id(p)]
            params[n] = p.detach()
    missing = [n for n in specs if n not in params]
    return EngineParams(params, aliases, missing, outside)


def _position(name: str, layer_ids: Sequence[int]) -> int | None:
    idx, _ = split_name(name)
    key = REST if idx is None else idx
    return layer_ids.index(key) if key in layer_ids else None


def check_aliases(aliases: Mapping[str, str], layer_ids: Sequence[int]) -> None:
    """Refuse an update that would leave an aliased tensor holding the drafter's bytes. A drafter
    name aliasing a target tensor is landed into that tensor; vLLM keeps the target's value there
    (the drafter's checkpoint copy is dropped at load), so the target name must land after it,
    in a later layer of the same update (``REST`` travels last). ``layer_ids`` include ``REST``
    (-1) when the update carries the non-layer tensors."""
    for drafter_name, target_name in aliases.items():
        d, t = _position(drafter_name, layer_ids), _position(target_name, layer_ids)
        if d is None:
            continue
        if t is None or t <= d:
            raise ValueError(
                f"{drafter_name} is the target's {target_name} (vLLM 0.34 shares it: load_eagle_model): "
                f"an update landing it must also land {target_name} after it (rest=True), or the target "
                "would keep the drafter's copy"
            )


# --- the update -----------------------------------------------------------------------------------


class _Refusing(Mapping):
    """Params that make the receiver refuse at the manifest vote, so every rank (the trainer
    included) stops there with this error instead of waiting for a timeout."""

    def __init__(self, error: Exception):
        self.error = error

    def __getitem__(self, key):
        raise self.error

    def __contains__(self, key) -> bool:
        raise self.error

    def __iter__(self):
        raise self.error

    def __len__(self) -> int:
        return 0


class EngineUpdater:
    """Receives updates into one engine worker's parameters and runs the post-load step.

    Args:
        target, drafter: the served model and its MTP draft model (None without speculative
            decoding), ``torch.nn.Module`` trees with vLLM's parameter names.
        config: the model's HF config as a dict.
        layout: this worker's ``EngineLayout``.
        plan: its ``PostLoadPlan`` (``engine_postload_plan``).
        finalize: runs the engine's module hooks on one model after an update (the vLLM
            integration passes vLLM's ``finalize_model_weights`` under ``weights_already_processed``:
            MLA ``W_UK_T`` / ``W_UV``, not the quantization transforms). None: none run.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        drafter: torch.nn.Module | None,
        config: Mapping,
        layout: EngineLayout,
        plan: PostLoadPlan,
        finalize: Callable[[torch.nn.Module], None] | None = None,
    ):
        self.target, self.drafter, self.config, self.layout = target, drafter, dict(config), layout
        self.plan, self.finalize = plan, finalize
        self.mtp = mtp_layer_index(config) if drafter is not None else None
        self.full_layer_ids = model_layer_ids(config, mtp=drafter is not None)
        self.specs = engine_param_specs(config, layout)
        self.engine = collect_params(target, drafter, self.specs)
        scales = {n: p.dtype for n, p in self.engine.params.items() if n.endswith("_scale_inv")}
        bad = [n for n, dt in scales.items() if dt != torch.float32]
        if bad:
            raise EngineNotSupported(
                f"{bad[0]}: the engine holds {scales[bad[0]]} block scales, not float32: DeepGEMM packed "
                "them (SM100 UE8M0 layout, fp8_utils.py::deepgemm_post_process_weight_scale_block), which "
                "glm_fp8 does not land yet"
            )
        self.dirty = False  # an update failed: only a whole-model update may follow
        self.updates = 0

    def describe(self) -> dict[str, object]:
        """What a trainer needs to build a matching ``Broadcaster``, as plain data."""
        return {
            "layer_ids": list(self.full_layer_ids),
            "rest": True,
            "scale_fmt": self.plan.scale_fmt,
            "layout": {
                k: getattr(self.layout, k)
                for k in ("tp_size", "tp_rank", "ep_size", "ep_rank", "dp_size", "dp_rank")
            },
            "sequence_parallel_moe": self.layout.sp_moe,
            "postload": self.plan.describe(),
            "aliases": dict(self.engine.aliases),
            "needs_full_update": self.dirty,
        }

    def _refusal(self, layer_ids: list[int], rest: bool, scale_fmt: str) -> Exception | None:
        if self.plan.scale_fmt == "ue8m0" and scale_fmt != "ue8m0":
            return EngineNotSupported(
                f"scale_fmt={scale_fmt!r}: this engine serves DeepGEMM-requantized weights (MoE backend "
                f"{self.plan.moe_backend} / DeepGEMM linears, VLLM_USE_DEEP_GEMM_E8M0), which hold "
                "power-of-two block scales; the trainer must send scale_fmt='ue8m0' "
                "(Broadcaster(..., scale_fmt='ue8m0'))"
            )
        if self.dirty and (layer_ids != self.full_layer_ids or not rest):
            return EngineNotSupported(
                "a previous update failed, so the parameters hold a mix of formats; only a whole-model "
                f"update (layer_ids={self.full_layer_ids}, rest=True) may follow, got layer_ids={layer_ids}, "
                f"rest={rest}"
            )
        try:
            check_aliases(self.engine.aliases, layer_ids + ([REST] if rest else []))
        except ValueError as exc:
            return exc
        return None

    def update(
        self,
        comm: object | None,
        src: int = 0,
        *,
        layer_ids: Sequence[int] | None = None,
        rest: bool = True,
        scale_fmt: str | None = None,
        device: torch.device | str | None = None,
        ring: int = 2,
    ) -> dict[str, object]:
        """Receive one update from ``src`` over ``comm`` into the engine's parameters, then run the
        post-load step on what landed. ``layer_ids`` default to the whole model (every decoder
        layer, then the MTP layer when there is a drafter); ``scale_fmt`` to the plan's. Refusals
        known before the transfer (a scale format the engine cannot serve, a partial update after
        a failed one, an aliased tensor left with the drafter's bytes) are voted at the manifest,
        so every rank stops there. Raises what ``Receiver.load_into`` raises; after any failure the
        parameters must not be served until a whole-model update succeeds."""
        ids = list(self.full_layer_ids if layer_ids is None else (int(i) for i in layer_ids))
        fmt = self.plan.scale_fmt if scale_fmt is None else scale_fmt
        if device is None:
            device = next(iter(self.engine.params.values())).device
        receiver = Receiver(comm, src, config=self.config, layout=self.layout, layer_ids=ids, rest=rest,
                            scale_fmt=fmt, ring=ring, device=device)  # fmt: skip
        refusal = self._refusal(ids, rest, fmt)
        params: Mapping[str, torch.Tensor] = self.engine.params if refusal is None else _Refusing(refusal)
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                stats = receiver.load_into(params)
        except BaseException:
            # Nothing landed when the refusal was ours; otherwise some layers may have.
            self.dirty = self.dirty or refusal is None
            raise
        t1 = time.perf_counter()
        landed = [layer.layer for layer in stats.layers]
        try:
            with torch.no_grad():
                rewritten = apply_postload_(self.engine.params, self.plan, self.config, landed)
                hooks = self._run_hooks(landed)
        except BaseException:
            self.dirty = True
            raise
        self.dirty = False if (ids == self.full_layer_ids and rest) else self.dirty
        self.updates += 1
        return {
            "layers": len(landed),
            "bytes": sum(layer.nbytes for layer in stats.layers),
            "receive_s": round(t1 - t0, 6),
            "postload_s": round(time.perf_counter() - t1, 6),
            "rewritten": len(rewritten),
            "hooks": hooks,
            "scale_fmt": fmt,
            "update": self.updates,
        }

    def _run_hooks(self, landed: list[int]) -> list[str]:
        if self.finalize is None:
            return []
        ran = []
        if any(i != self.mtp for i in landed):
            self.finalize(self.target)
            ran.append("target")
        if self.drafter is not None and (self.mtp in landed or REST in landed):
            # The drafter's hooks read what it shares with the target too (embed_tokens, lm_head).
            self.finalize(self.drafter)
            ran.append("drafter")
        return ran


def parse_flag(name: str, value: object) -> bool:
    """A bool, or its spelling as a string ("true"/"false"/"1"/"0", any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"{name}: expected a bool or 'true'/'false', got {value!r}")


def parse_layer_ids(value: object) -> list[int] | None:
    """None, a sequence of ints, or the same as a JSON string ("null" or "[0, 1, 78]")."""
    if isinstance(value, str):
        value = json.loads(value)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise ValueError(f"layer_ids: expected None or a list of ints, got {value!r}")
    return [int(i) for i in value]


# --- the vLLM worker extension --------------------------------------------------------------------


class GlmFp8WorkerExtension:
    """vLLM worker extension (``worker_extension_cls``): glm_fp8 updates over NCCL.

    Every method runs on every worker through ``collective_rpc`` and takes JSON-able arguments,
    so it also works through the dev server's ``/collective_rpc`` route. Trainer side
    (docs/vllm.md): the trainer is rank 0 of a ``StatelessProcessGroup`` + ``PyNcclCommunicator``
    group of ``1 + number of engine workers`` ranks and runs ``Broadcaster(comm, 0, config=...,
    layer_ids=..., rest=True, scale_fmt=...).broadcast_model(layers, rest=...)`` while the engines
    run ``glm_fp8_update``.
    """

    def glm_fp8_describe(self) -> dict[str, object]:
        """The layout, the post-load plan and the ``layer_ids`` / ``rest`` / ``scale_fmt`` the
        trainer's ``Broadcaster`` must use (the same on every worker but the layout)."""
        return self._glm_fp8_updater().describe()

    def glm_fp8_init(
        self, host: str, port: int, world_size: int, rank_offset: int = 1, src: int = 0
    ) -> dict[str, object]:
        """Join the trainer's group: rank ``rank_offset + data_parallel_index * (TP * PP) + rank``,
        as vLLM's own NCCL weight transfer numbers its workers
        (``distributed/weight_transfer/nccl_common.py::_worker_group_rank``); the trainer is
        ``src`` (rank 0 below ``rank_offset``). Returns ``glm_fp8_describe()`` plus this rank."""
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        pc = self.vllm_config.parallel_config
        rank = int(rank_offset) + int(pc.data_parallel_index) * int(pc.world_size) + int(pc.rank)
        if not 0 <= int(src) < int(rank_offset):
            raise ValueError(f"src: the trainer's rank must be below rank_offset={rank_offset}, got {src}")
        self.glm_fp8_close()
        comm = stateless_init_process_group(host, int(port), rank, int(world_size), device=self.device)
        self._glm_fp8_link = (comm, int(src))
        return {**self.glm_fp8_describe(), "rank": rank}

    def glm_fp8_update(
        self,
        layer_ids: list[int] | str | None = None,
        rest: bool | str = True,
        scale_fmt: str | None = None,
    ) -> dict[str, object]:
        """Receive one update (the trainer broadcasts at the same time) and run the post-load step.
        Clear the engine's prefix cache afterwards (``LLM.reset_prefix_cache()``): cached KV was
        computed with the old weights. Arguments may also come as strings (the dev server's
        ``/collective_rpc`` passes only strings): ``layer_ids`` as JSON, ``rest`` as true/false."""
        from vllm.config import set_current_vllm_config

        layer_ids, rest = parse_layer_ids(layer_ids), parse_flag("rest", rest)

        link = getattr(self, "_glm_fp8_link", None)
        if link is None:
            raise RuntimeError("glm_fp8_update: call glm_fp8_init(host, port, world_size) first")
        comm, src = link
        updater = self._glm_fp8_updater()
        with set_current_vllm_config(self.vllm_config):
            out = updater.update(comm, src, layer_ids=layer_ids, rest=rest, scale_fmt=scale_fmt)
            # What GPUModelRunner.reload_weights does after a reload (v1/worker/gpu/model_runner.py):
            # drop LoRA state and refresh quantized draft lm_head copies derived from the target.
            reset = getattr(self.model_runner, "reset_lora_state", None)
            if callable(reset):
                reset()
        return out

    def glm_fp8_close(self) -> None:
        """Leave the trainer's group (``PyNcclCommunicator.destroy``)."""
        link = getattr(self, "_glm_fp8_link", None)
        self._glm_fp8_link = None
        if link is not None and hasattr(link[0], "destroy"):
            link[0].destroy()

    def _glm_fp8_updater(self) -> EngineUpdater:
        updater = getattr(self, "_glm_fp8_state", None)
        if updater is not None:
            return updater
        from vllm.distributed.parallel_state import get_dp_group, get_tp_group
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used

        model_config = self.vllm_config.model_config
        hf = getattr(model_config, "hf_text_config", None) or model_config.hf_config
        config = hf.to_dict()
        pc = self.vllm_config.parallel_config
        runner = self.model_runner
        target = runner.get_model()
        get_draft = getattr(runner, "get_draft_model", None)
        if callable(get_draft):
            drafter = get_draft()
        else:  # a runner without get_draft_model: the speculator's model (spec_decode/speculator.py)
            drafter = getattr(getattr(runner, "speculator", None), "model", None)
        dp_rank = get_dp_group().rank_in_group if pc.data_parallel_size > 1 else 0
        layout = layout_from_parallel_config(pc, tp_rank=get_tp_group().rank_in_group, dp_rank=dp_rank,
                                             config=config)  # fmt: skip
        check_moe_parallel(layout, target)
        plan = engine_postload_plan(config, target, drafter, deepgemm_e8m0=is_deep_gemm_e8m0_used())
        updater = EngineUpdater(target, drafter, config, layout, plan, finalize=_vllm_finalize)
        self._glm_fp8_state = updater
        return updater


def _vllm_finalize(model: torch.nn.Module) -> None:
    """vLLM 0.34's own end of a kernel-format reload (``model_loader/reload/inplace.py::
    reload_weights``): every module's ``process_weights_after_loading`` hook, children first
    (``weight_utils.py::finalize_model_weights``), inside ``weights_already_processed()`` so
    quantization methods transform nothing (``quantization/fp8.py``: ``is_weights_pre_processed``)
    while MLA rebuilds ``W_UK_T`` / ``W_UV`` in place (``replace_parameter``)."""
    from vllm.model_executor.model_loader.weight_utils import finalize_model_weights
    from vllm.model_executor.utils import weights_already_processed

    with weights_already_processed():
        finalize_model_weights(model)


__all__ = [
    "EngineNotSupported",
    "EngineParams",
    "EngineUpdater",
    "GlmFp8WorkerExtension",
    "check_aliases",
    "check_moe_parallel",
    "collect_params",
    "deepgemm_requantized_linears",
    "engine_postload_plan",
    "layout_from_parallel_config",
    "moe_backends",
    "parse_flag",
    "parse_layer_ids",
]
