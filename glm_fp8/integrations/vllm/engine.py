"""Renamed ``glm_fp8.integrations.vllm.updater`` (``EngineUpdater``, ``collect_params``) and
``glm_fp8.integrations.vllm.probe`` (the worker's layout and post-load plan); kept so old imports
work. Nothing in glm_fp8 imports this module."""

from glm_fp8.integrations.vllm.probe import (
    EngineNotSupported,
    check_moe_parallel,
    deepgemm_requantized_linears,
    engine_postload_plan,
    layout_from_parallel_config,
    moe_backends,
)
from glm_fp8.integrations.vllm.updater import EngineParams, EngineUpdater, collect_params

__all__ = [
    "EngineNotSupported",
    "EngineParams",
    "EngineUpdater",
    "check_moe_parallel",
    "collect_params",
    "deepgemm_requantized_linears",
    "engine_postload_plan",
    "layout_from_parallel_config",
    "moe_backends",
]
