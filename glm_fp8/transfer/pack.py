"""The wire regions (docs/layouts.md#the-transfer-plan): one engine rank's share of a layer on the
wire, the cut of every entry that the rank holds (``Shard`` without its zero padding rows); the
classes of ranks that share one broadcast; and the ``engines`` every plan of regions takes, one
entry per link rank (``FULL``, an ``EngineLayout`` or None at a sender), checked whole by
``check_engines``.

A class is a set of ranks and the pieces they all hold. One sender (scatter): per piece, an entry's
cut is keyed by the bytes it covers (its entry, dim and ranges), its class is the set of ranks
that hold it (its holders), whatever server they belong to, and the pieces of one holder set form
one pack: a rank is in several classes, e.g. in a sparse layer every rank for the replicated
entries, the ranks of one TP position across servers and DP replicas for attention and the shared
expert, the ranks of one expert cut for the routed experts. Ranks that take every entry whole
(``FULL``) form one class of the whole layer. On a link that cannot make groups, only the pieces
every engine rank holds are shared (the link's own broadcast); each rank's other pieces are its
own class. Many senders: a class is ranks whose whole region is equal (``scatter_classes``).

Pack layout: the pieces in plan order, each at a multiple of 256 bytes, then one int64: the
pack's checksum (``glm_fp8.transfer.wire.message_checksum`` of the bytes before it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from glm_fp8.engine.layout import EngineLayout, Shard, copy_shard_into
from glm_fp8.engine.rules import ShardRules
from glm_fp8.model.families import REST, model_layer_ids
from glm_fp8.model.layer_plan import LayerPlan, align
from glm_fp8.model.plans import plans_for_model
from glm_fp8.model.trainer_layouts import layer_prefix
from glm_fp8.transfer.wire import CHECKSUM_BYTES, message_checksum

FULL = "full"  # an ``engines`` entry: this rank receives every entry whole (kernel format)


@dataclass(frozen=True)
class ShardPiece:
    """One entry's cut for one rank: ``shard`` (padding dropped) of the full kernel-format entry
    ``name``, ``shape`` in wire ``dtype``, at ``offset`` in the region. ``rows``: the piece
    covers only rows [a, b) of the full entry's dim 0 (the routed experts of a stack, a range
    of vocabulary rows), cut by ``shard`` along its other dims (many senders,
    ``glm_fp8.transfer.routes``); None: all the rank holds."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    shard: Shard
    rows: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)

    def view(self, region: torch.Tensor) -> torch.Tensor:
        return region[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class ShardPack:
    """Every piece of one layer that one rank holds; ``nbytes`` includes the checksum word."""

    pieces: tuple[ShardPiece, ...]
    nbytes: int

    @property
    def data_nbytes(self) -> int:
        return self.nbytes - CHECKSUM_BYTES

    @property
    def key(self) -> tuple[Shard, ...]:
        """Equal keys: the ranks receive the same bytes."""
        return tuple(p.shard for p in self.pieces)

    def pack_into(
        self, full: Mapping[str, torch.Tensor], region: torch.Tensor, starts: Mapping[str, int] | None = None
    ) -> None:
        """Write each piece, cut from the entry views ``full`` (by prefixed name), into ``region``
        (uint8, ``nbytes`` long); the checksum word is left to the caller. A piece with ``rows``
        is cut from a view that holds only some rows of its entry, from ``starts[name]`` on."""
        for p in self.pieces:
            src = full[p.name]
            if p.rows is not None:
                a, b = p.rows
                src = src.narrow(0, a - starts[p.name], b - a)
            copy_shard_into(p.view(region), src, p.shard)

    def views(self, region: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for p in self.pieces:
            yield p.name, p.view(region)

    def checksum_word(self, region: torch.Tensor) -> torch.Tensor:
        return region[self.data_nbytes : self.nbytes].view(torch.int64)[0]

    def seal(self, region: torch.Tensor, scratch: torch.Tensor) -> None:
        """Write the checksum word of ``region`` (this pack's ``nbytes``) over its data bytes."""
        self.checksum_word(region).copy_(message_checksum(region[: self.data_nbytes], scratch))


def shard_pack(plan: LayerPlan, layer_idx: int, config: Mapping, layout: EngineLayout) -> ShardPack:
    """The region a rank at ``layout`` receives for layer ``layer_idx`` (``REST`` too) in scatter
    mode: its cut of every entry it holds (``EngineLayout.holds``). Raises ValueError where vLLM
    would refuse the layout (``shard_for``)."""
    rules = ShardRules(config, layout, plan.quantize)
    prefix = layer_prefix(layer_idx)
    pieces, offset = [], 0
    for e in plan.entries:
        if not layout.holds(config, prefix + e.name):
            continue
        shard = rules.shard(prefix + e.name, e.shape)
        shard = dataclasses.replace(shard, pad=0)  # padding rows are zeroed by the receiver, not sent
        piece = ShardPiece(prefix + e.name, e.dtype, shard.shape(e.shape), offset, shard)
        pieces.append(piece)
        offset = align(offset + piece.nbytes)
    return ShardPack(tuple(pieces), offset + CHECKSUM_BYTES)


def full_pack(plan: LayerPlan, layer_idx: int) -> ShardPack:
    """The region of a rank that receives every entry whole: the layer buffer as the plan lays it
    out (the same offsets), then the checksum word."""
    prefix = layer_prefix(layer_idx)
    whole = Shard("replicated")
    pieces = [ShardPiece(prefix + e.name, e.dtype, tuple(e.shape), e.offset, whole) for e in plan.entries]
    return ShardPack(tuple(pieces), plan.nbytes + CHECKSUM_BYTES)


def scatter_classes(packs: Sequence[ShardPack | None]) -> list[tuple[int, ...]]:
    """Ranks (indices into ``packs``; None: not a receiver) grouped by equal packs (whole regions),
    in order of first appearance."""
    classes: dict[tuple[Shard, ...], list[int]] = {}
    for rank, pack in enumerate(packs):
        if pack is not None:
            classes.setdefault(pack.key, []).append(rank)
    return [tuple(ranks) for ranks in classes.values()]


def cut_key(p: ShardPiece) -> tuple:
    """What bytes of its entry a piece holds, whatever the rule that cut it: ranks of different
    layouts that hold equal keys hold the same bytes (the group a cut is over, its kind and a
    single range covering the whole dim do not change them)."""
    s, ndim = p.shard, len(p.shape)
    parts: list[list[int]] = []
    for a, b in s.parts if s.kind != "replicated" else ():
        if parts and parts[-1][1] == a:
            parts[-1][1] = b
        elif b > a:
            parts.append([a, b])
    if s.kind == "replicated" or parts == [[0, s.full]]:
        return p.name, p.rows, None
    return p.name, p.rows, s.dim % ndim, tuple(map(tuple, parts))


def piece_classes(
    packs: Sequence[ShardPack | None], whole: Sequence[bool], groups: bool = True
) -> tuple[list[tuple[int, ...]], list[ShardPack]]:
    """One sender's classes: each distinct piece of ``packs`` (None: not a receiver) grouped by the
    ranks that hold it, the pieces of one holder set packed afresh; ``whole[r]``: rank r takes its
    pack as one piece (``FULL``). ``groups`` False: a holder set short of every receiver is cut into
    one class per rank. Classes that share one broadcast come first (in order of first appearance,
    then the rest), so that a sender's group broadcasts precede its point-to-point messages."""
    everyone = tuple(r for r, pk in enumerate(packs) if pk is not None)
    holders: dict[tuple, list[int]] = {}
    piece: dict[tuple, ShardPiece | ShardPack] = {}
    for r in everyone:
        pk = packs[r]
        for key, p in [((FULL,), pk)] if whole[r] else [(cut_key(p), p) for p in pk.pieces]:
            holders.setdefault(key, []).append(r)
            piece.setdefault(key, p)
    sets: dict[tuple[int, ...], list[tuple]] = {}
    for key, ranks in holders.items():
        ranks = tuple(ranks)
        for hs in [ranks] if groups or ranks == everyone else [(r,) for r in ranks]:
            sets.setdefault(hs, []).append(key)
    # stable: first appearance among the shared ones (a group or the link's broadcast), then the rest
    classes = sorted(sets, key=lambda hs: not ((groups and len(hs) > 1) or hs == everyone))
    out = []
    for hs in classes:
        keys = sets[hs]
        if keys[0] == (FULL,):
            out.append(piece[keys[0]])
            continue
        pieces, offset = [], 0
        for key in keys:
            pieces.append(dataclasses.replace(piece[key], offset=offset))
            offset = align(offset + pieces[-1].nbytes)
        out.append(ShardPack(tuple(pieces), offset + CHECKSUM_BYTES))
    return classes, out


@dataclass(frozen=True)
class LayerScatter:
    """One layer in scatter mode: each class's ranks (a rank may be in several), its pack and its
    pack's offset in the sender's buffer of ``nbytes`` (packs side by side, each at a multiple of
    256 bytes)."""

    classes: tuple[tuple[int, ...], ...]
    packs: tuple[ShardPack, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @property
    def wire_nbytes(self) -> int:
        """What the sender sends for the layer on a link that makes groups: every class's pack once."""
        return sum(p.nbytes for p in self.packs)


def layer_scatter(
    plan: LayerPlan,
    layer_idx: int,
    config: Mapping | None,
    engines: Sequence[EngineLayout | str | None],
    *,
    per_piece: bool | None = None,
    groups: bool = True,
) -> LayerScatter:
    """The classes of ``engines`` (None: not a receiver; ``FULL``: every entry whole) for one layer
    and where their packs lie in the sender's buffer. ``per_piece`` (default: when ``engines``
    names at most one sender): classes by piece (``piece_classes``, with ``groups``), else by
    whole region (``scatter_classes``, many senders)."""
    packs = [
        None
        if lay is None
        else full_pack(plan, layer_idx)
        if lay == FULL
        else shard_pack(plan, layer_idx, config, lay)
        for lay in engines
    ]
    if per_piece is None:
        per_piece = sum(lay is None for lay in engines) <= 1
    if per_piece:
        classes, chosen = piece_classes(packs, [lay == FULL for lay in engines], groups)
    else:
        classes = scatter_classes(packs)
        chosen = [packs[ranks[0]] for ranks in classes]
    offsets, total = [], 0
    for pack in chosen:
        offsets.append(total)
        total = align(total + pack.nbytes)
    return LayerScatter(tuple(classes), tuple(chosen), tuple(offsets), total)


def check_engines(engines: Sequence[EngineLayout | str | None], senders: Sequence[int]) -> None:
    """``engines`` has one entry per link rank: None exactly at the senders, else an
    ``EngineLayout`` or ``FULL``."""
    if not senders:
        raise ValueError("senders: expected at least one trainer rank")
    if len(set(senders)) != len(senders):
        raise ValueError(f"senders: expected distinct link ranks, got {list(senders)}")
    bad = [s for s in senders if not 0 <= s < len(engines)]
    if bad:
        raise ValueError(f"senders: rank {bad[0]} is not a rank of the link (0..{len(engines) - 1})")
    for r, lay in enumerate(engines):
        if (r in senders) != (lay is None):
            raise ValueError(
                f"engines[{r}]: expected "
                + ("None (a sender)" if r in senders else f"the EngineLayout of rank {r} or 'full', got None")
            )
        if lay is not None and lay != FULL and not isinstance(lay, EngineLayout):
            raise TypeError(f"engines[{r}]: expected an EngineLayout or {FULL!r}, got {lay!r}")
    if all(lay is None for lay in engines):
        raise ValueError(
            f"engines: no rank of the link receives (every one of its {len(engines)} ranks is a "
            f"sender: {list(senders)})"
        )
    check_replicas(engines)


def check_replicas(engines: Sequence[EngineLayout | str | None]) -> None:
    """The engine layouts taken as a whole: the ranks of one parallel shape (TP, EP, DP sizes) form
    whole replicas, every position (tp_rank, dp_rank) held by the same number of ranks, so that
    each replica holds every shard exactly once. Two workers that both report TP rank 0 of a TP 2
    engine (and none rank 1) are refused here, naming them, before any byte moves."""
    shapes: dict[EngineLayout, dict[tuple[int, int], list[int]]] = {}
    for r, lay in enumerate(engines):
        if isinstance(lay, EngineLayout):
            # The engine's shape: the layout at position (0, 0), so that a vLLM and an SGLang engine of
            # equal sizes, or two engines told apart by any other setting, are not taken for one.
            key = dataclasses.replace(lay, tp_rank=0, dp_rank=0, ep_rank=0)
            shapes.setdefault(key, {}).setdefault((lay.tp_rank, lay.dp_rank), []).append(r)
    for shape, held in shapes.items():
        tp, ep, dp = shape.tp_size, shape.ep_size, shape.dp_size
        copies = max(len(ranks) for ranks in held.values())
        for tp_rank in range(tp):
            for dp_rank in range(dp):
                ranks = held.get((tp_rank, dp_rank), [])
                if len(ranks) == copies:
                    continue
                crowded = next(pos for pos, rs in held.items() if len(rs) == copies)
                raise ValueError(
                    f"engines: the layouts of TP {tp} x DP {dp}{' with EP' if ep > 1 else ''} do not form "
                    f"whole replicas: tp_rank {tp_rank}, dp_rank {dp_rank} is held by "
                    f"{'ranks ' + str(ranks) if ranks else 'no rank'}, tp_rank {crowded[0]}, dp_rank "
                    f"{crowded[1]} by ranks {held[crowded]}; each replica's ranks must report every "
                    "position exactly once (check each worker's tp_rank / dp_rank)"
                )


@dataclass(frozen=True)
class UpdateRegions:
    """Bytes of one fp8 update into one engine's ranks: ``full`` (what every rank receives from a
    full broadcast), ``per_rank`` (what each receives in scatter mode), ``layers`` (each layer's
    ``LayerScatter``) and their ``plans``."""

    full: int
    per_rank: list[int]
    layers: list[LayerScatter]
    plans: list[LayerPlan]


def update_regions(
    config: Mapping,
    layouts: Sequence[EngineLayout],
    *,
    layer_ids: Sequence[int] | None = None,
    rest: bool = True,
    scale_fmt: str | None = None,
) -> UpdateRegions:
    """The scatter plan of one fp8 update, without a link. Default: the whole model (every decoder
    layer, the MTP layer, and the non-layer tensors when ``rest``)."""
    ids = model_layer_ids(config) if layer_ids is None else list(layer_ids)
    ids += [REST] if rest else []
    plans = plans_for_model(config, "fp8", layer_ids=ids, scale_fmt=scale_fmt)
    cache: dict[int, LayerScatter] = {}  # a layer's regions depend on its plan, not its index
    layers = []
    per_rank = [0] * len(layouts)
    for plan, layer_idx in zip(plans, ids):
        if id(plan) not in cache:
            cache[id(plan)] = layer_scatter(plan, layer_idx, config, layouts)
        layer = cache[id(plan)]
        layers.append(layer)
        for ranks, pack in zip(layer.classes, layer.packs):
            for r in ranks:
                per_rank[r] += pack.nbytes
    return UpdateRegions(sum(p.nbytes for p in plans), per_rank, layers, plans)


def update_bytes(
    config: Mapping,
    layouts: Sequence[EngineLayout],
    *,
    layer_ids: Sequence[int] | None = None,
    rest: bool = True,
    scale_fmt: str | None = None,
) -> tuple[int, list[int]]:
    """Wire bytes of one fp8 update: (what every engine rank receives from a full broadcast,
    what each of ``layouts`` receives in scatter mode); see ``update_regions``."""
    u = update_regions(config, layouts, layer_ids=layer_ids, rest=rest, scale_fmt=scale_fmt)
    return u.full, u.per_rank


def layout_words(layout: EngineLayout | None) -> list | None:
    """A layout as JSON data, for the manifest."""
    return None if layout is None else [layout.engine, *dataclasses.astuple(layout)]


__all__ = [
    "FULL",
    "check_engines",
    "check_replicas",
    "cut_key",
    "LayerScatter",
    "ShardPack",
    "ShardPiece",
    "UpdateRegions",
    "layer_scatter",
    "full_pack",
    "layout_words",
    "piece_classes",
    "scatter_classes",
    "shard_pack",
    "update_bytes",
    "update_regions",
]
