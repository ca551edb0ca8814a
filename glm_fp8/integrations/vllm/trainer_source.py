"""What a trainer rank reads each step on the vLLM backend's trainer side (docs/vllm.md#the-backend):
its source as layers (``trainer_source``: a ``LayerSource``, or the model's weights through
``WeightSourceLayers``), and, on a rank off the link, its part of the one sender's gathers
(``contribute``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from glm_fp8.core.checks import check_int
from glm_fp8.integrations.megatron import MegatronSource
from glm_fp8.integrations.vllm.sources import LayerSource, LazyMapping, WeightSourceLayers
from glm_fp8.model.families import REST, mtp_layer_index
from glm_fp8.transfer.gather import contribute_shards


def trainer_source(source: object, config: Mapping, *, rank: int, trainer_ranks: int, device: torch.device):
    """``source`` as ``TrainerSide`` reads it: layer ids, ``mtp``, ``experts_whole``, ``rest``,
    and per step ``begin_step``, ``session(layer_ids, rest)``, ``drain``; a Megatron-Core source
    also its ``senders`` (trainer ranks) and ``holders`` (link ranks)."""
    if isinstance(source, LayerSource):
        return _LayerSourceView(source, config)
    if isinstance(source, MegatronSource):
        return _MegatronView(source, config)
    return WeightSourceLayers(
        source,
        config,
        rank=rank,
        trainer_ranks=trainer_ranks,
        local=False,
        device=device,
    )


def contribute(
    source: object,
    layers,
    rest_map,
    ids,
    *,
    config: Mapping,
    gather: str,
    gather_dtype: torch.dtype | None,
    device: torch.device,
    go: Callable[[int], bool] = lambda pos: True,
) -> None:
    """A trainer rank off the link (one sender): its part of the sender's gathers, step by step,
    each once ``go(pos)`` says rank 0 gathers it too (``gate.GatherGate``)."""
    items = itertools.chain(layers, [(REST, rest_map)] if rest_map is not None else [])
    steps = len(ids) + int(rest_map is not None)

    def gated():
        for pos in range(steps):
            if not go(pos):
                return
            item = next(items, None)  # vLLM's iter_full gathers here (full_tensor per tensor)
            if item is None:
                return
            yield item

    if isinstance(source, (WeightSourceLayers, _MegatronView)):  # gathered as they are read
        for idx, tensors in gated():
            if idx == REST:
                dict(tensors)  # read when used: its full_tensor() gathers
        return
    contribute_shards(
        gated(),
        config=config,
        sender=0,
        gather=gather,
        gather_dtype=gather_dtype,
        device=device,
        layer_ids=[*ids, REST] if rest_map is not None else ids,
    )


class _MegatronView:
    """A ``MegatronSource`` as ``TrainerSide`` reads sources: many senders, each pipeline stage's
    holding its layers (``senders``, ``holders``); the ranks that do not send hand nothing. After
    ``send_whole()`` (the one-sender modes) it reads as one sender's source instead: every layer
    whole on trainer rank 0 (``MegatronSource.whole_layers``), gathered as the sender reads it,
    while every other rank runs its part of the same gathers (``contribute``)."""

    experts_whole = True
    rest = True

    def __init__(self, src: MegatronSource, config: Mapping):
        self.src = src
        mtp = mtp_layer_index(config)
        self.layer_ids = [i for i in src.layer_ids if i != mtp]
        self.stage_layer_ids = [i for i in src.stage_layer_ids if i != mtp]  # for steps of several layers
        self.mtp = mtp is not None and mtp in src.layer_ids
        self.senders, self.holders = list(src.senders), src.holders
        self.whole = False

    def send_whole(self, rank: int) -> None:
        """Read as one sender's source: trainer rank 0 is the link's only sender. ``rank``: this
        trainer rank, which must be its rank in ``torch.distributed``'s default group (the group
        Megatron's gathers run in, onto its rank 0)."""
        if dist.get_rank() != rank:
            raise ValueError(
                f"init_info.rank: {rank}, but this process is rank {dist.get_rank()} of torch.distributed's "
                "default group, where a Megatron-Core source gathers each layer onto rank 0; pass that rank"
            )
        self.whole = True

    def begin_step(self) -> None:
        return None

    def drain(self) -> None:
        return None

    def session(self, layer_ids, rest: bool):
        if self.whole:  # collectives over the default group, run as each layer (then the rest) is read
            return self.src.whole_layers(list(layer_ids)), (
                LazyMapping(self.src.whole_rest) if rest else None
            )
        return self.src.layers(list(layer_ids)), (self.src.rest() if rest else None)


class _LayerSourceView:
    """A ``LayerSource`` as ``TrainerSide`` reads sources."""

    def __init__(self, src: LayerSource, config: Mapping):
        self.src = src
        n = config["num_hidden_layers"]
        ids = range(n) if src.layer_ids is None else src.layer_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise ValueError(f"source.layer_ids: expected a list of layer indices, got {type(ids).__name__}")
        self.layer_ids = [
            check_int(f"source.layer_ids[{k}]", i, 0, n - 1, f" (a decoder layer of the {n})")
            for k, i in enumerate(ids)
        ]
        for key in ("mtp", "experts_whole"):
            if not isinstance(getattr(src, key), bool):
                raise ValueError(f"source.{key}: expected True or False, got {getattr(src, key)!r}")
        self.mtp, self.experts_whole = src.mtp, src.experts_whole
        self.rest = src.rest is not None

    def begin_step(self) -> None:
        return None

    def drain(self) -> None:
        return None

    def session(self, layer_ids, rest: bool):
        return self.src.layers(list(layer_ids)), (
            self.src.rest() if rest and self.src.rest is not None else None
        )


__all__ = ["contribute", "trainer_source"]
