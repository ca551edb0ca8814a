"""The constants of the block-FP8 contract (docs/numerics.md), in one place for every path:
the reference, the Triton and CUDA kernels' launchers, the argument checks and the plans."""

from __future__ import annotations

import torch

BLOCK = 128  # docs/numerics.md#blocks: 128 x 128 tiles anchored at (0, 0)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# fl32(1/448) and fl32(1e-12) as bit patterns, so no path can round them differently
# (docs/numerics.md#scale).
INV_FP8_MAX_BITS = 0x3B124925
SCALE_FLOOR_BITS = 0x2B8CBCCC
MAX_SOURCES = 4  # row sources one call concatenates (w13 = [w1; w3] is two); both kernels' limit
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def ceil_blocks(n: int) -> int:
    """Number of 128-wide blocks covering ``n`` rows or columns (partial block included)."""
    return -(-n // BLOCK)


def blocks_shape(rows: int, cols: int, experts: int | None = None) -> tuple[int, ...]:
    """Shape of the float32 block scales of a [(E,) rows, cols] matrix."""
    nb = (ceil_blocks(rows), ceil_blocks(cols))
    return nb if experts is None else (experts, *nb)


__all__ = [
    "BLOCK",
    "FP8_MAX",
    "INPUT_DTYPES",
    "INV_FP8_MAX_BITS",
    "MAX_SOURCES",
    "SCALE_FLOOR_BITS",
    "blocks_shape",
    "ceil_blocks",
]
