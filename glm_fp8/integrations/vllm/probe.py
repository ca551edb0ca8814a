"""What a vLLM 0.34 worker was built with, read from vLLM's objects without importing vLLM: its
parallel layout (``layout_from_parallel_config``, checked against every routed-experts module by
``check_moe_parallel``) and the post-load step its kernels need after an update
(``engine_postload_plan``, from ``moe_backends`` and ``deepgemm_requantized_linears``). Each raises
``EngineNotSupported`` naming what glm_fp8 cannot update in place (docs/vllm.md#what-happens-on-a-worker).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from glm_fp8.core.errors import EngineNotSupported
from glm_fp8.engine.layout import EngineLayout
from glm_fp8.engine.postload import PostLoadPlan, postload_plan

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
    for attr, why in (
        ("pipeline_parallel_size", "pipeline parallelism"),
        ("prefill_context_parallel_size", "prefill context parallelism"),
    ):
        if getattr(pc, attr, 1) != 1:
            raise EngineNotSupported(
                f"parallel_config.{attr}={getattr(pc, attr)}: {why} is not supported "
                "(EngineLayout models pipeline_parallel_size 1, pcp 1)"
            )
    if getattr(pc, "enable_eplb", False):
        raise EngineNotSupported(
            "parallel_config.enable_eplb: EPLB moves experts at run time and adds "
            "redundant ones; glm_fp8's expert placement is vLLM's static 'linear' one"
        )
    if (
        getattr(pc, "expert_placement_strategy", "linear") == "round_robin"
        and config is not None
        and (config.get("n_group") or 1) > 1
    ):
        raise EngineNotSupported(
            "parallel_config.expert_placement_strategy='round_robin' with n_group > 1: "
            "only the 'linear' placement is supported"
        )
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
        want = {
            "ep_size": layout.ep_size,
            "ep_rank": layout.ep_rank,
            "tp_size": layout.moe_tp_size,
            "tp_rank": layout.moe_tp_rank,
        }
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


__all__ = [
    "check_moe_parallel",
    "deepgemm_requantized_linears",
    "engine_postload_plan",
    "layout_from_parallel_config",
    "moe_backends",
]
