"""Delta state across links (docs/delta.md#across-links): what a sender keeps and what an engine
rank holds, taken from the endpoints of one link and given to those of the next, so that the first
update on a rebuilt link (a fleet with a server added, removed or replaced) is a delta wherever both
ends still agree, and dense only where they do not (a new or restarted server's ranks).

A sender's kept copy is in segment coordinates, and a new link's routes may cut a layer into other
segments (another class of ranks holds a piece, pieces regroup). Every piece of a segment is an
entry's cut whose bytes depend only on its dtype, shape and ``pack.cut_key`` (entry, rows, the
cut's ranges), wherever it lies in its segment; so a new segment's kept bytes are assembled piece
by piece from the old segments (an old segment equal to the new one is taken as it is, no copy). A
piece that no sender sent on the old link is zero in the kept copy: only ranks new to the link (a
new layout) hold it, and they hold no version, so they take it dense (which moves the kept copy
to its bytes). A piece another sender sent on the old link (many senders: a fleet change can move
an entry's owner, ``transfer.owners``) makes this sender's layer dense for every rank: the ranks
that hold it would otherwise take a delta against zeros. Nothing else is assumed: an engine rank's
carried versions are still proven by each segment's checksum (a parameter rewritten in between is
resent dense in the same update).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from glm_fp8.engine.layout import EngineLayout
from glm_fp8.transfer.delta.segments import zero_gaps
from glm_fp8.transfer.delta.versions import NONE
from glm_fp8.transfer.pack import ShardPiece, cut_key

PieceKey = tuple  # (dtype, shape, *cut_key): what a piece's bytes depend on


def piece_key(p: ShardPiece) -> PieceKey:
    return (p.dtype, p.shape, *cut_key(p))


@dataclass
class KeptLayer:
    """One layer's kept copy, as one sender last sent it: each segment's pieces and data bytes,
    and the key of every piece any sender sent of the layer on that link."""

    version: int
    segments: list[tuple[tuple[ShardPiece, ...], torch.Tensor]]
    on_link: frozenset[PieceKey]


@dataclass
class KeptCopy:
    """A sender's delta state off its link (``detach_kept``): per layer index its kept copy, the
    update counter (the ``resync_every`` cadence goes on) and the next update number it proposes."""

    kept: str
    device: torch.device
    count: int
    proposal: int
    layers: dict[int, KeptLayer] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for lay in self.layers.values() for _, t in lay.segments)


@dataclass
class HeldCopy:
    """An engine rank's delta state off its link (``detach_held``): its layout, per layer index
    the update it holds, and the layers it takes dense from then on (``ReceiverDelta.dense_only``)."""

    layout: EngineLayout | None
    full: bool
    held: dict[int, int] = field(default_factory=dict)
    dense_only: set[int] = field(default_factory=set)


def detach_kept(sender) -> KeptCopy:
    """Take ``sender``'s kept copy and versions (a ``Sender`` built with ``delta=``), for
    ``adopt_kept`` on the sender of the next link. ``sender`` keeps nothing: its next update, if
    any, is dense. Waits first for the sender's conversion stream (CUDA), which writes the copy."""
    d = _delta_of(sender, "sender", "Sender(delta=DeltaOptions(...))")
    if sender.convert_stream is not None:
        sender.convert_stream.synchronize()
    out = KeptCopy(d.options.kept, sender.device, d.count, d.proposal)
    for pos, lay in enumerate(sender.routes.layers):
        kept, version = d.kept[pos], d.versions.kept[pos]
        if kept is not None and version != NONE:
            segs = [(s.pieces, k) for s, k in zip(lay.of_sender(sender.me), kept)]
            keys = frozenset(piece_key(p) for s in lay.segments for p in s.pieces)
            out.layers[lay.layer_idx] = KeptLayer(version, segs, keys)
        d.kept[pos], d.versions.kept[pos] = None, NONE
    return out


def detach_each(senders: Mapping[str, object]) -> dict[str, KeptCopy]:
    """``detach_kept`` of each delta sender of ``senders`` (by session); one whose copy cannot be
    taken (the device failed with the update that came before) is left out with a warning: that
    session's next update is dense."""
    out = {}
    for session, sender in senders.items():
        if getattr(sender, "delta", None) is None:
            continue
        try:
            out[session] = detach_kept(sender)
        except Exception as exc:  # noqa: BLE001 - a lost copy costs one dense update, nothing else
            warnings.warn(
                f"delta: the {session!r} kept copy could not be carried ({exc}); its next update is dense",
                stacklevel=2,
            )
    return out


def adopt_kept(sender, copy: KeptCopy) -> list[int]:
    """Give ``sender`` (a new ``Sender(delta=...)``, before its first update) the kept copy of a
    predecessor (``detach_kept``), layer by layer, each old layer given up once its new one is
    built (a transient of at most one layer's share when segments regroup). Returns the layer
    indices whose kept copy and version it took; every other layer's first update is dense
    (among them a layer with a piece another sender sent on the old link). Raises ValueError where
    the copy cannot be this sender's (kept elsewhere, another device) or the sender already sent."""
    d = _delta_of(sender, "sender", "Sender(delta=DeltaOptions(...))")
    if not isinstance(copy, KeptCopy):
        raise TypeError(f"copy: expected a KeptCopy (detach_kept), got {type(copy).__name__}")
    if copy.kept != d.options.kept or torch.device(copy.device) != sender.device:
        raise ValueError(
            f"copy: kept {copy.kept!r} on {copy.device}, this sender keeps "
            f"{d.options.kept!r} on {sender.device}; build it with the same "
            "DeltaOptions.kept and device"
        )
    if d.count or any(k is not None for k in d.kept):
        raise ValueError("sender: has sent already; adopt a kept copy before its first update")
    d.count, d.proposal = copy.count, max(d.proposal, copy.proposal)
    carried = []
    for pos, lay in enumerate(sender.routes.layers):
        old = copy.layers.pop(lay.layer_idx, None)
        if old is None:
            continue
        kept = assemble_kept(lay.of_sender(sender.me), old, d.new_kept)
        if kept is not None:
            d.kept[pos] = kept
            d.versions.compared(pos, old.version)
            carried.append(lay.layer_idx)
    copy.layers.clear()  # what no layer of this sender took is given up
    return carried


def assemble_kept(segs, old: KeptLayer, new_kept) -> list[torch.Tensor] | None:
    """The kept bytes of ``segs`` (this sender's segments of the layer on the new link) from the
    old ones: an equal old segment as it is (once), else each piece an old segment holds copied in
    and zeros elsewhere; None when a piece is not in this sender's old segments but another
    sender sent it on the old link."""
    whole = {(pieces, t.numel()): t for pieces, t in old.segments}
    where = {piece_key(p): (t, p) for pieces, t in old.segments for p in pieces}
    if any(piece_key(p) not in where and piece_key(p) in old.on_link for s in segs for p in s.pieces):
        return None
    out, taken = [], set()
    for s in segs:
        t = whole.get((s.pieces, s.data_nbytes))
        if t is not None and id(t) not in taken:
            taken.add(id(t))
            out.append(t)
            continue
        t = new_kept(s.data_nbytes)
        zero_gaps(t, s)  # the bytes between pieces: zero on both ends in a delta update
        for p in s.pieces:
            piece = t[p.offset : p.offset + p.nbytes]
            if piece_key(p) in where:
                src, q = where[piece_key(p)]
                piece.copy_(src[q.offset : q.offset + q.nbytes])
            else:  # a piece new to the link: only ranks that hold no version take it, dense
                piece.zero_()
        out.append(t)
    return out


def detach_held(receiver) -> HeldCopy:
    """Take ``receiver``'s held versions (a ``Receiver(delta=True)``), for ``adopt_held`` on
    this engine rank's receiver of the next link into the same parameters; ``receiver`` then
    holds nothing."""
    d = _delta_of(receiver, "receiver", "Receiver(delta=True)")
    ids = [lay.layer_idx for lay in receiver.routes.layers]
    out = HeldCopy(receiver.layout, receiver.full)
    out.held = {i: v for i, v in zip(ids, d.held.held) if v != NONE}
    out.dense_only = {ids[pos] for pos in d.dense_only}
    d.held.held = [NONE] * len(ids)
    return out


def adopt_held(receiver, copy: HeldCopy) -> list[int]:
    """Give ``receiver`` (a new ``Receiver(delta=True)`` into the same parameters) what its
    predecessor held (``detach_held``), in place of what it holds. Returns the layer indices it
    holds. Raises ValueError when the copy is another layout's (its parameters are other bytes)."""
    d = _delta_of(receiver, "receiver", "Receiver(delta=True)")
    if not isinstance(copy, HeldCopy):
        raise TypeError(f"copy: expected a HeldCopy (detach_held), got {type(copy).__name__}")
    if (copy.layout, copy.full) != (receiver.layout, receiver.full):
        raise ValueError(
            f"copy: held by an engine rank at layout {copy.layout} (full: {copy.full}), this "
            f"receiver's is {receiver.layout} (full: {receiver.full}); a held copy goes "
            "only to a receiver into the same parameters"
        )
    ids = [lay.layer_idx for lay in receiver.routes.layers]
    d.held.held = [copy.held.get(i, NONE) for i in ids]
    d.dense_only = {pos for pos, i in enumerate(ids) if i in copy.dense_only}
    return [i for i in ids if i in copy.held]


def _delta_of(end, what: str, build: str):
    d = getattr(end, "delta", None)
    if d is None:
        raise ValueError(f"{what}: has no delta state; build it with {build}")
    return d


__all__ = [
    "assemble_kept",
    "piece_key",
    "HeldCopy",
    "KeptCopy",
    "KeptLayer",
    "adopt_held",
    "adopt_kept",
    "detach_each",
    "detach_held",
    "detach_kept",
]
