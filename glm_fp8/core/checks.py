"""Argument contracts shared by the public entry points: every check runs before any launch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from glm_fp8.core.numerics import INPUT_DTYPES
from glm_fp8.core.vocab import SCALE_FORMATS, check_choice


def check_int(name: str, value: object, lo: int, hi: int | None = None, why: str = "") -> int:
    """``value`` as an int in ``[lo, hi]`` (``hi`` None: no upper bound), else a ValueError naming
    ``name``. Integral types only (numpy and torch integer scalars too): a float, even 2.0, a bool or
    a string is refused, never truncated or parsed."""
    import operator

    if isinstance(value, bool) or isinstance(value, float):
        ok = False
    else:
        try:
            value = operator.index(value)
            ok = True
        except TypeError:
            ok = False
    bound = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    if not ok:
        raise ValueError(f"{name}: expected {bound}{why}, got {value!r} ({type(value).__name__})")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name}: expected {bound}{why}, got {value}")
    return value


def check_scale_fmt(scale_fmt: str) -> None:
    check_choice("scale_fmt", scale_fmt, SCALE_FORMATS)


def named_sources(sources: object) -> list[tuple[str, torch.Tensor]]:
    """The ``sources`` argument of the quantizers (one tensor or a list/tuple of them) as
    ``(name, tensor)`` pairs, named as errors call them: "sources" or "sources[k]". The tensors
    themselves are checked later (``glm_fp8.kernels.jobs.plan_job``)."""
    if isinstance(sources, torch.Tensor):
        return [("sources", sources)]
    if isinstance(sources, (list, tuple)):
        return [(f"sources[{k}]", t) for k, t in enumerate(sources)]
    raise TypeError(f"sources: expected a tensor or a sequence of tensors, got {type(sources).__name__}")


_STRIDED = torch.strided


def check_tensor(name: str, t: object) -> torch.Tensor:
    """A tensor with data in memory: strided (dense) layout, not on the meta device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout is not _STRIDED:
        raise TypeError(f"{name}: expected a strided (dense) tensor, got layout {t.layout}")
    if t.is_meta:
        raise ValueError(f"{name}: expected a tensor with data, got a meta tensor")
    return t


def check_input(name: str, t: object, ndim: int | None = None) -> torch.Tensor:
    """A readable source tensor: dense with data, floating dtype we quantize, 2-D or 3-D (or
    exactly ``ndim``)."""
    if not isinstance(t, torch.Tensor) or t.layout is not _STRIDED or t.is_meta:
        check_tensor(name, t)  # raises, naming what is wrong
    if t.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name}: expected dtype bfloat16, float16 or float32, got {t.dtype}")
    allowed = (2, 3) if ndim is None else (ndim,)
    if t.dim() not in allowed:
        want = " or ".join(f"{d}-D" for d in allowed)
        raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(t.shape)}")
    return t


def check_same_device(named: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(f"{name}: expected device {first.device} (as {first_name}), got {t.device}")
    return first.device


def check_out(
    name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A caller-provided output buffer: a dense tensor of exact shape, dtype and device (that of
    the already-checked inputs, so never meta), writable outside autograd, no self-overlap.

    On the hot path (host time per call counts): a contiguous output costs a few attribute
    reads; the layout and strides that may alias are examined only when the tensor is not
    contiguous (a sparse tensor never is, or raises when asked). A tensor without storage that
    calls itself contiguous (mkldnn) is refused by ``check_no_overlap``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.shape != shape:
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.device != device:
        check_tensor(name, t)  # a meta tensor is named as such
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if t.requires_grad:
        raise ValueError(
            f"{name}: expected a tensor that does not require grad (it is written outside autograd), "
            f"got requires_grad=True; pass {name}.detach()"
        )
    if t.is_inference() and not torch.is_inference_mode_enabled():
        # torch refuses in-place writes to these outside inference mode ("Inplace update to
        # inference tensor outside InferenceMode is not allowed"), the copies of the reference
        # backend and of the layer converter included; the kernels would write it regardless.
        raise ValueError(
            f"{name}: expected a tensor writable outside inference mode, got an inference tensor "
            "(allocated under torch.inference_mode()); allocate it outside inference mode or make "
            "this call under torch.inference_mode()"
        )
    try:
        dense = t.is_contiguous()  # a contiguous tensor has no two elements at one address
    except RuntimeError:  # sparse compressed layouts do not answer
        dense = False
    if not dense:
        check_tensor(name, t)
        check_no_self_overlap(name, t)
    return t


def check_no_self_overlap(name: str, t: torch.Tensor) -> None:
    """Refuse strides under which two elements may share memory. Conservative: the dimensions of
    size > 1, by increasing stride, must each step past everything the smaller ones span
    (stride >= 1 + sum of (size - 1) * stride before it). That holds for every permutation of
    a contiguous tensor and every slice of one; an interleaving such as shape (3, 2) with
    strides (2, 3) never collides, yet is refused. Strides are never negative in torch."""
    if t.numel() == 0:
        return  # nothing is written
    dims = sorted((stride, size, d) for d, (size, stride) in enumerate(zip(t.shape, t.stride())) if size > 1)
    span = 1  # elements covered by the dimensions taken so far
    for stride, size, d in dims:
        if stride == 0:
            raise ValueError(
                f"{name}: dimension {d} has stride 0 (a broadcast view); expected an output whose "
                "elements do not alias one another"
            )
        if stride < span:
            raise ValueError(
                f"{name}: expected an output whose elements cannot overlap, got shape "
                f"{tuple(t.shape)} with strides {t.stride()}: dimension {d} steps {stride} elements, "
                f"inside the {span} that the dimensions of smaller stride span; pass a buffer "
                "that does not alias itself"
            )
        span += (size - 1) * stride


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """Half-open address range [lo, hi) of the bytes a strided tensor can touch."""
    nbytes = t.nbytes
    if nbytes == 0:
        return (0, 0)
    lo = hi = t.data_ptr()
    if t.is_contiguous():
        return (lo, lo + nbytes)
    item = t.element_size()
    for size, stride in zip(t.shape, t.stride()):
        reach = (size - 1) * stride * item
        if reach < 0:
            lo += reach
        else:
            hi += reach
    return (lo, hi + item)


def check_no_overlap(
    outs: Sequence[tuple[str, torch.Tensor]], ins: Sequence[tuple[str, torch.Tensor]]
) -> None:
    """Outputs must not share bytes with inputs or with each other (conservative: address spans)."""
    try:
        spans = [(n, byte_span(t)) for n, t in outs]
        others = spans + [(n, byte_span(t)) for n, t in ins]
    except RuntimeError:  # a tensor without storage has no address
        for n, t in (*outs, *ins):
            check_tensor(n, t)
        raise
    for i, (name, (lo, hi)) in enumerate(spans):
        if lo == hi:
            continue
        for other, (olo, ohi) in others[i + 1 :]:
            if olo < hi and lo < ohi:
                raise ValueError(f"{name}: overlaps {other} in memory; pass a separate buffer")


BUFFER_ALIGN = 16  # bytes: a multiple of every element size, and one vector access


def check_aligned(name: str, t: torch.Tensor, align: int, why: str) -> None:
    """``t`` starts at a multiple of ``align`` bytes, in memory and within its storage (which
    ``.view(dtype)`` checks: a storage that itself starts unaligned can fail one and pass the
    other)."""
    address = t.data_ptr()
    if address % align:
        raise ValueError(
            f"{name}: expected a buffer aligned to {align} bytes ({why}), got address {address:#x} "
            f"% {align} = {address % align}"
        )
    offset = t.storage_offset() * t.element_size()
    if offset % align:
        raise ValueError(
            f"{name}: expected a buffer aligned to {align} bytes within its storage ({why}), got "
            f"byte offset {offset} from a storage at {address - offset:#x}"
        )


# A week: longer than any link or rendezvous wait, and well inside what ``datetime.timedelta`` and
# the stores' millisecond timeouts hold (inf or 1e300 seconds would overflow them in C++).
MAX_SECONDS = 7 * 24 * 3600.0


def check_seconds(name: str, value: object, hi: float = MAX_SECONDS) -> float:
    """``value`` as a duration in seconds: a real number (int or float; not a bool, a string or
    NaN) in ``(0, hi]``, else a ValueError naming ``name``."""
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"{name}: expected seconds (a number in (0, {hi:g}]), got {value!r} ({type(value).__name__})"
        )
    if not (math.isfinite(value) and 0 < value <= hi):
        raise ValueError(f"{name}: expected seconds in (0, {hi:g}], got {value!r}")
    return float(value)
