"""Argument contracts shared by the public entry points: every check runs before any launch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from glm_fp8.reference import INPUT_DTYPES, SCALE_FMTS, ceil_blocks


def check_scale_fmt(scale_fmt: str) -> None:
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt: expected one of {SCALE_FMTS}, got {scale_fmt!r}")


def check_input(name: str, t: object, ndim: int | None = None) -> torch.Tensor:
    """A readable source tensor: floating dtype we quantize, 2-D or 3-D (or exactly ``ndim``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
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
    """A caller-provided output buffer: exact shape, dtype and device, no self-overlap."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.shape != shape:
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if not t.is_contiguous():  # a contiguous tensor has no broadcast (stride-0) dimension
        for d, (size, stride) in enumerate(zip(t.shape, t.stride())):
            if size > 1 and stride == 0:
                raise ValueError(f"{name}: dimension {d} has stride 0; outputs must not alias")
    return t


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
    spans = [(n, byte_span(t)) for n, t in outs]
    others = spans + [(n, byte_span(t)) for n, t in ins]
    for i, (name, (lo, hi)) in enumerate(spans):
        if lo == hi:
            continue
        for other, (olo, ohi) in others[i + 1 :]:
            if olo < hi and lo < ohi:
                raise ValueError(f"{name}: overlaps {other} in memory; pass a separate buffer")


def blocks_shape(rows: int, cols: int, experts: int | None) -> tuple[int, ...]:
    nb = (ceil_blocks(rows), ceil_blocks(cols))
    return nb if experts is None else (experts, *nb)
