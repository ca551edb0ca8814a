"""Scatter mode: each engine rank receives only the bytes of its shard (docs/layouts.md#scatter-mode).

Per layer the sender cuts every class's region (``glm_fp8.engine.pack``) out of the converted
layer buffer and broadcasts it within that class's process group (the sender and the ranks of the
class); headers and votes stay on the update's main link, so the failure semantics of
``glm_fp8.transfer.wire`` are unchanged. Ranks that hold the same bytes (data-parallel replicas,
or every rank for a layer that is replicated) share one broadcast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from glm_fp8.engine.layout import EngineLayout
from glm_fp8.engine.pack import ShardPack, layer_scatter, layout_words
from glm_fp8.plan import LayerPlan
from glm_fp8.transfer.wire import is_process_group, layer_checksum


def pack_regions(
    packs: Sequence[ShardPack],
    offsets: Sequence[int],
    full: Mapping[str, torch.Tensor],
    packed: torch.Tensor,
    scratch: torch.Tensor,
    starts: Mapping[str, int] | None = None,
) -> list[torch.Tensor]:
    """Cut each of ``packs`` (a layer's class regions, or a sender's segments) out of the entry
    views ``full`` (by prefixed name; ``starts``: see ``ShardPack.pack_into``) into ``packed``
    at ``offsets``, each followed by its checksum; returns the regions. ``scratch``:
    ``checksum_scratch`` of the largest."""
    regions = []
    for pack, offset in zip(packs, offsets):
        region = packed[offset : offset + pack.nbytes]
        pack.pack_into(full, region, starts)
        pack.checksum_word(region).copy_(layer_checksum(region[: pack.data_nbytes], scratch))
        regions.append(region)
    return regions


class Scatter:
    """The scatter plan of one update, the same on every rank of the link.

    ``engines[r]``: the ``EngineLayout`` of link rank ``r``, None at the sender's rank (one entry
    per rank of the link). ``groups`` maps each class (a tuple of link ranks) to its process group
    (the sender and the class), created by every process of the default group, in the same
    order: the link must span the default group's processes (``comm`` None, or a group of all).
    """

    def __init__(
        self,
        comm: object | None,
        src: int,
        config: Mapping,
        plans: Sequence[LayerPlan],
        layer_ids: Sequence[int],
        engines: Sequence[EngineLayout | None],
    ):
        if comm is not None and not is_process_group(comm):
            raise TypeError("engines: scatter mode needs a torch.distributed ProcessGroup (or None) as "
                            f"comm, got {type(comm).__name__}")  # fmt: skip
        world = dist.get_world_size(comm)
        engines = list(engines)
        if len(engines) != world:
            raise ValueError(
                f"engines: expected one entry per rank of the link ({world}), got {len(engines)}"
            )
        for r, lay in enumerate(engines):
            if (r == src) != (lay is None):
                raise ValueError(f"engines[{r}]: expected " + ("None (the sender)" if r == src else
                                 f"the EngineLayout of rank {r}, got None"))  # fmt: skip
            if lay is not None and not isinstance(lay, EngineLayout):
                raise TypeError(f"engines[{r}]: expected an EngineLayout, got {type(lay).__name__}")
        self.engines = engines
        self.layers = [layer_scatter(p, i, config, engines) for p, i in zip(plans, layer_ids)]
        # Every rank creates every group, in the same order (torch.distributed.new_group's rule:
        # every process of the default group takes part; with use_local_synchronization the
        # gloo groups deadlocked here).
        to_global = (lambda r: r) if comm is None else (lambda r: dist.get_global_rank(comm, r))
        self.src_global = to_global(src)
        self.groups: dict[tuple[int, ...], object] = {}
        for layer in self.layers:
            for ranks in layer.classes:
                if ranks not in self.groups:
                    self.groups[ranks] = dist.new_group(sorted(to_global(r) for r in (src, *ranks)))

    def my_class(self, pos: int, rank: int) -> int:
        return next(k for k, ranks in enumerate(self.layers[pos].classes) if rank in ranks)

    def manifest(self) -> dict:
        return {
            "engines": [layout_words(lay) for lay in self.engines],
            "regions": [[[list(c), p.nbytes] for c, p in zip(s.classes, s.packs)] for s in self.layers],
        }

    def bytes_per_rank(self) -> dict[int, int]:
        """Wire bytes each engine rank receives for the whole update."""
        out: dict[int, int] = {}
        for layer in self.layers:
            for ranks, pack in zip(layer.classes, layer.packs):
                for r in ranks:
                    out[r] = out.get(r, 0) + pack.nbytes
        return out


__all__ = ["Scatter", "pack_regions"]
