"""Which implementation runs the quantization: the registry of backends and the choice.

Every backend is one ``Launcher`` in ``LAUNCHERS``, called the same way by the job layer
(``glm_fp8.kernels.jobs``):
- ``"triton"``: ``glm_fp8.kernels.triton_quantize`` (CUDA devices; the CPU only under
  ``TRITON_INTERPRET=1``, slowly).
- ``"cuda"``: ``glm_fp8.kernels.cuda``, the compiled extension built from ``csrc/``.
- ``"torch"``: ``glm_fp8.kernels.torch_ref``, the eager reference (any device; allocates the
  concatenation and float32 temporaries of one expert at a time).
- ``"auto"``: on CUDA devices ``"cuda"`` when the extension is built, else ``"triton"``; on
  the CPU ``"triton"`` under the interpreter, else ``"torch"``.

Every backend writes the same bits (tests/kernels/test_quantize.py runs the suite on each one).
The package-wide default is ``"auto"``, or ``$GLM_FP8_BACKEND``; ``set_default_backend`` changes
it for this process. ``available_backends(device)`` lists exactly the names ``resolve_backend``
accepts for inputs on ``device``.

The delta kernels (``glm_fp8.kernels.delta``) are chosen by the same ``resolve_backend``
(``delta=True``): "triton" (``glm_fp8.kernels.triton_delta``) or "torch" (the reference's
``delta_encode_ref`` / ``delta_apply_ref``); there is no CUDA C++ delta kernel, and "auto" or
``None`` picks "triton" wherever it runs. A backend that cannot run raises ``BackendUnavailable``
(a ``RuntimeError``), an unknown name ``ValueError``, for dense and delta kernels alike.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from glm_fp8.core.errors import BackendUnavailable
from glm_fp8.core.vocab import BACKENDS, check_choice
from glm_fp8.kernels import cuda, torch_ref, triton_quantize
from glm_fp8.kernels.triton_quantize import interpreting

DELTA_BACKENDS = ("auto", "triton", "torch")  # the delta kernels have no CUDA C++ backend

_default_backend = os.environ.get("GLM_FP8_BACKEND", "auto")


def _check_name(name: object, what: str, names: tuple[str, ...] = BACKENDS) -> str:
    return check_choice(what, name, names)


def set_default_backend(name: str) -> None:
    """Backend used when a call passes ``backend=None`` (the default of every public function)."""
    global _default_backend
    _default_backend = _check_name(name, "backend")


def get_default_backend() -> str:
    return _check_name(_default_backend, "GLM_FP8_BACKEND")


def cuda_backend_available() -> bool:
    """True when the compiled extension is built for this torch and a CUDA device is visible."""
    return cuda.extension()[0]


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends that run on ``device`` in this process, fastest first: exactly the names that
    ``backend=`` accepts for inputs on that device ("auto" aside). ``None``: this machine's
    device, a CUDA device when one is visible, else the CPU. On the CPU "triton" is listed only
    under Triton's interpreter (``TRITON_INTERPRET=1``); a CUDA device where none is visible lists
    nothing."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return []
        return (["cuda"] if cuda_backend_available() else []) + ["triton", "torch"]
    return (["triton"] if interpreting() else []) + ["torch"]


def resolve_backend(
    backend: str | None,
    device: torch.device,
    config_given: bool = False,
    *,
    delta: bool = False,
) -> str:
    """The concrete backend for a call on ``device``: the dense kernels' (``delta=False``;
    ``None`` is the package default) or the delta kernels' (``delta=True``; ``None`` is "auto").
    Raises ``ValueError`` for a name that is not a backend and ``BackendUnavailable`` for one
    that cannot run here."""
    if delta:
        name = "auto" if backend is None else _check_name(backend, "backend", DELTA_BACKENDS)
    else:
        name = get_default_backend() if backend is None else _check_name(backend, "backend")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable(
            f"backend={name!r}: the inputs are on {device}; no CUDA device is visible here"
        )
    if name == "auto":
        if config_given:  # a LaunchConfig tunes the Triton kernel: the caller wants it
            name = "triton"
        elif delta:
            return "triton" if device.type == "cuda" or interpreting() else "torch"
        else:
            return available_backends(device)[0]
    if config_given and name != "triton":
        raise ValueError(f"config: a LaunchConfig tunes the Triton backend, but backend={name!r}")
    if name == "cuda":
        if device.type != "cuda":
            raise BackendUnavailable(f"backend='cuda': the inputs are on {device}; it runs on CUDA devices")
        loaded, why = cuda.extension()
        if not loaded:
            raise BackendUnavailable(
                f"backend='cuda' is not available: {why}. Build it with "
                "GLM_FP8_BUILD_CUDA=1 pip install --no-build-isolation -e . (README), or use "
                "backend='triton'."
            )
    if name == "triton" and device.type != "cuda" and not interpreting():
        raise BackendUnavailable(
            f"backend='triton': the inputs are on {device}; the Triton kernels run on CUDA devices, "
            "or on the CPU only under TRITON_INTERPRET=1 (slow). backend='torch' runs anywhere."
        )
    return name


# A validated launch: sources [E, R_k, C], q [E, R, C] and scale [E, ceil(R/128), ceil(C/128)].
Work = Sequence[tuple[Sequence[torch.Tensor], torch.Tensor, torch.Tensor]]
# launcher(work, ue8m0, nonfinite flag or None, LaunchConfig or None): enqueue every job of work.
Launcher = Callable[[Work, bool, "torch.Tensor | None", object], None]

LAUNCHERS: dict[str, Launcher] = {
    "triton": triton_quantize.launch,
    "cuda": cuda.launch,
    "torch": torch_ref.launch,
}

__all__ = [
    "DELTA_BACKENDS",
    "LAUNCHERS",
    "available_backends",
    "cuda_backend_available",
    "get_default_backend",
    "resolve_backend",
    "set_default_backend",
]
