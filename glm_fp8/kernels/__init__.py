"""The quantization kernels and their launchers, one module each: the Triton kernel
(``triton_quantize``) and its launcher (``triton_launch``), the compiled CUDA C++ op built from
``csrc/`` (``cuda``), and the eager reference as a launcher (``torch_ref``). Every launcher has
the signature of ``glm_fp8.backends.Launcher``; ``glm_fp8.backends`` registers them."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
