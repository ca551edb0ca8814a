"""Bit-exact FP8 delta updates (docs/delta.md): send only the bytes and scales that changed.

- ``quantize_compare`` (sender): quantize an entry's new trainer tensors (the sources contract of
  ``quantize_blockwise``), compare with the kept copy of what the engine holds, return the
  changes as a ``BlockDelta`` and bring the kept copy up to date. One pass over the new weights.
- ``apply_delta`` (engine): write a ``BlockDelta`` into the fp8 parameter and its scales in place.
- ``compare_bytes`` (bytes already converted): the same encoding over two byte buffers.
- ``glm_fp8.kernels.delta_cut.cut_delta``: an entry's delta cut to an engine rank's block-aligned shard.

After ``d = quantize_compare(new, kept_q, kept_s)`` and ``apply_delta(d, engine_q, engine_s)`` on
an engine that held ``kept_q``/``kept_s``, both hold exactly ``quantize_blockwise(new)``.
Backends: "triton" (CUDA, or the CPU under ``TRITON_INTERPRET=1``) and "torch" (the reference
of ``glm_fp8.kernels.reference``: ``delta_encode_ref`` / ``delta_apply_ref``); "auto"/None picks triton
where it runs. Both give the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from glm_fp8.core import checks
from glm_fp8.core.errors import NonFiniteError
from glm_fp8.core.numerics import BLOCK, blocks_shape, ceil_blocks
from glm_fp8.kernels import triton_delta
from glm_fp8.kernels.backends import resolve_backend
from glm_fp8.kernels.jobs import as3d, check_finite_tensors, nonfinite_flag, plan_job
from glm_fp8.kernels.reference import (
    delta_apply_ref,
    delta_block_sizes,
    delta_encode_ref,
    quantize_concat_ref,
)

_empty = torch.empty  # every buffer the kernels fill (tests poison it to catch unwritten bytes)


@dataclass(frozen=True)
class BlockDelta:
    """The changes of one quantized entry [(E,) R, C] (docs/delta.md#encoding).

    counts int32 [blocks]: changed fp8 bytes per 128x128 block, blocks in (expert, row block,
    column block) order. A block with ``3 * count > valid positions`` is dense (all its bytes are
    sent, row-major over its valid rows and columns), every other block sparse.
    positions int16 [P]: the sparse blocks' in-block offsets ``r * 128 + c``, ascending per block.
    values uint8 [V]: the new bytes, block by block (a sparse block's changes, a dense block whole).
    scale_index int32 [S], scale_values float32 [S]: changed scales (flat block index, new value).
    """

    shape: tuple[int, ...]
    counts: torch.Tensor
    positions: torch.Tensor
    values: torch.Tensor
    scale_index: torch.Tensor
    scale_values: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.counts, self.positions, self.values, self.scale_index, self.scale_values

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the five tensors as they are."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def dense_nbytes(self) -> int:
        """Bytes of a dense update of the same entry: fp8 bytes plus float32 scales."""
        return math.prod(self.shape) + 4 * self.counts.numel()

    @property
    def changed(self) -> int:
        """Changed fp8 bytes (a host read)."""
        return int(self.counts.sum())


def block_offsets(
    counts: torch.Tensor, sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exclusive prefix sums of the wire's positions and values per block, and their two totals
    (int64 [2], on the device)."""
    counts = counts.long()
    dense = 3 * counts > sizes
    pos = torch.where(dense, 0, counts)
    val = torch.where(dense, sizes, counts)
    pos_end, val_end = pos.cumsum(0), val.cumsum(0)
    totals = torch.stack([pos_end[-1], val_end[-1]]) if len(counts) else counts.new_zeros(2)
    return pos_end - pos, val_end - val, totals


def _pack(
    q3: torch.Tensor,
    bits: torch.Tensor,
    counts: torch.Tensor,
    pos_off: torch.Tensor,
    val_off: torch.Tensor,
    host: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The wire's positions and values (``host``: their totals, read) of the blocks a compare
    kernel left in ``q3`` (updated) with their ``bits`` and ``counts``."""
    positions = _empty(host[0], dtype=torch.int16, device=q3.device)
    values = _empty(host[1], dtype=torch.uint8, device=q3.device)
    triton_delta.launch_pack(q3, bits, triton_delta.Wire(counts, pos_off, val_off, positions, values))
    return positions, values


def quantize_compare(
    sources: torch.Tensor | Sequence[torch.Tensor],
    kept: torch.Tensor,
    kept_scale: torch.Tensor,
    *,
    scale_fmt: str = "fp32",
    check_finite: bool = True,
    backend: str | None = None,
) -> BlockDelta:
    """Quantize ``torch.cat(sources, dim=-2)`` (bit-identical to ``quantize_blockwise``), return
    what differs from ``kept`` / ``kept_scale`` and write the new bytes and scales into them.

    Args:
        sources: one tensor or up to four, 2-D [R_k, C] or 3-D [E, R_k, C], one dtype (bf16,
            fp16, fp32) and device, any strides (``quantize_blockwise``'s contract).
        kept: float8_e4m3fn [(E,) R, C], what the engine holds (any strides); updated in place.
        kept_scale: float32 [(E,) ceil(R/128), ceil(C/128)] (any strides); updated in place.
        scale_fmt: "fp32" or "ue8m0", as the engine's scales were made.
        check_finite: raise ``NonFiniteError`` for NaN/Inf in the sources. With the triton
            backend the kept copy then holds the new bytes of every finite block: it no longer
            matches the engine, send the entry dense. The torch backend writes nothing then.

    Allocates (triton): a bitmap of 2 KiB, an int32, an int8 and two int64 per block, then the
    delta's tensors at their exact sizes; one host read (the sizes and the finite flag).
    Arguments are checked before anything is written.
    """
    checks.check_scale_fmt(scale_fmt)
    named = checks.named_sources(sources)
    if not isinstance(kept, torch.Tensor) or not isinstance(kept_scale, torch.Tensor):
        bad = "kept" if not isinstance(kept, torch.Tensor) else "kept_scale"
        raise TypeError(f"{bad}: expected a torch.Tensor (the kept copy of the engine's entry)")
    job = plan_job(named, kept, kept_scale, "kept", "kept_scale")
    checks.check_no_overlap([("kept", kept), ("kept_scale", kept_scale)], named)
    device = kept.device
    if resolve_backend(backend, device, delta=True) == "torch":
        q, s = quantize_concat_ref([t for _, t in named], scale_fmt)
        if check_finite and not bool(torch.isfinite(s).all()):
            check_finite_tensors(named)
        delta = BlockDelta(tuple(kept.shape), *delta_encode_ref(kept, kept_scale, q, s))
        kept.copy_(q)
        kept_scale.copy_(s)
        return delta
    q3, s3 = as3d(kept), as3d(kept_scale)
    n = s3.numel()
    bits = _empty(n * triton_delta.BITMAP_WORDS, dtype=torch.int16, device=device)
    counts = _empty(n, dtype=torch.int32, device=device)
    scale_changed = _empty(n, dtype=torch.int8, device=device)
    flag = nonfinite_flag(device) if check_finite else None
    sources3 = [as3d(t) for _, t in job.named_sources]
    try:
        triton_delta.launch_compare(sources3, q3, s3, bits, counts, scale_changed, scale_fmt == "ue8m0", flag)
        pos_off, val_off, totals = block_offsets(counts, delta_block_sizes(q3.shape, device))
        totals = torch.cat(
            [totals, scale_changed.long().sum().view(1), (flag if flag is not None else counts[:0]).long()]
        )
        host = totals.tolist()  # the one host read
    except BaseException:
        if flag is not None:
            flag.zero_()
        raise
    if flag is not None and host[3]:
        flag.zero_()
        check_finite_tensors(named)
        raise NonFiniteError(  # pragma: no cover
            "sources: a block's scale is not finite", source="sources", expert=None, block=None
        )
    positions, values = _pack(q3, bits, counts, pos_off, val_off, host)
    scale_index = torch.nonzero_static(scale_changed, size=host[2])[:, 0].to(torch.int32)
    scale_values = s3.reshape(-1)[scale_index.long()]
    return BlockDelta(tuple(kept.shape), counts, positions, values, scale_index, scale_values)


def check_delta(
    delta: BlockDelta,
    q: torch.Tensor,
    scale: torch.Tensor | None,
    name: str = "q",
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check ``delta`` against the tensors it will be written into; return the offsets
    ``(pos_offsets, val_offsets)``. One host read. Raises naming the tensor at fault. Allocates a
    few integers per block and, with the torch backend, several int64 per position."""
    if not isinstance(delta, BlockDelta):
        raise TypeError(f"delta: expected a BlockDelta, got {type(delta).__name__}")
    checks.check_out(name, q, torch.Size(delta.shape), torch.float8_e4m3fn, q.device)
    e, r, c = as3d(q).shape
    sb = blocks_shape(r, c, e if q.dim() == 3 else None)
    if scale is not None:
        checks.check_out("scale", scale, torch.Size(sb), torch.float32, q.device)
    nb = math.prod(sb)
    want = {
        "counts": ((nb,), torch.int32),
        "positions": (None, torch.int16),
        "values": (None, torch.uint8),
        "scale_index": (None, torch.int32),
        "scale_values": (None, torch.float32),
    }
    for field, (shape, dtype) in want.items():
        t = getattr(delta, field)
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != dtype or t.device != q.device:
            got = (
                f"{tuple(t.shape)} {t.dtype} on {t.device}"
                if isinstance(t, torch.Tensor)
                else type(t).__name__
            )
            raise ValueError(f"delta.{field}: expected a 1-D {dtype} tensor on {q.device}, got {got}")
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(
                f"delta.{field}: expected shape {shape} (one per block of {name}), got {tuple(t.shape)}"
            )
    if scale is None and delta.scale_index.numel():
        raise ValueError(f"scale: the delta changes {delta.scale_index.numel()} scales, got scale=None")
    outs = [(name, q)] + ([] if scale is None else [("scale", scale)])
    fields = ("counts", "positions", "values", "scale_index", "scale_values")
    checks.check_no_overlap(outs, [(f"delta.{f}", t) for f, t in zip(fields, delta.tensors())])
    if delta.scale_index.numel() != delta.scale_values.numel():
        raise ValueError(
            f"delta.scale_values: expected {delta.scale_index.numel()} values (one per "
            f"scale_index), got {delta.scale_values.numel()}"
        )
    sizes = delta_block_sizes(delta.shape, q.device)
    counts = delta.counts.long()
    pos_off, val_off, totals = block_offsets(counts, sizes)
    # Every position must land inside its own block's valid rows and columns (meaningful only once
    # the counts call for exactly these positions: checked first below).
    if (
        resolve_backend(backend, q.device, delta=True) == "triton"
    ):  # a count per block: no temporary per position
        bad = torch.zeros(nb, dtype=torch.int32, device=q.device)
        triton_delta.launch_check(as3d(q), delta.counts, pos_off, delta.positions, bad)
        bad_pos = bad.any()
    else:
        sparse = (3 * counts <= sizes) & (counts > 0)
        # The block each position belongs to: the first whose run of positions ends past it (one
        # search, no host read: repeat_interleave would read its output size back).
        ends = pos_off + torch.where(sparse, counts, 0)
        owner = torch.searchsorted(ends, torch.arange(delta.positions.numel(), device=q.device), right=True)
        n_rb, n_cb = max(1, sb[-2]), max(1, sb[-1])
        rows = (r - owner // n_cb % n_rb * BLOCK).clamp(max=BLOCK)
        cols = (c - owner % n_cb * BLOCK).clamp(max=BLOCK)
        pos = delta.positions.long()
        bad_pos = ((pos < 0) | (pos // BLOCK >= rows) | (pos % BLOCK >= cols)).any()
    idx = delta.scale_index
    stats = torch.stack([*totals, (counts < 0).any(), ((idx < 0) | (idx >= nb)).any(), bad_pos])
    host = stats.long().tolist()
    if host[2]:
        raise ValueError(f"delta.counts: expected counts >= 0 for every block of {name}")
    if host[0] != delta.positions.numel() or host[1] != delta.values.numel():
        raise ValueError(
            f"delta: the counts of {name}'s blocks call for {host[0]} positions and {host[1]} values, got "
            f"{delta.positions.numel()} and {delta.values.numel()}; the delta does not belong to this entry"
        )
    if host[3]:
        raise ValueError(f"delta.scale_index: expected flat indices in [0, {nb}) of {name}'s scales")
    if host[4]:
        raise ValueError(
            f"delta.positions: an offset falls outside its block's valid rows and columns of {name}"
        )
    return pos_off, val_off


def apply_delta(
    delta: BlockDelta, q: torch.Tensor, scale: torch.Tensor | None, *, backend: str | None = None
) -> None:
    """Write ``delta`` into the engine's fp8 tensor ``q`` [(E,) R, C] and float32 ``scale``
    [(E,) Rb, Cb] in place (any strides: a row slice of a parameter is fine). Everything is
    checked first (one host read); then only the changed bytes and scales are written.
    Allocates two int64 and an int32 per block (the offsets, the offset check's counts) and, for
    the torch backend, several int64 per position and a copy of q."""
    if not isinstance(q, torch.Tensor) or not (scale is None or isinstance(scale, torch.Tensor)):
        raise TypeError("q, scale: expected the engine's fp8 tensor and its float32 scales (or None)")
    backend = resolve_backend(backend, q.device, delta=True)
    pos_off, val_off = check_delta(delta, q, scale, backend=backend)
    if backend == "torch":
        no_scale = torch.zeros(delta.counts.shape, device=q.device) if scale is None else scale
        new_q, new_s = delta_apply_ref(q, no_scale, *delta.tensors())
        q.copy_(new_q)
        if scale is not None:
            scale.copy_(new_s.view(scale.shape))
        return
    wire = triton_delta.Wire(delta.counts, pos_off, val_off, delta.positions, delta.values)
    triton_delta.launch_apply(as3d(q), wire)
    if delta.scale_index.numel():
        s3 = as3d(scale)
        idx = delta.scale_index.long()
        nrb, ncb = s3.shape[1], s3.shape[2]
        s3[idx // (nrb * ncb), idx // ncb % nrb, idx % ncb] = delta.scale_values


def compare_bytes(new: torch.Tensor, kept: torch.Tensor, *, backend: str | None = None) -> BlockDelta:
    """Bytes already converted (a transfer segment, a passthrough entry): ``new`` against ``kept``
    (same shape and dtype, any dtype), as a BlockDelta over their uint8 bytes [rows, row bytes]
    (no scales); ``kept`` is moved to ``new``. Allocates (triton) a 2 KiB bitmap, an int32 and two
    int64 per block, then the delta; one host read. Tensors that are not contiguous take the torch
    reference, which allocates several copies."""
    for name, t in (("new", new), ("kept", kept)):
        checks.check_tensor(name, t)
    if new.shape != kept.shape or new.dtype != kept.dtype or new.device != kept.device:
        raise ValueError(
            f"kept: expected {tuple(new.shape)} {new.dtype} on {new.device} (as new), got "
            f"{tuple(kept.shape)} {kept.dtype} on {kept.device}"
        )
    rows = new.shape[0] if new.dim() > 1 else 1
    cols = math.prod(new.shape[1:] if new.dim() > 1 else new.shape) * new.element_size()  # bytes a row

    def byte_rows(t: torch.Tensor) -> torch.Tensor:
        # Flat first, with an explicit unit stride: torch calls a tensor with size-1 dims contiguous
        # whatever their strides, and keeps such a stride through reshape (a [1, 1] view with
        # strides (2, 2) flattens to stride 2), which a byte view refuses. A contiguous tensor's
        # elements lie densely from its offset, so this is a view of ``t`` itself when it is one.
        c = t.contiguous()
        return c.as_strided((c.numel(),), (1,), c.storage_offset()).view(torch.uint8).reshape(rows, cols)

    device = new.device
    if (
        resolve_backend(backend, device, delta=True) == "triton"
        and new.is_contiguous()
        and kept.is_contiguous()
    ):
        nb, kb = byte_rows(new).unsqueeze(0), byte_rows(kept).unsqueeze(0)
        n = ceil_blocks(nb.shape[1]) * ceil_blocks(nb.shape[2])
        bits = _empty(n * triton_delta.BITMAP_WORDS, dtype=torch.int16, device=device)
        counts = _empty(n, dtype=torch.int32, device=device)
        triton_delta.launch_compare_bytes(nb, kb, bits, counts)
        pos_off, val_off, totals = block_offsets(counts, delta_block_sizes(nb.shape[1:], device))
        positions, values = _pack(
            kb.view(torch.float8_e4m3fn), bits, counts, pos_off, val_off, totals.tolist()
        )
        empty = torch.empty(0, dtype=torch.int32, device=device)
        return BlockDelta(tuple(nb.shape[1:]), counts, positions, values, empty, empty.float())
    nb, kb = byte_rows(new), byte_rows(kept)
    as_fp8 = (nb.view(torch.float8_e4m3fn), kb.view(torch.float8_e4m3fn))
    no_scale = torch.zeros(blocks_shape(*nb.shape), device=device)
    counts, positions, values, _, _ = delta_encode_ref(as_fp8[1], no_scale, as_fp8[0], no_scale)
    kept.copy_(new)
    empty = torch.empty(0, dtype=torch.int32, device=device)
    return BlockDelta(tuple(nb.shape), counts, positions, values, empty, empty.float())


__all__ = [
    "block_offsets",
    "BlockDelta",
    "apply_delta",
    "check_delta",
    "compare_bytes",
    "quantize_compare",
]
