"""Which implementation runs the quantization, and the launchers of the non-Triton ones.

- ``"triton"``: the Triton kernel of ``glm_fp8.quantize`` (CUDA devices; the CPU only under
  ``TRITON_INTERPRET=1``, slowly).
- ``"cuda"``: the compiled extension ``glm_fp8._C`` built from ``csrc/`` by ``setup.py``; its op
  is ``torch.ops.glm_fp8.quantize_blockwise_(q[], scale[], sources[], num_sources[], ue8m0,
  nonfinite)``, which runs a group of jobs of one input dtype as one grid (quantize_experts
  and a layer's convert_layer launch once per dtype). Registered with torch.library, with a
  fake kernel, so it traces under ``torch.compile`` and captures into CUDA graphs.
- ``"torch"``: the eager reference (any device; allocates the concatenation and float32
  temporaries of one expert at a time). For checks and CPU-only machines, not for speed.
- ``"auto"``: on CUDA devices ``"cuda"`` when the extension is built, else ``"triton"``; on
  the CPU ``"triton"`` under the interpreter, else ``"torch"``.

Every backend writes the same bits (tests/test_quantize.py runs the suite on each one).
The package-wide default is ``"auto"``, or ``$GLM_FP8_BACKEND``; ``set_default_backend`` changes
it for this process.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

BACKENDS = ("auto", "triton", "cuda", "torch")

_default_backend = os.environ.get("GLM_FP8_BACKEND", "auto")


def interpreting() -> bool:
    """True under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_name(name: object, what: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{what}: expected one of {BACKENDS}, got {name!r}")
    return name  # type: ignore[return-value]


def set_default_backend(name: str) -> None:
    """Backend used when a call passes ``backend=None`` (the default of every public function)."""
    global _default_backend
    _default_backend = _check_name(name, "backend")


def get_default_backend() -> str:
    return _check_name(_default_backend, "GLM_FP8_BACKEND")


@functools.cache
def _extension() -> tuple[bool, str]:
    """Import glm_fp8._C once (it registers torch.ops.glm_fp8.*); (loaded, why not)."""
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


def cuda_backend_available() -> bool:
    """True when the compiled extension is built for this torch and a CUDA device is visible."""
    return _extension()[0]


def available_backends(device: torch.device | str = "cuda") -> list[str]:
    """Backends that can run on ``device`` in this process, fastest first."""
    device = torch.device(device)
    if device.type == "cuda":
        return (["cuda"] if cuda_backend_available() else []) + ["triton", "torch"]
    return (["triton"] if interpreting() else []) + ["torch"]


def resolve_backend(backend: str | None, device: torch.device, config_given: bool = False) -> str:
    """The concrete backend for a call on ``device``; raises if the one asked for cannot run."""
    name = get_default_backend() if backend is None else _check_name(backend, "backend")
    if name == "auto":
        if config_given:  # a LaunchConfig tunes the Triton kernel: the caller wants it
            name = "triton"
        else:
            return available_backends(device)[0]
    if config_given and name != "triton":
        raise ValueError(f"config: a LaunchConfig tunes the Triton backend, but backend={name!r}")
    if name == "cuda":
        if device.type != "cuda":
            raise RuntimeError(f"backend='cuda': the inputs are on {device}; it runs on CUDA devices")
        loaded, why = _extension()
        if not loaded:
            raise RuntimeError(
                f"backend='cuda' is not available: {why}. Build it with "
                "GLM_FP8_BUILD_CUDA=1 pip install --no-build-isolation -e . (README), or use "
                "backend='triton'."
            )
    if name == "triton" and device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"backend='triton': the inputs are on {device}; the Triton kernels run on CUDA devices, "
            "or on the CPU only under TRITON_INTERPRET=1 (slow). backend='torch' runs anywhere."
        )
    return name


# A validated launch: sources [E, R_k, C], q [E, R, C] and scale [E, ceil(R/128), ceil(C/128)].
Work = Sequence[tuple[Sequence[torch.Tensor], torch.Tensor, torch.Tensor]]


def launch_cuda(work: Work, ue8m0: bool, nonfinite: torch.Tensor | None) -> None:
    """The compiled kernel: one op call, and so one grid, per input dtype for all of ``work``."""
    by_dtype: dict[torch.dtype, list] = {}
    for item in work:
        by_dtype.setdefault(item[0][0].dtype, []).append(item)
    for items in by_dtype.values():
        torch.ops.glm_fp8.quantize_blockwise_(
            [q for _, q, _ in items], [s for _, _, s in items], [t for srcs, _, _ in items for t in srcs],
            [len(srcs) for srcs, _, _ in items], ue8m0, nonfinite,
        )  # fmt: skip


def launch_torch(work: Work, ue8m0: bool, nonfinite: torch.Tensor | None) -> None:
    """The reference, one expert at a time, copied into the caller's views."""
    from glm_fp8.reference import quantize_concat_ref

    for sources, q, s in work:
        for e in range(q.shape[0]):
            q_e, s_e = quantize_concat_ref([src[e] for src in sources], "ue8m0" if ue8m0 else "fp32")
            q[e].view(torch.uint8).copy_(q_e.view(torch.uint8))
            s[e].copy_(s_e)
            if nonfinite is not None:
                nonfinite.bitwise_or_((~torch.isfinite(s_e)).any().to(torch.int32))


LAUNCHERS = {"cuda": launch_cuda, "torch": launch_torch}

__all__ = [
    "BACKENDS",
    "available_backends",
    "cuda_backend_available",
    "get_default_backend",
    "resolve_backend",
    "set_default_backend",
]
