"""Collecting sharded trainer weights (DTensors) on the sending rank, piece by piece.

Every function here is collective over the DTensor's mesh: all of its ranks call it with the
same arguments, and only ``dst`` (a global rank) receives. Supported layouts: a 1-D mesh with
one ``Shard(d)`` placement (FSDP2 and expert parallel shard dim 0) or ``Replicate``; anything
else is gathered whole with ``full_tensor()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


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
    n, w = t.shape[dim], len(ranks)
    size = -(-n // w)  # torch.chunk: ceil-sized pieces first, trailing ranks may hold nothing
    bounds = tuple((min(r * size, n), min((r + 1) * size, n)) for r in range(w))
    return ShardLayout(mesh.get_group(), ranks, dim, bounds)


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
