"""A delta segment on the wire (docs/delta.md#in-the-transfer): the changes of
a segment's pieces as two messages, so that a receiver knows every length before it reads a byte.

1. The **counts**, int32, a size both ends know from the plan: per piece, one count per 128x128
   block (``BlockDelta.counts``), then its number of changed scales.
2. The **payload**, uint8, whose size both ends derive from the counts alone: per piece its
   offsets (int16), values (uint8), changed scales' flat indices (int32) and values (float32),
   each at a multiple of 16 bytes (a view of any of them is aligned for its dtype and for vector
   loads).

``payload_layout`` checks the counts before anything is read or allocated from them: each block's
count is within its valid positions, each piece's scale count within its blocks. The payload is
then at most the dense piece plus 16 bytes of padding per field and 4 bytes per block and per
changed scale (``payload_bound``): a receiver sizes its buffer once, from the plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from glm_fp8.core.numerics import blocks_shape
from glm_fp8.kernels import triton_delta
from glm_fp8.kernels.backends import resolve_backend
from glm_fp8.kernels.checksum import checksum_torch
from glm_fp8.kernels.delta import BlockDelta, compare_bytes
from glm_fp8.kernels.reference import delta_block_sizes
from glm_fp8.model.layer_plan import align

ALIGN = 16  # bytes: where each field of the payload starts
_FIELDS = (
    ("positions", torch.int16),
    ("values", torch.uint8),
    ("scale_index", torch.int32),
    ("scale_values", torch.float32),
)


@dataclass(frozen=True)
class DeltaPiece:
    """One piece of a delta segment: its shape ``[(E,) R, C]`` (fp8 elements, or bytes for a
    passthrough piece) and whether it has scales (quantized) or not (passthrough bytes)."""

    shape: tuple[int, ...]
    scaled: bool = True

    @property
    def blocks(self) -> int:
        return math.prod(blocks_shape(self.shape[-2], self.shape[-1], *self.shape[:-2]))

    @property
    def dense_nbytes(self) -> int:
        return math.prod(self.shape) + (4 * self.blocks if self.scaled else 0)


def counts_numel(pieces: Sequence[DeltaPiece]) -> int:
    """int32 words of a segment's counts message."""
    return sum(p.blocks + 1 for p in pieces)


def payload_bound(pieces: Sequence[DeltaPiece]) -> int:
    """The largest payload any valid counts can call for: a receiver's buffer for the segment.
    A block's offsets and values together never exceed its positions (3 bytes a change only while
    ``3 n <= v``, else its ``v`` bytes), and a piece changes at most one scale per block."""
    scales = lambda p: 2 * align(4 * p.blocks, ALIGN) if p.scaled else 0  # noqa: E731 - index, value
    return sum(align(math.prod(p.shape), ALIGN) + ALIGN + scales(p) for p in pieces)


@dataclass(frozen=True)
class PieceLayout:
    """Where one piece's fields lie in the payload: (offset, count) per field of ``_FIELDS``."""

    counts: torch.Tensor
    fields: tuple[tuple[int, int], ...]


def payload_layout(
    counts: torch.Tensor, pieces: Sequence[DeltaPiece], host: torch.Tensor | None = None
) -> tuple[list[PieceLayout], int]:
    """Check a received counts message against the segment's ``pieces`` and lay out its payload:
    the pieces' layouts and the payload's bytes. One host read, none when ``host`` holds the
    counts already read (a receiver reads a layer's counts messages at once). Raises ValueError
    naming the piece and what is wrong before anything is allocated or read from the counts."""
    want = counts_numel(pieces)
    if counts.dtype != torch.int32 or counts.dim() != 1 or counts.numel() != want:
        raise ValueError(
            f"counts: expected int32 [{want}] (one per block of each piece, then its changed scales), got "
            f"{counts.dtype} {list(counts.shape)}"
        )
    per_block = [delta_block_sizes(p.shape) for p in pieces]  # valid positions of each block
    scales = [torch.tensor([p.blocks if p.scaled else 0]) for p in pieces]
    parts = [t for v, sc in zip(per_block, scales) for t in (v, sc)]
    sizes = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    host = (counts if host is None else host).long().cpu()
    bad = ((host < 0) | (host > sizes)).nonzero()
    if len(bad):
        k, at = _piece_of(int(bad[0]), pieces)
        what = "changed scales" if at == pieces[k].blocks else f"changes in block {at}"
        raise ValueError(
            f"counts: piece {k} ({list(pieces[k].shape)}) has {int(host[bad[0]])} {what}, expected 0 to "
            f"{int(sizes[bad[0]])}; the counts do not belong to this segment"
        )
    layouts, off, start = [], 0, 0
    for p, v in zip(pieces, per_block):
        c = host[start : start + p.blocks]
        dense = 3 * c > v
        n_pos = int(torch.where(dense, 0, c).sum())
        n_val = int(torch.where(dense, v, c).sum())
        n_sc = int(host[start + p.blocks])
        fields = []
        for n, (_, dtype) in zip((n_pos, n_val, n_sc, n_sc), _FIELDS):
            fields.append((off, n))
            off += align(n * dtype.itemsize, ALIGN)
        layouts.append(PieceLayout(counts[start : start + p.blocks], tuple(fields)))
        start += p.blocks + 1
    return layouts, off


def _piece_of(i: int, pieces: Sequence[DeltaPiece]) -> tuple[int, int]:
    for k, p in enumerate(pieces):
        if i <= p.blocks:
            return k, i
        i -= p.blocks + 1
    raise IndexError(i)  # pragma: no cover


def pack_delta(
    deltas: Sequence[BlockDelta],
    pieces: Sequence[DeltaPiece],
    counts_out: torch.Tensor,
    payload_out: torch.Tensor,
) -> int:
    """Write the deltas of a segment's pieces into ``counts_out`` (int32 [counts_numel]) and
    ``payload_out`` (uint8, at least ``payload_bound`` bytes); return the payload's bytes."""
    if len(deltas) != len(pieces):
        raise ValueError(f"deltas: expected {len(pieces)} (one per piece), got {len(deltas)}")
    start = 0
    for k, (d, p) in enumerate(zip(deltas, pieces)):
        if tuple(d.shape) != tuple(p.shape) or (d.scale_index.numel() and not p.scaled):
            raise ValueError(f"deltas[{k}]: a delta of {list(d.shape)}, expected piece {list(p.shape)}")
        counts_out[start : start + p.blocks].copy_(d.counts)
        counts_out[start + p.blocks] = d.scale_index.numel()
        start += p.blocks + 1
    layouts, total = payload_layout(counts_out, pieces)
    if payload_out.numel() < total:
        raise ValueError(f"payload_out: expected at least {total} bytes, got {payload_out.numel()}")
    for d, lay in zip(deltas, layouts):
        for (off, n), (field, dtype) in zip(lay.fields, _FIELDS):
            payload_out[off : off + n * dtype.itemsize].view(dtype).copy_(getattr(d, field))
    return total


def pack_bytes_delta(
    news: Sequence[torch.Tensor],
    kepts: Sequence[torch.Tensor],
    pieces: Sequence[DeltaPiece],
    msg: torch.Tensor,
    length: torch.Tensor,
    payload: torch.Tensor,
    backend: str | None = None,
    checksum: torch.Tensor | None = None,
) -> None:
    """The delta of a segment's unscaled pieces, ``news`` against ``kepts`` (uint8, each its piece's
    shape; ``kepts`` moved to ``news``), written as ``pack_delta`` writes it: the counts into
    ``msg`` (int32 [counts_numel]), the payload into ``payload`` (uint8, ``payload_bound`` bytes),
    its byte count into ``length`` (int64 [1]). ``checksum`` (int64 [1], optional): the
    ``glm_fp8.transfer.wire.message_checksum`` of the new pieces' bytes one after another (a
    segment's data bytes), taken by the comparison as it reads them; it needs whole 8-byte words.

    With the Triton kernels (CUDA), nothing is read back to the host: offsets and the length are
    computed on the device, so that a sender queues a whole layer's comparison behind its
    conversion and reads its lengths once. A piece whose bytes lie in block order (``words_fit``:
    the segments' pieces) is compared 8 bytes a lane. Allocates per piece a 2 KiB bitmap and three
    int64 per block (two offsets, a checksum part;
    ``glm_fp8.planning.update_delta.COMPARE_SCRATCH_PER_BLOCK``), and two int64 totals per 1,024
    blocks."""
    if len(news) != len(pieces) or len(kepts) != len(pieces) or any(p.scaled for p in pieces):
        raise ValueError(f"pieces: expected {len(pieces)} unscaled pieces, one per new and kept tensor")
    firsts = [0]
    for new in news:
        firsts.append(firsts[-1] + new.numel())
    if checksum is not None and any(f % 8 for f in firsts):
        raise ValueError(
            f"news: a checksum needs pieces of whole 8-byte words, got {firsts[1:]} bytes in all"
        )
    if resolve_backend(backend, payload.device, delta=True) != "triton":
        if checksum is not None:
            terms = [
                checksum_torch(new.reshape(-1).view(torch.int64), f // 8) for new, f in zip(news, firsts)
            ]
            checksum.copy_(torch.stack(terms).sum() if terms else torch.zeros((), dtype=torch.int64))
        deltas = [compare_bytes(a, b, backend="torch") for a, b in zip(news, kepts)]
        length.fill_(pack_delta(deltas, pieces, msg, payload))
        return
    words = [triton_delta.words_fit(new, kept) for new, kept in zip(news, kepts)]
    if checksum is not None and not all(words):
        bad = news[words.index(False)]
        raise ValueError(
            f"news: a checksum needs pieces whose bytes lie in block order at 8-byte addresses, "
            f"got {list(bad.shape)} with strides {list(bad.stride())}"
        )
    msg.zero_()  # every piece's count of changed scales stays 0
    length.zero_()
    if checksum is not None:
        checksum.zero_()
    start = 0
    positions = payload[: payload.numel() // 2 * 2].view(torch.int16)
    for new, kept, p, first, word in zip(news, kepts, pieces, firsts, words):
        shape = (1, *p.shape) if len(p.shape) == 2 else tuple(p.shape)
        counts = msg[start : start + p.blocks]
        start += p.blocks + 1
        bits = torch.empty(p.blocks * triton_delta.BITMAP_WORDS, dtype=torch.int16, device=payload.device)
        scratch = torch.empty(3, p.blocks, dtype=torch.int64, device=payload.device)
        if word:
            triton_delta.launch_compare_words(new, kept, bits, counts, scratch[2], first // 8)
            if checksum is not None:
                checksum.add_(scratch[2].sum())
        else:
            triton_delta.launch_compare_bytes(new.view(shape), kept.view(shape), bits, counts)
        triton_delta.launch_offsets(shape, counts, scratch[0], scratch[1], length, ALIGN)
        wire = triton_delta.Wire(counts, scratch[0], scratch[1], positions, payload)
        # The changed blocks' bytes from ``new`` (the kept copy holds the same bytes now): a kept
        # copy in host memory (``device_alias``) is then read once over PCIe, by the comparison.
        triton_delta.launch_pack(new.view(shape), bits, wire)


def unpack_delta(
    counts: torch.Tensor,
    payload: torch.Tensor,
    pieces: Sequence[DeltaPiece],
    layout: tuple[list[PieceLayout], int] | None = None,
) -> list[BlockDelta]:
    """The pieces' deltas as views of ``payload`` (no copy), after ``payload_layout``'s checks (or
    its result ``layout``, when the caller has it already) and a check that the payload holds what
    the counts call for."""
    layouts, total = payload_layout(counts, pieces) if layout is None else layout
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() < total:
        raise ValueError(
            f"payload: expected uint8 of at least {total} bytes (what the counts call for), got "
            f"{payload.dtype} {list(payload.shape)}"
        )
    out = []
    for p, lay in zip(pieces, layouts):
        views = [
            payload[off : off + n * dtype.itemsize].view(dtype)
            for (off, n), (_, dtype) in zip(lay.fields, _FIELDS)
        ]
        out.append(BlockDelta(tuple(p.shape), lay.counts, *views))
    return out


__all__ = [
    "ALIGN",
    "DeltaPiece",
    "PieceLayout",
    "counts_numel",
    "pack_bytes_delta",
    "pack_delta",
    "payload_bound",
    "payload_layout",
    "unpack_delta",
]
