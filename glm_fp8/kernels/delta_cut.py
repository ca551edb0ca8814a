"""A delta cut to a block-aligned part of its entry (docs/delta.md#kernels): ``cut_delta``, for an
engine rank whose shard of a block-FP8 entry is whole 128x128 blocks (or whole experts), so that
the sender compares each entry once and cuts its delta per shard."""

from __future__ import annotations

import functools

import torch

from glm_fp8.core import checks
from glm_fp8.core.numerics import BLOCK, ceil_blocks
from glm_fp8.kernels.delta import BlockDelta, block_offsets
from glm_fp8.kernels.reference import delta_block_sizes


def _cut_range(name: str, cut: object, n: int, unit: str, align: int) -> tuple[int, int]:
    """``cut`` (start, stop) checked: ints, 0 <= start <= stop <= n; start a multiple of ``align``,
    stop too or ``n``. None: (0, n)."""
    if cut is None:
        return 0, n
    if not isinstance(cut, (tuple, list)) or len(cut) != 2:
        raise ValueError(f"{name}: expected None or (start, stop), got {cut!r}")
    start = checks.check_int(f"{name}[0]", cut[0], 0, n, f" (the entry has {n} {unit})")
    stop = checks.check_int(f"{name}[1]", cut[1], start, n, f" (the entry has {n} {unit})")
    if start % align or (stop % align and stop != n):
        raise ValueError(
            f"{name}: expected whole {align}x{align} blocks (start a multiple of {align}, stop a multiple "
            f"of {align} or {n}, the entry's end), got ({start}, {stop})"
        )
    return start, stop


def cut_delta(
    delta: BlockDelta,
    *,
    experts: tuple[int, int] | None = None,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> BlockDelta:
    """The delta of a block-aligned cut of ``delta``'s entry: applied to the engine's view of the
    cut, ``q[e0:e1, r0:r1, c0:c1]`` (2-D: ``q[r0:r1, c0:c1]``) with its scales ``s[e0:e1,
    r0 // 128 : ceil(r1 / 128), c0 // 128 : ceil(c1 / 128)]``, it writes exactly what ``delta``
    writes there; it equals, tensor for tensor, the delta of the two states' cut views.

    Args:
        experts: (e0, e1), a range of experts of a 3-D entry; None: all (the only choice for 2-D).
        rows, cols: (start, stop) in elements: start a multiple of 128, stop a multiple of 128 or
            the entry's end; None: all. The cut's blocks are whole blocks of the entry (its edge
            block too), so each keeps its count, its dense or sparse form and its offsets. A cut
            may be empty.

    Torch ops on the delta's device (the counts' prefix sums index the runs kept; no loop over
    blocks), one host read. Raises ValueError naming the argument for a cut out of range or not
    block-aligned, and for a delta whose tensors do not fit its shape.
    """
    if not isinstance(delta, BlockDelta):
        raise TypeError(f"delta: expected a BlockDelta, got {type(delta).__name__}")
    shape = tuple(delta.shape)
    if len(shape) == 2 and experts is not None:
        raise ValueError(f"experts: expected None for a 2-D entry {list(shape)}, got {experts!r}")
    e, r, c = shape if len(shape) == 3 else (1, *shape)
    e0, e1 = _cut_range("experts", experts, e, "experts", 1)
    r0, r1 = _cut_range("rows", rows, r, "rows", BLOCK)
    c0, c1 = _cut_range("cols", cols, c, "columns", BLOCK)
    n_rb, n_cb = ceil_blocks(r), ceil_blocks(c)
    sizes = delta_block_sizes(shape, delta.counts.device)
    if delta.counts.shape != sizes.shape:
        raise ValueError(
            f"delta.counts: expected {tuple(sizes.shape)}, one per block of {list(shape)}, "
            f"got {tuple(delta.counts.shape)}"
        )
    arange = functools.partial(torch.arange, device=sizes.device)
    b_r, b_c = (r0 // BLOCK, ceil_blocks(r1)), (c0 // BLOCK, ceil_blocks(c1))  # the cut's block ranges
    ids = ((arange(e0, e1)[:, None, None] * n_rb + arange(*b_r)[:, None]) * n_cb + arange(*b_c)).flatten()
    n = delta.counts.long()
    pos_off, val_off, totals = block_offsets(n, sizes)
    dense = 3 * n > sizes
    n_pos, n_val = torch.where(dense, 0, n)[ids], torch.where(dense, sizes, n)[ids]
    idx = delta.scale_index.long()
    ie, irb, icb = idx // max(1, n_rb * n_cb), idx // max(1, n_cb) % max(1, n_rb), idx % max(1, n_cb)
    keep = (ie >= e0) & (ie < e1) & (irb >= b_r[0]) & (irb < b_r[1]) & (icb >= b_c[0]) & (icb < b_c[1])
    bad = (n < 0).any() | (idx < 0).any() | (idx >= len(sizes)).any() | (len(idx) != len(delta.scale_values))
    host = torch.stack([n_pos.sum(), n_val.sum(), keep.sum(), *totals, bad.long()]).tolist()  # the host read
    if host[3:] != [delta.positions.numel(), delta.values.numel(), 0]:
        raise ValueError(
            f"delta: not a delta of a {list(shape)} entry (counts >= 0 calling for {host[3]} positions and "
            f"{host[4]} values, scale indices in [0, {len(sizes)}) one per scale value), got "
            f"{delta.positions.numel()} positions, {delta.values.numel()} values, {len(idx)} scale indices "
            f"and {len(delta.scale_values)} scale values"
        )
    kept = torch.nonzero_static(keep, size=host[2])[:, 0]
    nrb, ncb = b_r[1] - b_r[0], b_c[1] - b_c[0]
    index = ((ie[kept] - e0) * nrb + irb[kept] - b_r[0]) * ncb + icb[kept] - b_c[0]
    return BlockDelta(
        (r1 - r0, c1 - c0) if len(shape) == 2 else (e1 - e0, r1 - r0, c1 - c0),
        delta.counts[ids],
        delta.positions[_runs(pos_off[ids], n_pos, host[0])],
        delta.values[_runs(val_off[ids], n_val, host[1])],
        index.to(torch.int32),
        delta.scale_values[kept],
    )


def _runs(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Indices of the runs [starts[k], starts[k] + lengths[k]), in order; ``total``: their sum."""
    shift = torch.repeat_interleave(starts - (lengths.cumsum(0) - lengths), lengths, output_size=total)
    return torch.arange(total, device=starts.device) + shift


__all__ = ["cut_delta"]
