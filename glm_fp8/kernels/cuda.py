"""The CUDA C++ backend's Python side: loading the compiled extension ``glm_fp8._C`` (built
from ``csrc/`` by setup.py) and ``launch``, its entry in ``glm_fp8.kernels.backends.LAUNCHERS``.

Its op is ``torch.ops.glm_fp8.quantize_blockwise_(q[], scale[], sources[], num_sources[],
ue8m0, nonfinite)``: a group of jobs of one input dtype as one grid, so quantize_experts and a
layer's convert_layer launch once per dtype. Registered with torch.library, with a fake kernel
here, so it traces under ``torch.compile`` and captures into CUDA graphs.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def extension() -> tuple[bool, str]:
    """Import glm_fp8._C once (it registers torch.ops.glm_fp8.*); (loaded, why not). Loaded on
    first use: it needs a CUDA build of torch and a visible device."""
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible to torch"
    try:
        import glm_fp8._C  # noqa: F401
    except ImportError as e:
        return False, f"glm_fp8._C is not importable ({e})"

    @torch.library.register_fake("glm_fp8::quantize_blockwise_")
    def _(q, scale, sources, num_sources, ue8m0, nonfinite=None):  # noqa: ANN001 - mutates q/scale only
        return None

    return True, ""


def launch(work, ue8m0: bool, nonfinite: torch.Tensor | None, config: object = None) -> None:
    """The compiled kernel: one op call, and so one grid, per input dtype for all of ``work``."""
    by_dtype: dict[torch.dtype, list] = {}
    for item in work:
        by_dtype.setdefault(item[0][0].dtype, []).append(item)
    for items in by_dtype.values():
        torch.ops.glm_fp8.quantize_blockwise_(
            [q for _, q, _ in items],
            [s for _, _, s in items],
            [t for srcs, _, _ in items for t in srcs],
            [len(srcs) for srcs, _, _ in items],
            ue8m0,
            nonfinite,
        )
