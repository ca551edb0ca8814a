"""Where a vLLM 0.34 engine rank sits and how a tensor is cut for it: the parallel layout of one
rank (``EngineLayout``, docs/layouts.md#parallel-sizes and #expert-placement: the linear strategy),
the cut of one parameter out of the full kernel-format tensor (``Shard``) and the copy that applies
it (``copy_shard_into``, ``take_shard``). Which cut each entry gets is ``glm_fp8.engine.rules``
(``ShardRules``, ``shard_for``); its names stay reachable here for old imports (``_Rules`` is
``ShardRules``). Not modelled: pipeline parallelism (``pipeline_parallel_size`` 1 is assumed),
prefill context parallelism, EPLB / redundant experts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from glm_fp8.core.checks import check_int
from glm_fp8.model.families import indexer_entry_form

# config/parallel.py::ParallelConfig.use_sequence_parallel_moe ("pplx" and "naive" are rewritten
# to "allgather_reducescatter" by ParallelConfig before that check).
SP_MOE_ALL2ALL_BACKENDS = frozenset(
    {
        "allgather_reducescatter",
        "deepep_high_throughput",
        "deepep_low_latency",
        "deepep_v2",
        "flashinfer_nvlink_one_sided",
        "passthrough",
        "mori_high_throughput",
        "mori_low_latency",
        "mori",
        "nixl_ep",
        "pplx",
        "naive",
    }
)
VOCAB_PAD = 64  # vocab_parallel_embedding.py::DEFAULT_VOCAB_PADDING_SIZE (vLLM and SGLang)
SHARD_KINDS = ("replicated", "rows", "cols", "merged_rows", "qkv_rows", "experts", "vocab")


def _check_int(field: str, value: object, minimum: int) -> int:
    return check_int(f"EngineLayout.{field}", value, minimum)


@dataclass(frozen=True)
class EngineLayout:
    """The parallel position of one vLLM 0.34 worker (docs/layouts.md#parallel-sizes).

    Attention, the dense MLP, the shared experts and the vocabulary are sharded over the
    attention TP group (``tp_size``, ``tp_rank``). Routed experts are sharded over the flattened
    MoE group of size ``T = tp_size * dp_size`` and rank ``t = dp_rank * tp_size + tp_rank``:
    by experts when ``ep_size > 1`` (then vLLM sets ``ep_size = T``, ``ep_rank = t``), else by
    their intermediate dim (MoE TP over T).

    ``sequence_parallel_moe``: vLLM's ``use_sequence_parallel_moe``, under which the dense MLP and
    the shared experts of GLM-5 are replicated. ``None`` derives it as vLLM does with its default
    all2all backend: on when EP is on, ``tp_size > 1`` and ``dp_size > 1``.
    """

    engine: ClassVar[str] = "vllm"  # whose parameters (names, groups): glm_fp8.engine.sglang has the other

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    sequence_parallel_moe: bool | None = None

    def __post_init__(self) -> None:
        # Stored as plain ints (check_int takes numpy's and torch's too): layouts go into JSON manifests.
        for size in ("tp_size", "ep_size", "dp_size"):
            object.__setattr__(self, size, _check_int(size, getattr(self, size), 1))
        for rank, size in (("tp_rank", "tp_size"), ("dp_rank", "dp_size"), ("ep_rank", "ep_size")):
            object.__setattr__(self, rank, _check_int(rank, getattr(self, rank), 0))
            if getattr(self, rank) >= getattr(self, size):
                raise ValueError(
                    f"EngineLayout.{rank}: expected 0 <= {rank} < {size}={getattr(self, size)}, "
                    f"got {getattr(self, rank)}"
                )
        t, rank = self.moe_group_size, self.moe_group_rank
        if self.ep_size > 1 and self.ep_size != t:
            raise ValueError(
                f"EngineLayout.ep_size: with expert parallelism vLLM uses ep_size = tp_size * dp_size "
                f"= {t} (FusedMoEParallelConfig.make, docs/layouts.md#parallel-sizes), got {self.ep_size}"
            )
        if self.ep_size > 1 and self.ep_rank != rank:
            raise ValueError(
                f"EngineLayout.ep_rank: with expert parallelism vLLM uses ep_rank = dp_rank * tp_size + "
                f"tp_rank = {rank} (docs/layouts.md#parallel-sizes), got {self.ep_rank}"
            )
        sp = self.sequence_parallel_moe
        if sp is not None and not isinstance(sp, bool):
            raise ValueError(f"EngineLayout.sequence_parallel_moe: expected None or a bool, got {sp!r}")
        if sp and not (self.ep_size > 1 and self.tp_size > 1 and self.dp_size > 1):
            raise ValueError(
                "EngineLayout.sequence_parallel_moe: vLLM turns it on only with expert parallelism, "
                f"tp_size > 1 and dp_size > 1 (got ep_size={self.ep_size}, tp_size={self.tp_size}, "
                f"dp_size={self.dp_size}; docs/layouts.md#parallel-sizes)"
            )

    @classmethod
    def from_vllm(
        cls,
        tp_size: int,
        tp_rank: int,
        dp_size: int = 1,
        dp_rank: int = 0,
        enable_expert_parallel: bool = False,
        all2all_backend: str = "allgather_reducescatter",
    ) -> EngineLayout:
        """The layout vLLM derives from ``tensor_parallel_size``, ``data_parallel_size``,
        ``enable_expert_parallel`` and ``all2all_backend`` (FusedMoEParallelConfig.make,
        ParallelConfig.use_sequence_parallel_moe)."""
        for field, value in (("tp_size", tp_size), ("dp_size", dp_size)):
            _check_int(field, value, 1)
        t = tp_size * dp_size
        ep = bool(enable_expert_parallel) and t > 1
        sp = ep and tp_size > 1 and dp_size > 1 and all2all_backend in SP_MOE_ALL2ALL_BACKENDS
        ep_rank = (
            dp_rank * tp_size + tp_rank if ep and isinstance(tp_rank, int) and isinstance(dp_rank, int) else 0
        )
        return cls(tp_size, tp_rank, t if ep else 1, ep_rank, dp_size, dp_rank, sp)

    @classmethod
    def all_ranks(
        cls,
        tp_size: int,
        dp_size: int = 1,
        enable_expert_parallel: bool = False,
        all2all_backend: str = "allgather_reducescatter",
    ) -> list[EngineLayout]:
        """Every rank of one engine, in MoE-group rank order (``dp_rank * tp_size + tp_rank``)."""
        return [
            cls.from_vllm(tp_size, r, dp_size, d, enable_expert_parallel, all2all_backend)
            for d in range(dp_size)
            for r in range(tp_size)
        ]

    @property
    def moe_group_size(self) -> int:
        """T = tp_size * dp_size, the flattened MoE group (flatten_tp_across_dp_and_pcp)."""
        return self.tp_size * self.dp_size

    @property
    def moe_group_rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank

    @property
    def expert_parallel(self) -> bool:
        return self.ep_size > 1

    @property
    def moe_tp_size(self) -> int:
        """How many ranks split each routed expert's intermediate dim: 1 under EP, else T."""
        return 1 if self.expert_parallel else self.moe_group_size

    @property
    def moe_tp_rank(self) -> int:
        return 0 if self.expert_parallel else self.moe_group_rank

    @property
    def sp_moe(self) -> bool:
        """``sequence_parallel_moe`` resolved (vLLM's default all2all backend when it is None)."""
        if self.sequence_parallel_moe is not None:
            return self.sequence_parallel_moe
        return self.expert_parallel and self.tp_size > 1 and self.dp_size > 1

    def mlp_group(self, shared: bool, model_type: str) -> tuple[int, int]:
        """(size, rank) of the group that splits the dense MLP (``shared`` False) or the shared
        experts: the attention TP group, or none (size 1) under sequence-parallel MoE for GLM-5
        (docs/layouts.md#parallel-sizes)."""
        if self.tp_size == 1 or (self.sp_moe and model_type == "glm_moe_dsa"):
            return 1, 0
        return self.tp_size, self.tp_rank

    def vocab_group(self, head: bool) -> tuple[int, int]:
        """(size, rank) of the group that splits the vocabulary of the embedding (``head`` False) or
        of ``lm_head``: the attention TP group for both in vLLM 0.34."""
        return self.tp_size, self.tp_rank

    def indexer_form(self, config: Mapping) -> str:
        """How this rank holds a DSA indexer's wk / weights_proj (``glm_fp8.core.vocab.IndexerForm``):
        vLLM 0.34 fuses them into the bf16 ``wk_weights_proj`` whatever the config."""
        return "fused"

    def holds(self, config: Mapping, name: str) -> bool:
        """Whether this rank holds the kernel-format entry ``name`` (with its layer's prefix): every
        entry but the indexer's of the form it does not hold (an update of both forms sends each
        rank its own)."""
        form = indexer_entry_form(name)
        return form is None or form == self.indexer_form(config)

    def padded_vocab(self, vocab: int, size: int) -> int:
        """The rows of the padded table a group of ``size`` splits: ceil(V / 64) * 64 in vLLM, which
        asserts that ``size`` divides it (ShardRules refuses where it does not)."""
        return math.ceil(vocab / VOCAB_PAD) * VOCAB_PAD

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """Global ids [start, stop) of the routed experts this rank holds: all without EP; under EP
        vLLM's "linear" placement (expert_map_manager.py::determine_expert_map,
        docs/layouts.md#expert-placement): base = E // ep, rem = E % ep, rank q holds
        base + (q < rem) experts starting at q * base + min(q, rem)."""
        if not self.expert_parallel:
            return 0, num_experts
        base, rem = divmod(num_experts, self.ep_size)
        q = self.ep_rank
        start = q * base + min(q, rem)
        return start, start + base + (q < rem)


@dataclass(frozen=True)
class Shard:
    """How one rank's parameter is cut from the full kernel-format tensor.

    ``parts`` are [start, stop) ranges along ``dim`` (a negative dim: -1 columns, -2 rows, -3 the
    experts of a 3-D stack) of the full tensor, whose length there is ``full``; the rank's tensor
    is their concatenation in order followed by ``pad`` zero rows. ``replicated`` has no parts:
    the rank holds the full tensor. Kinds: "replicated", "rows", "cols", "merged_rows" ([gate
    part ; up part]), "qkv_rows" ([q part ; k part ; v part]), "experts", "vocab" (the padded
    vocabulary's row range, rows >= V zero). ``group`` / ``group_size`` name the parallel group
    the cut is over ("tp", "moe_tp", "ep"), for messages.
    """

    kind: str
    dim: int | None = None
    parts: tuple[tuple[int, int], ...] = ()
    pad: int = 0
    full: int = 0
    group: str = ""
    group_size: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SHARD_KINDS:
            raise ValueError(f"Shard.kind: expected one of {SHARD_KINDS}, got {self.kind!r}")

    @property
    def is_view(self) -> bool:
        """True when the cut is a plain narrow of the full tensor (``take_shard`` returns a view)."""
        return self.kind == "replicated" or (len(self.parts) == 1 and self.pad == 0)

    def cuts_rows(self, ndim: int) -> bool:
        """The cut is along dim 0 of an ``ndim``-D tensor (experts under EP, vocabulary rows)."""
        return self.kind != "replicated" and self.dim is not None and self.dim % ndim == 0

    @property
    def length(self) -> int:
        """The rank's size along ``dim``."""
        return sum(b - a for a, b in self.parts) + self.pad

    def shape(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        """The rank's shape, given the full kernel-format shape."""
        full_shape = tuple(int(s) for s in full_shape)
        if self.kind == "replicated":
            return full_shape
        self._check_full(full_shape)
        out = list(full_shape)
        out[self.dim] = self.length
        return tuple(out)

    def _check_full(self, full_shape: tuple[int, ...]) -> None:
        if len(full_shape) < -self.dim or full_shape[self.dim] != self.full:
            raise ValueError(
                f"Shard({self.kind}): expected a full tensor of size {self.full} along dim "
                f"{self.dim}, got shape {list(full_shape)}"
            )


def take_shard(full: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The rank's tensor cut from ``full``: a view when ``shard.is_view``, else a new tensor (the
    reference for ``copy_shard_into``; a sender should copy into the engine parameter instead)."""
    if shard.kind == "replicated":
        return full
    shard._check_full(tuple(full.shape))
    if shard.is_view:
        a, b = shard.parts[0]
        return full.narrow(shard.dim, a, b - a)
    out = torch.empty(shard.shape(full.shape), dtype=full.dtype, device=full.device)
    return copy_shard_into(out, full, shard)


def copy_shard_into(dst: torch.Tensor, full: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Write the rank's cut of ``full`` into ``dst`` (the engine parameter) part by part, with no
    full-size temporary; padded rows (vocab past V) are zeroed. Returns ``dst``."""
    if dst.dtype != full.dtype:
        raise ValueError(
            f"copy_shard_into: dst dtype {dst.dtype} differs from the source's {full.dtype} "
            "(the copy never converts)"
        )
    expected = shard.shape(full.shape)
    if tuple(dst.shape) != expected:
        raise ValueError(
            f"copy_shard_into: dst shape {list(dst.shape)}, expected {list(expected)} for a "
            f"{shard.kind} shard of a {list(full.shape)} tensor"
        )
    if shard.kind == "replicated":
        return dst.copy_(full)
    offset = 0
    for a, b in shard.parts:
        dst.narrow(shard.dim, offset, b - a).copy_(full.narrow(shard.dim, a, b - a))
        offset += b - a
    if shard.pad:
        dst.narrow(shard.dim, offset, shard.pad).zero_()
    return dst


__all__ = [
    "SHARD_KINDS",
    "SP_MOE_ALL2ALL_BACKENDS",
    "VOCAB_PAD",
    "EngineLayout",
    "Shard",
    "copy_shard_into",
    "take_shard",
]
