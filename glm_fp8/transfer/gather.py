"""Collecting sharded trainer weights (DTensors) on the sending rank, piece by piece: the
gather strategies of ``Sender`` and ``contribute_shards``.

Every function here is collective over the DTensor's mesh: all of its ranks call it with the
same arguments, and only ``dst`` (a global rank) receives. Supported layouts: a 1-D mesh with
one ``Shard(d)`` placement (FSDP2 and expert parallel shard dim 0) or ``Replicate``; anything
else is gathered whole with ``full_tensor()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from glm_fp8.core.vocab import GATHERS, check_choice
from glm_fp8.kernels.convert import check_adapted_layer, check_finite_entries, convert_checked
from glm_fp8.kernels.quantize import quantize_blockwise
from glm_fp8.model.layer_plan import LayerPlan
from glm_fp8.model.plans import plans_for_model, unsent_keys, warn_unsent
from glm_fp8.model.trainer_layouts import adapt_plan, layer_prefix, strip_layer
from glm_fp8.transfer.owners import chunk_bounds
from glm_fp8.transfer.votes import default_device, resolve_device


@dataclass(frozen=True)
class ShardLayout:
    """Who holds what: mesh ranks (global) and each one's [lo, hi) range along ``dim``."""

    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    dim: int | None  # None: replicated, every rank holds everything
    bounds: tuple[tuple[int, int], ...]

    def owned(self, rank: int) -> tuple[int, int]:
        return self.bounds[self.ranks.index(rank)]


def full_value(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A DTensor's whole value (prime-rl's ``full_tensor()``), in its own dtype, or cast to
    ``dtype`` first when given (the ``gather_dtype`` opt-in); a plain tensor is returned
    untouched."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to(dtype) if dtype is not None and t.dtype != dtype else t
        return t.full_tensor()
    return t


def shard_layout(t: torch.Tensor) -> ShardLayout | None:
    """The layout of a DTensor on a 1-D mesh with one Shard/Replicate placement, else None."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor) or t.device_mesh.ndim != 1 or len(t.placements) != 1:
        return None
    mesh, placement = t.device_mesh, t.placements[0]
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    if isinstance(placement, Replicate):
        return ShardLayout(mesh.get_group(), ranks, None, tuple((0, t.shape[0]) for _ in ranks))
    if type(placement) is not Shard:  # not _StridedShard (FSDP2 + TP): gathered whole
        return None
    dim = placement.dim % t.dim()
    return ShardLayout(mesh.get_group(), ranks, dim, chunk_bounds(t.shape[dim], len(ranks)))


def gather_rows(
    t: torch.Tensor, start: int, stop: int, dst: int, out: torch.Tensor | None, dtype: torch.dtype | None
) -> torch.Tensor | None:
    """Collect ``t[start:stop]`` (whole along the other dims) into ``out`` on global rank ``dst``.

    ``out`` (only on ``dst``) has shape ``[stop - start, *t.shape[1:]]`` and the dtype the
    pieces travel in: ``dtype`` when given (they are cast to it first), else ``t``'s own.
    Pieces travel by point-to-point sends from their owners. Returns ``out`` on ``dst``, None
    elsewhere.
    """
    layout = shard_layout(t)
    if layout is None:
        raise ValueError(
            f"gather_rows: expected a DTensor on a 1-D mesh with one Shard/Replicate placement, got {t}"
        )
    me = dist.get_rank()
    local = t.to_local()
    cast = (lambda x: x.to(dtype)) if dtype is not None else (lambda x: x)
    if layout.dim is None:  # replicated: dst has it all
        if me == dst:
            out.copy_(local[start:stop])
        return out if me == dst else None
    for owner, (lo, hi) in zip(layout.ranks, layout.bounds):
        if layout.dim == 0:
            a, b = max(start, lo), min(stop, hi)
            if a >= b:
                continue
            piece = local[a - lo : b - lo] if me == owner else None
            target = out[a - start : b - start] if me == dst else None
        else:
            if lo >= hi:
                continue
            piece = local[start:stop] if me == owner else None
            target = out.narrow(layout.dim, lo, hi - lo) if me == dst else None
        move(piece if piece is None else cast(piece), target, owner, dst, layout.group)
    return out if me == dst else None


def move(piece: torch.Tensor | None, target: torch.Tensor | None, owner: int, dst: int, group) -> None:
    """``owner``'s ``piece`` lands in ``dst``'s ``target`` (a copy when they are one rank)."""
    me = dist.get_rank()
    if owner == dst:
        if me == dst:
            target.copy_(piece)
    elif me == owner:
        dist.send(piece.contiguous(), dst, group=group)
    elif me == dst:
        if target.is_contiguous():
            dist.recv(target, owner, group=group)
        else:
            tmp = torch.empty(target.shape, dtype=target.dtype, device=target.device)
            dist.recv(tmp, owner, group=group)
            target.copy_(tmp)


def trainer_view(
    plan: LayerPlan, layer: Mapping[str, torch.Tensor], layer_idx: int
) -> tuple[LayerPlan, dict[str, torch.Tensor]]:
    """``plan`` read in the trainer layout of ``layer`` (short names;
    ``glm_fp8.model.trainer_layouts.adapt_plan``),
    and ``layer`` without the tensors the engine has no parameter for (``unsent_keys``: said once).
    Every trainer rank decides alike, so the gathers that follow pair up."""
    prefix = layer_prefix(layer_idx)
    unsent = unsent_keys(plan.kind, layer)
    if unsent:
        warn_unsent(unsent, prefix)
        layer = {k: t for k, t in layer.items() if k not in unsent}
    return adapt_plan(plan, layer, prefix=prefix), dict(layer)


def travel_dtypes(plan: LayerPlan, gather_dtype: torch.dtype | None) -> dict[str, torch.dtype | None]:
    """The dtype each source is cast to before it travels in a gather. ``gather_dtype=None``
    (the default): none, every source travels and is quantized in the dtype the trainer holds
    (docs/numerics.md#inputs: no cast before quantizing). A ``gather_dtype`` (the bf16 opt-in):
    that dtype for the sources of quantized entries, whose bytes then differ from the
    checkpoint's for fp32 masters; a passthrough entry's own (wire) dtype for its sources, which
    is the rounding its copy makes anyway (an fp32 routing bias travels as fp32, so it lands
    exact)."""
    if gather_dtype is None:
        return {}
    out: dict[str, torch.dtype | None] = {}
    for e in plan.entries:
        for s in e.sources:
            out[s] = gather_dtype if e.op == "quantize" else e.dtype
    return out


def contribute_shards(
    layers: Iterable[tuple[int, Mapping[str, torch.Tensor]]],
    *,
    config: Mapping | None = None,
    plans: Sequence[LayerPlan] | None = None,
    sender: int = 0,
    gather: str = "auto",
    chunk_experts: int = 8,
    gather_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    layer_ids: Sequence[int] | None = None,
) -> None:
    """What every trainer rank except the sender runs, with the same arguments as the sender's
    ``Sender``: its part of each layer's DTensor gathers (collective over the mesh).
    ``layer_ids``: the layers ``layers`` yields (default: every decoder layer of ``config``)."""
    if (config is None) == (plans is None):
        raise ValueError("config / plans: pass exactly one of them")
    plans = list(plans) if plans is not None else plans_for_model(config, layer_ids=layer_ids)
    dev = resolve_device(device) if device else default_device()
    for pos, (layer_idx, sd) in enumerate(layers):
        plan, layer = trainer_view(plans[pos], strip_layer(sd, layer_idx), layer_idx)
        collect_layer(
            plan,
            layer,
            layer_idx,
            None,
            wire="fp8",
            gather=gather,
            chunk_experts=chunk_experts,
            gather_dtype=gather_dtype,
            sender=sender,
            device=dev,
        )


def collect_layer(
    plan: LayerPlan,
    layer: Mapping[str, torch.Tensor],
    layer_idx: int,
    buf: torch.Tensor | None,
    *,
    wire: str,
    gather: str,
    chunk_experts: int,
    gather_dtype: torch.dtype | None,
    sender: int,
    device: torch.device,
    check_finite: bool = True,
) -> dict[str, torch.Tensor]:
    """Gather (if sharded) and convert one layer into ``buf`` on the sender (``buf`` given;
    returns every entry's view by prefixed name); on the other trainer ranks only take part in the
    gathers (returns {}). Every trainer rank calls it with the same layer, so the collectives
    match. ``plan`` and ``layer`` as ``trainer_view`` gives them (short names, the plan adapted to
    the layer's trainer layout): nothing is adapted again, and the sender checks the layer once
    (``check_adapted_layer``), before any byte of ``buf`` is written. ``check_finite=False``: no
    host read; the caller checks ``buf`` (``entry_norms``).

    gather: "full" (``full_tensor()`` per tensor, as prime-rl), "chunked" (expert stacks
    ``chunk_experts`` at a time into a reusable buffer: the whole gathered stack never exists),
    "quantize_then_gather" (each rank quantizes the experts it holds; only fp8 bytes and scales
    travel), or "auto" (the last that the sharding allows). Plain tensors are used as they are;
    DTensors travel in their own dtype unless ``gather_dtype`` (an opt-in: ``travel_dtypes``) says
    otherwise, so a chunk buffer holds fp32 masters as fp32 (twice a bf16 gather's bytes).
    """
    sending = buf is not None
    prefix = layer_prefix(layer_idx)
    travel = travel_dtypes(plan, gather_dtype)
    strategy = _choose_gather(plan, layer, gather, wire, prefix)
    if strategy == "full":
        gathered = {k: full_value(t, travel.get(k)) for k, t in layer.items()}
        if not sending:
            return {}
        gathered = {k: t.to(device) for k, t in gathered.items()}
        on = check_adapted_layer(plan, gathered, prefix)
        # check_finite: one flag for every entry, passthrough ones included, one host read.
        return dict(convert_checked(gathered, plan, prefix, out=buf, device=on, check_finite=check_finite))
    stacks = [e for e in plan.entries if e.op == "quantize" and len(e.shape) == 3]
    stacked = {s for e in stacks for s in e.sources}
    rest = {k: full_value(t, travel.get(k)) for k, t in layer.items() if k not in stacked}
    views: dict[str, torch.Tensor] = {}
    if sending:
        rest = {k: t.to(device) for k, t in rest.items()}
        # The whole layer is checked once (the stacks' global shapes); only the rest is written here.
        on = check_adapted_layer(plan, {**rest, **{k: layer[k] for k in stacked}}, prefix)
        names = {e.name for e in plan.entries if e.op != "scale" and e not in stacks}
        views = convert_checked(rest, plan, prefix, out=buf, device=on, check_finite=False, only=names)
    me = torch.distributed.get_rank()
    fmt = plan.scale_fmt
    for e in stacks:
        srcs = [layer[s] for s in e.sources]
        q, sc = (views[prefix + e.name], views[prefix + e.name + "_scale_inv"]) if sending else (None, None)
        if strategy == "chunked":
            n = e.shape[0]
            size = min(chunk_experts, n)
            dtypes = [travel.get(s) for s in e.sources]
            chunks = [
                torch.empty((size, *t.shape[1:]), dtype=dt or t.dtype, device=device) if sending else None
                for t, dt in zip(srcs, dtypes)
            ]
            for a in range(0, n, chunk_experts):
                b = min(n, a + chunk_experts)
                got = [
                    gather_rows(t, a, b, sender, c[: b - a] if sending else None, dt)
                    for t, c, dt in zip(srcs, chunks, dtypes)
                ]
                if sending:
                    quantize_blockwise(got, out=q[a:b], scale_out=sc[a:b], scale_fmt=fmt, check_finite=False)
            continue
        layout = shard_layout(srcs[0])
        lo, hi = layout.owned(me)
        local = [t.to_local() for t in srcs]  # quantized where held, in its dtype: only fp8 travels
        q_own = s_own = None
        if hi > lo:
            if sending:
                quantize_blockwise(
                    local, out=q[lo:hi], scale_out=sc[lo:hi], scale_fmt=fmt, check_finite=False
                )
            else:
                q_own, s_own = quantize_blockwise(local, scale_fmt=fmt, check_finite=False)
        for owner, (olo, ohi) in zip(layout.ranks, layout.bounds):
            if ohi > olo and owner != sender:  # the sender quantized its own in place
                mine = me == owner
                q_to = q[olo:ohi].view(torch.uint8) if sending else None
                move(q_own.view(torch.uint8) if mine else None, q_to, owner, sender, layout.group)
                move(s_own if mine else None, sc[olo:ohi] if sending else None, owner, sender, layout.group)
    if sending and check_finite:
        check_finite_entries(plan, buf, layer_idx, ("scale", "copy", "concat"))
    return dict(views) if sending else {}


def _choose_gather(
    plan: LayerPlan, layer: Mapping[str, torch.Tensor], gather: str, wire: str, prefix: str
) -> str:
    from torch.distributed.tensor import DTensor

    check_choice("gather", gather, GATHERS)
    sharded = any(isinstance(t, DTensor) for t in layer.values())
    stacks = [e for e in plan.entries if e.op == "quantize" and len(e.shape) == 3]
    if gather == "full" or not sharded or not stacks:
        return "full"
    why = None
    if wire != "fp8" or plan.target != "hopper":
        why = f"wire {wire!r} / target {plan.target!r} (piecewise gathers need fp8 for Hopper)"
    per_expert = [e for e in stacks if e.per_expert]
    if why is None and per_expert:
        why = f"{prefix}{per_expert[0].name} comes from per-expert tensors (each is gathered whole)"
    layouts = {s: shard_layout(layer[s]) for e in stacks for s in e.sources}
    bad = [s for s, lay in layouts.items() if lay is None]
    if why is None and bad:
        why = f"{prefix}{bad[0]} is not a DTensor on a 1-D mesh with one Shard/Replicate placement"
    if why is not None:
        if gather == "auto":
            return "full"
        raise ValueError(f"gather={gather!r}: {why}")
    whole = [lay for lay in layouts.values()]
    can_qtg = all(
        lay.dim == 0 and lay.bounds == whole[0].bounds and lay.ranks == whole[0].ranks for lay in whole
    )
    if gather == "quantize_then_gather" and not can_qtg:
        raise ValueError(
            "gather='quantize_then_gather': the expert stacks must be sharded on the expert dim "
            "(Shard(0)) alike, so that every rank holds whole experts"
        )
    if gather == "auto":
        return "quantize_then_gather" if can_qtg else "chunked"
    return gather
