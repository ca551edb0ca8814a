"""glm_fp8: fused block-FP8 quantization of MoE weights for trainer -> vLLM weight broadcasts.

Attributes load lazily, so that ``glm-fp8`` can choose Triton's interpreter (an environment
variable read when the kernels are defined) before the kernels are imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "as_config": "glm_fp8.model.config",
    "available_backends": "glm_fp8.kernels.backends",
    "get_default_backend": "glm_fp8.kernels.backends",
    "set_default_backend": "glm_fp8.kernels.backends",
    "Sender": "glm_fp8.transfer",
    "SendOptions": "glm_fp8.transfer",
    "ReceiveOptions": "glm_fp8.transfer",
    "DeltaOptions": "glm_fp8.transfer",
    "HostSinkComm": "glm_fp8.transfer",
    "Receiver": "glm_fp8.transfer",
    "contribute_shards": "glm_fp8.transfer",
    "convert_layer": "glm_fp8.kernels.convert",
    "EngineLayout": "glm_fp8.engine",
    "engine_param_specs": "glm_fp8.engine",
    "LayerPlan": "glm_fp8.model.plans",
    "plan_from_config": "glm_fp8.model.plans",
    "plan_from_state_dict": "glm_fp8.model.plans",
    "DEFAULT_CONFIG": "glm_fp8.kernels.triton_quantize",
    "default_config": "glm_fp8.kernels.triton_quantize",
    "ExpertsFP8": "glm_fp8.kernels.quantize",
    "LaunchConfig": "glm_fp8.kernels.triton_quantize",
    "quantize_blockwise": "glm_fp8.kernels.quantize",
    "quantize_experts": "glm_fp8.kernels.quantize",
    # every exception class of the package, under GlmFp8Error (glm_fp8.core.errors)
    "BackendUnavailable": "glm_fp8.core.errors",
    "EngineCallFailed": "glm_fp8.core.errors",
    "EngineNotSupported": "glm_fp8.core.errors",
    "GlmFp8Error": "glm_fp8.core.errors",
    "LayerOrderError": "glm_fp8.core.errors",
    "LinkLost": "glm_fp8.core.errors",
    "ManifestMismatch": "glm_fp8.core.errors",
    "NonFiniteError": "glm_fp8.core.errors",
    "PlanArgumentError": "glm_fp8.core.errors",
    "ReceiverRefused": "glm_fp8.core.errors",
    "UpdateAborted": "glm_fp8.core.errors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from glm_fp8.core.errors import (
        BackendUnavailable,
        EngineCallFailed,
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
    from glm_fp8.engine.layout import EngineLayout
    from glm_fp8.engine.specs import engine_param_specs
    from glm_fp8.kernels.backends import available_backends, get_default_backend, set_default_backend
    from glm_fp8.kernels.convert import convert_layer
    from glm_fp8.kernels.quantize import ExpertsFP8, quantize_blockwise, quantize_experts
    from glm_fp8.kernels.triton_quantize import DEFAULT_CONFIG, LaunchConfig, default_config
    from glm_fp8.model.config import as_config
    from glm_fp8.model.layer_plan import LayerPlan
    from glm_fp8.model.plans import plan_from_config, plan_from_state_dict
    from glm_fp8.transfer.gather import contribute_shards
    from glm_fp8.transfer.link import HostSinkComm
    from glm_fp8.transfer.options import DeltaOptions, ReceiveOptions, SendOptions
    from glm_fp8.transfer.receiver import Receiver
    from glm_fp8.transfer.sender import Sender


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name]), name)
        return value  # cached: later lookups skip this hook
    raise AttributeError(f"module 'glm_fp8' has no attribute {name!r}")
