"""Collecting sharded trainer weights (DTensors) on the sending rank, piece by piece: the
gather strategies of ``Broadcaster`` and ``contribute_shards``.

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

from glm_fp8.convert import check_finite_entries, check_layer, check_layer_keys, convert_layer
from glm_fp8.engine.routes import LayerRoutes, chunk_bounds, split_entries, stack_entries
from glm_fp8.plan import LayerPlan, layer_prefix, plans_for_model, strip_layer
from glm_fp8.quantize import quantize_blockwise
from glm_fp8.transfer.endpoint import default_device, resolve_device


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
    """A DTensor's whole value (prime-rl's ``full_tensor()``), cast to ``dtype`` first when
    given; a plain tensor is returned untouched."""
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

    ``out`` (only on ``dst``) has shape ``[stop - start, *t.shape[1:]]``. Pieces travel by
    point-to-point sends from their owners, cast to ``dtype`` first when given. Returns ``out``
    on ``dst``, None elsewhere.
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


GATHERS = ("auto", "full", "chunked", "quantize_then_gather")


def contribute_shards(
    layers: Iterable[tuple[int, Mapping[str, torch.Tensor]]],
    *,
    config: Mapping | None = None,
    plans: Sequence[LayerPlan] | None = None,
    sender: int = 0,
    gather: str = "auto",
    chunk_experts: int = 8,
    gather_dtype: torch.dtype | None = torch.bfloat16,
    device: torch.device | str | None = None,
) -> None:
    """What every trainer rank except the sender runs, with the same arguments as the sender's
    ``Broadcaster``: its part of each layer's DTensor gathers (collective over the mesh)."""
    if (config is None) == (plans is None):
        raise ValueError("config / plans: pass exactly one of them")
    plans = list(plans) if plans is not None else plans_for_model(config)
    dev = resolve_device(device) if device else default_device()
    for pos, (layer_idx, sd) in enumerate(layers):
        collect_layer(
            plans[pos], strip_layer(sd, layer_idx), layer_idx, None, mode="fp8", gather=gather,
            chunk_experts=chunk_experts, gather_dtype=gather_dtype, sender=sender, device=dev,
        )  # fmt: skip


def collect_layer(
    plan: LayerPlan,
    layer: Mapping[str, torch.Tensor],
    layer_idx: int,
    buf: torch.Tensor | None,
    *,
    mode: str,
    gather: str,
    chunk_experts: int,
    gather_dtype: torch.dtype | None,
    sender: int,
    device: torch.device,
) -> None:
    """Gather (if sharded) and convert one layer into ``buf`` on the sender (``buf`` given);
    on the other trainer ranks only take part in the gathers. Every trainer rank calls it with
    the same layer, so the collectives match.

    gather: "full" (``full_tensor()`` per tensor, as prime-rl), "chunked" (expert stacks
    ``chunk_experts`` at a time into a reusable buffer: the whole gathered stack never exists),
    "quantize_then_gather" (each rank quantizes the experts it holds; only fp8 bytes and scales
    travel), or "auto" (the last that the sharding allows). Plain tensors are used as they are.
    """
    sending = buf is not None
    prefix = layer_prefix(layer_idx)
    strategy = _choose_gather(plan, layer, gather, mode, prefix)
    if strategy == "full":
        gathered = {k: full_value(t, gather_dtype) for k, t in layer.items()}
        if sending:
            gathered = {k: t.to(device) for k, t in gathered.items()}
            # The finite check covers every entry, passthrough ones included: one host read.
            convert_layer(gathered, layer_idx, out=buf, plan=plan, check_finite=True)
        return
    stacks = [e for e in plan.entries if e.op == "quantize" and len(e.shape) == 3]
    stacked = {s for e in stacks for s in e.sources}
    rest = {k: full_value(t, gather_dtype) for k, t in layer.items() if k not in stacked}
    views: dict[str, torch.Tensor] = {}
    if sending:
        rest = {k: t.to(device) for k, t in rest.items()}
        check_layer(plan, {**rest, **{k: layer[k] for k in stacked}}, prefix)
        names = {e.name for e in plan.entries if e.op != "scale" and e not in stacks}
        views = convert_layer(rest, layer_idx, out=buf, plan=plan, check_finite=False, only=names)
    me = torch.distributed.get_rank()
    fmt = plan.scale_fmt
    for e in stacks:
        srcs = [layer[s] for s in e.sources]
        q, sc = (views[prefix + e.name], views[prefix + e.name + "_scale_inv"]) if sending else (None, None)
        if strategy == "chunked":
            n = e.shape[0]
            size = min(chunk_experts, n)
            chunks = [
                torch.empty((size, *t.shape[1:]), dtype=gather_dtype or t.dtype, device=device)
                if sending
                else None
                for t in srcs
            ]
            for a in range(0, n, chunk_experts):
                b = min(n, a + chunk_experts)
                got = [gather_rows(t, a, b, sender, c[: b - a] if sending else None, gather_dtype)
                       for t, c in zip(srcs, chunks)]  # fmt: skip
                if sending:
                    quantize_blockwise(got, out=q[a:b], scale_out=sc[a:b], scale_fmt=fmt, check_finite=False)
            continue
        layout = shard_layout(srcs[0])
        lo, hi = layout.owned(me)
        local = [t.to_local() if gather_dtype is None else t.to_local().to(gather_dtype) for t in srcs]
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
    if sending:
        check_finite_entries(plan, buf, layer_idx, ("scale", "copy", "concat"))


def _choose_gather(
    plan: LayerPlan, layer: Mapping[str, torch.Tensor], gather: str, mode: str, prefix: str
) -> str:
    from torch.distributed.tensor import DTensor

    if gather not in GATHERS:
        raise ValueError(f"gather: expected one of {GATHERS}, got {gather!r}")
    sharded = any(isinstance(t, DTensor) for t in layer.values())
    stacks = [e for e in plan.entries if e.op == "quantize" and len(e.shape) == 3]
    if gather == "full" or not sharded or not stacks:
        return "full"
    why = None
    if mode != "fp8" or plan.target != "hopper":
        why = f"mode {mode!r} / target {plan.target!r} (piecewise gathers need fp8 for Hopper)"
    layouts = {s: shard_layout(layer[s]) for e in stacks for s in e.sources}
    bad = [s for s, lay in layouts.items() if lay is None]
    if why is None and bad:
        why = f"{prefix}{bad[0]} is not a DTensor on a 1-D mesh with one Shard/Replicate placement"
    if why is not None:
        if gather == "auto":
            return "full"
        raise ValueError(f"gather={gather!r}: {why}")
    whole = [lay for lay in layouts.values()]
    can_qtg = all(lay.dim == 0 and lay.bounds == whole[0].bounds and lay.ranks == whole[0].ranks
                  for lay in whole)  # fmt: skip
    if gather == "quantize_then_gather" and not can_qtg:
        raise ValueError(
            "gather='quantize_then_gather': the expert stacks must be sharded on the expert dim "
            "(Shard(0)) alike, so that every rank holds whole experts"
        )
    if gather == "auto":
        return "quantize_then_gather" if can_qtg else "chunked"
    return gather


# --- many senders (glm_fp8.engine.routes): each trainer rank converts its own share ---------------


def check_own_layer(
    plan: LayerPlan,
    layer: Mapping[str, torch.Tensor],
    layer_idx: int,
    senders: Sequence[int],
    bounds: Sequence[tuple[int, int]],
) -> None:
    """What every sender checks of a layer before any gather, so that all of them gather or
    none does: keys and global shapes (``check_layer_keys``), expert stacks that are plain
    tensors or DTensors sharded on the expert dim over the senders (global ranks ``senders``)
    in their order, other DTensors on a mesh of the senders."""
    from torch.distributed.tensor import DTensor

    prefix = layer_prefix(layer_idx)
    check_layer_keys(plan, layer, prefix)
    stacks = {s for e in stack_entries(plan) for s in e.sources}
    for k, t in sorted(layer.items()):
        if not isinstance(t, DTensor):
            continue
        ranks = tuple(int(r) for r in t.device_mesh.mesh.flatten().tolist())
        if k in stacks:
            lay = shard_layout(t)
            if lay is None or lay.dim != 0 or lay.ranks != tuple(senders) or lay.bounds != tuple(bounds):
                got = (
                    "no 1-D Shard placement" if lay is None else f"dim {lay.dim} over ranks {list(lay.ranks)}"
                )
                raise ValueError(
                    f"{prefix}{k}: many senders need each expert stack sharded on the expert dim (Shard(0)) "
                    f"over the senders {list(senders)} in this order, each holding experts "
                    f"{[list(b) for b in bounds]}; got {got}"
                )
        elif sorted(ranks) != sorted(senders):
            raise ValueError(
                f"{prefix}{k}: a DTensor on ranks {list(ranks)}; many senders gather it on its owner among "
                f"the senders {list(senders)}, so its mesh must be theirs"
            )


def collect_own(
    routes: LayerRoutes,
    t: int,
    plan: LayerPlan,
    layer: Mapping[str, torch.Tensor],
    buf: torch.Tensor,
    *,
    senders: Sequence[int],
    gather_dtype: torch.dtype | None,
    device: torch.device,
    check_finite: bool = True,
) -> dict[str, torch.Tensor]:
    """Sender ``t``'s share of one layer (``check_own_layer`` passed on every sender): gather the
    sources of the entries each sender owns onto it (collective over the senders, in the same
    order on each), then convert ``t``'s own entries and its rows of every split entry (its
    experts of every stack, its vocabulary slice) into ``buf`` (``routes.local_plans[t]``).
    Returns the converted views by prefixed name (none when ``t`` has nothing of this layer).
    Memory above ``buf``: the gathered sources of the entries ``t`` owns, its rows of a split
    entry held otherwise than split alike, and its experts cast to ``gather_dtype`` when they
    are DTensors of another dtype.
    ``check_finite=False``: no host read; the caller checks ``buf`` (``entry_norms``)."""
    from torch.distributed.tensor import DTensor

    prefix = layer_prefix(routes.layer_idx)
    owner_of = {s: routes.owners[prefix + e.name] for e in plan.entries if prefix + e.name in routes.owners
                for s in e.sources}  # fmt: skip
    inputs: dict[str, torch.Tensor] = {}
    for k in sorted(owner_of):  # the same order on every sender: the gathers pair up
        x, owner = layer[k], owner_of[k]
        if isinstance(x, DTensor):
            if shard_layout(x) is not None:
                out = (
                    torch.empty(x.shape, dtype=gather_dtype or x.dtype, device=device) if owner == t else None
                )
                got = gather_rows(x, 0, x.shape[0], senders[owner], out, gather_dtype)
            else:
                got = full_value(x, gather_dtype)  # collective over the senders' mesh
            if owner == t:
                inputs[k] = got.to(device)
        elif owner == t:
            inputs[k] = x
    # Split entries: this sender's rows (its experts; its slice of the vocabulary). A DTensor
    # already sharded so holds them; otherwise each sender's rows are gathered onto it.
    for e in split_entries(plan):
        rows = routes.splits[prefix + e.name]
        lo, hi = rows[t]
        for k in e.sources:
            x = layer[k]
            if not isinstance(x, DTensor):
                if hi > lo:
                    inputs[k] = x.narrow(0, lo, hi - lo)
                continue
            lay = shard_layout(x)
            if lay is not None and lay.dim == 0 and lay.ranks == tuple(senders) and lay.bounds == rows:
                if hi > lo:
                    local = x.to_local()
                    cast = gather_dtype is not None and local.dtype != gather_dtype
                    inputs[k] = local.to(gather_dtype) if cast else local
                continue
            for u, (a, b) in enumerate(rows):  # the same order on every sender
                if b > a:
                    mine = u == t
                    out = torch.empty((b - a, *x.shape[1:]), dtype=gather_dtype or x.dtype, device=device)
                    got = gather_rows(x, a, b, senders[u], out if mine else None, gather_dtype)
                    if mine:
                        inputs[k] = got
    local = routes.local_plans[t]
    if not local.entries:
        return {}
    out = buf[: local.nbytes]
    return dict(convert_layer(inputs, routes.layer_idx, out=out, plan=local, check_finite=check_finite))
