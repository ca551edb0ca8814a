"""The kernels and everything that runs them: the PyTorch reference every backend equals bit for
bit (``reference``), the Triton kernel beside its launcher (``triton_quantize``), the delta kernels
(``triton_delta``), the CUDA C++ op built from ``csrc/`` (``cuda``), the reference as a backend
(``torch_ref``), the wire checksum (``checksum``); one resolver for dense and delta kernels
(``backends``), validated jobs every backend runs (``jobs``), and the public functions over them:
``quantize`` (``quantize_blockwise``, ``quantize_experts``), ``delta`` (``quantize_compare``,
``apply_delta``), ``delta_cut`` and ``convert`` (one trainer layer into one kernel-format buffer).
Imports ``glm_fp8.core`` and ``glm_fp8.model``."""

from glm_fp8.kernels.backends import available_backends, get_default_backend, set_default_backend
from glm_fp8.kernels.convert import convert_layer
from glm_fp8.kernels.delta import BlockDelta, apply_delta, compare_bytes, quantize_compare
from glm_fp8.kernels.quantize import ExpertsFP8, quantize_blockwise, quantize_experts
from glm_fp8.kernels.triton_quantize import DEFAULT_CONFIG, LaunchConfig, default_config

__all__ = [
    "DEFAULT_CONFIG",
    "BlockDelta",
    "ExpertsFP8",
    "LaunchConfig",
    "apply_delta",
    "available_backends",
    "compare_bytes",
    "convert_layer",
    "default_config",
    "get_default_backend",
    "quantize_blockwise",
    "quantize_compare",
    "quantize_experts",
    "set_default_backend",
]
