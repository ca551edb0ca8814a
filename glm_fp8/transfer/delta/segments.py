"""What both ends of a delta update derive alike (docs/delta.md#in-the-transfer): a segment's data
bytes as delta pieces, the layout of its counts message, and which layers go as deltas.

**Segment coordinates.** A delta is taken of a segment's data bytes, exactly what the dense
segment carries without its checksum word (``Segment.source``: in the send buffer, or a direct
segment's in the conversion buffer), seen as uint8 ``[n // 128, 128]`` (a 128x128 block is 16
KiB of consecutive bytes), plus ``[1, n % 128]`` for a tail (none today: segments end at
multiples of 256 bytes).
The bytes between a segment's pieces are zero on both ends in a delta update (``zero_gaps``), so
that the receiver can rebuild the old segment from its parameters byte for byte.

**Counts message** of a segment (uint8, its size from the plan): the pieces' counts (int32,
``glm_fp8.transfer.delta.wire``), padded to 8 bytes, then two int64 words: the payload's bytes
as the sender computed them (a receiver whose counts fail their check still takes a payload of
that length when it is within the plan's bound, so the link stays in step and the vote refuses
the layer) and the new segment's checksum word (the dense segment's).

**Versions table.** Before the first layer every rank of the link contributes one row of an
int64 ``[link size, layers + 1]`` all-reduce MAX, ``NONE`` elsewhere: each sender its kept
versions (``NONE`` for every layer at a resync) and, in the last column, the update number it
proposes (the largest wins); each engine rank its held versions. A layer can go as a delta only
when every sender has a kept copy of it at one version ``k``; then each engine rank that holds
``k`` takes it as a delta, the others dense, in the same update (``delta_to``: per segment and
destination). Every rank computes the same answer from the same table (``delta_layers``), so every
rank knows which messages to post.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from glm_fp8.transfer.delta.versions import NONE
from glm_fp8.transfer.delta.wire import DeltaPiece, counts_numel, payload_bound
from glm_fp8.transfer.endpoint import Side, on_stream
from glm_fp8.transfer.pack import ShardPack
from glm_fp8.transfer.routes import LayerRoutes, Segment
from glm_fp8.transfer.wire import link_failure

ROW = 128  # bytes per row of a segment seen as fp8: a 128x128 block is 16 KiB of consecutive bytes


def segment_rows(nbytes: int) -> list[tuple[int, tuple[int, int]]]:
    """``(offset, (rows, row bytes))`` of each delta piece of ``nbytes`` data bytes."""
    whole = nbytes // ROW * ROW
    out = [(0, (whole // ROW, ROW))] if whole else []
    return out + ([(whole, (1, nbytes - whole))] if nbytes > whole else [])


@dataclass(frozen=True)
class SegmentDelta:
    """One segment's delta messages: its pieces, where each lies in its data bytes, the counts
    message's size and the payload's bound (a size from the plan, never from a received one)."""

    data_nbytes: int
    pieces: tuple[DeltaPiece, ...]
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, seg: ShardPack) -> SegmentDelta:
        return cls.of_nbytes(seg.data_nbytes)

    @classmethod
    def of_nbytes(cls, nbytes: int) -> SegmentDelta:
        """The delta pieces of ``nbytes`` data bytes (``segment_rows``)."""
        rows = segment_rows(nbytes)
        pieces = tuple(DeltaPiece(shape, scaled=False) for _, shape in rows)
        return cls(nbytes, pieces, tuple(o for o, _ in rows))

    @property
    def counts_words(self) -> int:
        return counts_numel(self.pieces)

    @property
    def message_nbytes(self) -> int:
        """The counts message: counts padded to 8 bytes, payload length, checksum word."""
        return -(-4 * self.counts_words // 8) * 8 + 16

    @property
    def bound(self) -> int:
        return payload_bound(self.pieces)

    def counts(self, msg: torch.Tensor) -> torch.Tensor:
        return msg[: 4 * self.counts_words].view(torch.int32)

    def words(self, msg: torch.Tensor) -> torch.Tensor:
        """int64 [2]: the payload's bytes, the segment's checksum word."""
        return msg[self.message_nbytes - 16 : self.message_nbytes].view(torch.int64)

    def views(self, data: torch.Tensor) -> list[torch.Tensor]:
        """The pieces of ``data`` (uint8, the segment's data bytes), each [rows, row bytes]."""
        return [
            data[o : o + p.shape[0] * p.shape[1]].view(p.shape) for o, p in zip(self.offsets, self.pieces)
        ]


class LayerSizes(NamedTuple):
    """A layer's delta segments (of one sender, or of one engine rank), summed: their data bytes
    (what a sender keeps), counts messages and payload bounds (the buffers both ends allocate).
    The transfer allocates from these and the update-time model predicts from them."""

    data: int
    messages: int
    bounds: int

    @classmethod
    def of(cls, segs: Sequence[SegmentDelta]) -> LayerSizes:
        return cls(
            sum(d.data_nbytes for d in segs), sum(d.message_nbytes for d in segs), sum(d.bound for d in segs)
        )


def zero_gaps(region: torch.Tensor, seg: ShardPack) -> None:
    """Zero the bytes of ``region[:seg.data_nbytes]`` that no piece of ``seg`` covers (alignment
    padding, which a dense update sends as whatever the buffer held)."""
    at = 0
    for p in sorted(seg.pieces, key=lambda p: p.offset):
        if p.offset > at:
            region[at : p.offset].zero_()
        at = max(at, p.offset + p.nbytes)
    if seg.data_nbytes > at:
        region[at : seg.data_nbytes].zero_()


def versions_row(size: int, rank: int, row: Sequence[int], device: torch.device) -> torch.Tensor:
    """This rank's contribution to the versions table: ``row`` at ``rank``, ``NONE`` elsewhere."""
    table = torch.full((size, len(row)), NONE, dtype=torch.int64)
    table[rank] = torch.tensor(list(row), dtype=torch.int64)
    return table.to(device)


def delta_layers(
    table: torch.Tensor, senders: Sequence[int], receivers: Sequence[int]
) -> tuple[int, list[frozenset[int]]]:
    """From the all-reduced versions table (host int64 [link size, layers + 1]): this update's
    number (the largest any sender proposed, so that every rank agrees on it) and, per layer, the
    engine ranks (of ``receivers``, link ranks) that take it as a delta: where every sender in
    ``senders`` has a kept copy at the same version ``k``, each rank that holds ``k``. One sender
    out of step (rebuilt, or behind after a failed update) makes the layer dense for all: each
    engine rank checks a layer's segments together, so they move or stay together."""
    senders, rows = list(senders), table.tolist()  # (indexing a tensor costs ~10 us an element)
    first = rows[senders[0]][:-1]
    agree = [v != NONE and all(rows[s][k] == v for s in senders) for k, v in enumerate(first)]
    fresh = [
        frozenset(r for r in receivers if rows[r][k] == first[k]) if ok else frozenset()
        for k, ok in enumerate(agree)
    ]
    return max(rows[s][-1] for s in senders), fresh


def delta_to(lay: LayerRoutes, seg: Segment, fresh: frozenset[int]) -> tuple[int, ...]:
    """The ranks of ``seg``'s class that take it as a delta, the others dense: for a group
    broadcast (one message for the class) all of them or none, else each rank in ``fresh``."""
    ranks = lay.classes[seg.cls]
    if seg.group is not None:
        return tuple(ranks) if all(r in fresh for r in ranks) else ()
    return tuple(r for r in ranks if r in fresh)


def exchange_versions(end: Side, row: Sequence[int]) -> tuple[int, list[frozenset[int]]]:
    """The versions exchange of an endpoint (``end``: a Sender's or a Receiver's ``Side``; every
    rank of the link takes part, before the first layer): its ``row`` all-reduced with every other
    rank's on the link stream; this update's number and each layer's delta ranks (``delta_layers``)."""
    receivers = [r for r, e in enumerate(end.routes.engines) if e is not None]
    try:
        with on_stream(end.link_stream):
            table = versions_row(end.link.size, end.rank, row, end.device)
            end.link.all_reduce_max(table)
            table = table.cpu()
    except Exception as exc:
        raise link_failure("the link failed during the versions exchange", exc) from exc
    return delta_layers(table, end.senders, receivers)


__all__ = [
    "ROW",
    "LayerSizes",
    "SegmentDelta",
    "delta_layers",
    "delta_to",
    "exchange_versions",
    "segment_rows",
    "versions_row",
    "zero_gaps",
]
