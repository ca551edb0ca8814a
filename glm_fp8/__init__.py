"""glm_fp8: fused block-FP8 quantization of MoE weights for trainer -> vLLM weight broadcasts.

Attributes load lazily, so that ``glm-fp8`` can choose Triton's interpreter (an environment
variable read when the kernels are defined) before the kernels are imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "as_config": "glm_fp8.config",
    "available_backends": "glm_fp8.backends",
    "get_default_backend": "glm_fp8.backends",
    "set_default_backend": "glm_fp8.backends",
    "Broadcaster": "glm_fp8.transfer",
    "Sender": "glm_fp8.transfer",
    "HostSinkComm": "glm_fp8.transfer",
    "Receiver": "glm_fp8.transfer",
    "contribute_shards": "glm_fp8.transfer",
    "convert_layer": "glm_fp8.convert",
    "EngineLayout": "glm_fp8.engine",
    "engine_param_specs": "glm_fp8.engine",
    "LayerPlan": "glm_fp8.plan",
    "plan_from_config": "glm_fp8.plan",
    "plan_from_state_dict": "glm_fp8.plan",
    "DEFAULT_CONFIG": "glm_fp8.kernels.triton_launch",
    "default_config": "glm_fp8.kernels.triton_launch",
    "ExpertsFP8": "glm_fp8.quantize",
    "LaunchConfig": "glm_fp8.kernels.triton_launch",
    "quantize_blockwise": "glm_fp8.quantize",
    "quantize_experts": "glm_fp8.quantize",
    # every exception class of the package, under GlmFp8Error (glm_fp8.errors)
    "EngineNotSupported": "glm_fp8.errors",
    "GlmFp8Error": "glm_fp8.errors",
    "LayerOrderError": "glm_fp8.errors",
    "LinkLost": "glm_fp8.errors",
    "ManifestMismatch": "glm_fp8.errors",
    "NonFiniteError": "glm_fp8.errors",
    "PlanArgumentError": "glm_fp8.errors",
    "ReceiverRefused": "glm_fp8.errors",
    "UpdateAborted": "glm_fp8.errors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from glm_fp8.backends import available_backends, get_default_backend, set_default_backend
    from glm_fp8.config import as_config
    from glm_fp8.convert import convert_layer
    from glm_fp8.engine import EngineLayout, engine_param_specs
    from glm_fp8.errors import (
        EngineNotSupported,
        GlmFp8Error,
        LayerOrderError,
        LinkLost,
        ManifestMismatch,
        NonFiniteError,
        PlanArgumentError,
        ReceiverRefused,
        UpdateAborted,
    )
    from glm_fp8.kernels.triton_launch import DEFAULT_CONFIG, LaunchConfig, default_config
    from glm_fp8.plan import LayerPlan, plan_from_config, plan_from_state_dict
    from glm_fp8.quantize import ExpertsFP8, quantize_blockwise, quantize_experts
    from glm_fp8.transfer import Broadcaster, HostSinkComm, Receiver, Sender, contribute_shards


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name]), name)
        return value  # cached: later lookups skip this hook
    raise AttributeError(f"module 'glm_fp8' has no attribute {name!r}")
