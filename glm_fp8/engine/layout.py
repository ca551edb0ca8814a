"""How a vLLM 0.34 engine rank holds each kernel-format entry: the parallel layout of one rank
(``EngineLayout``), the cut of one parameter out of the full kernel-format tensor (``Shard``,
``shard_for``) and the copy that applies it (``copy_shard_into``, ``take_shard``).

Every rule here is read from docs/layouts.md, "Engine side (vLLM 0.34)": "Parallel sizes" (which
group shards what), "Names, dtypes, shards (GLM-5)" and the GLM-4.5 note (the per-entry table),
"Expert placement" (the linear strategy) and "Shard-size rules" (what vLLM refuses, and the
refined MoE scale grid this module refuses in its turn). Not modelled: pipeline parallelism
(``pipeline_parallel_size`` 1 is assumed), prefill context parallelism, EPLB / redundant
experts, ``VLLM_REPLICATE_EMBED=1`` and the padded-TP MoE loading of an explicit
``--moe-backend``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from glm_fp8.config import as_config
from glm_fp8.models import SHAPES
from glm_fp8.numerics import BLOCK, ceil_blocks
from glm_fp8.plan import build_plan

VOCAB_PAD = 64  # vocab_parallel_embedding.py::DEFAULT_VOCAB_PADDING_SIZE
# config/parallel.py::ParallelConfig.use_sequence_parallel_moe ("pplx" and "naive" are rewritten
# to "allgather_reducescatter" by ParallelConfig before that check).
SP_MOE_ALL2ALL_BACKENDS = frozenset({
    "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
    "flashinfer_nvlink_one_sided", "passthrough", "mori_high_throughput", "mori_low_latency", "mori",
    "nixl_ep", "pplx", "naive",
})  # fmt: skip
SHARD_KINDS = ("replicated", "rows", "cols", "merged_rows", "qkv_rows", "experts", "vocab")

# --- which rule each kernel-format entry follows (names without ``model.layers.{i}.``) -------------
MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
           "shared_head.head.weight")  # fmt: skip
NON_LAYER = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
_REPLICATED = frozenset({
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.fused_qkv_a_proj.weight", "self_attn.q_a_layernorm.weight",
    "self_attn.kv_a_layernorm.weight", "self_attn.indexer.wq_b.weight",
    "self_attn.indexer.wk_weights_proj.weight", "self_attn.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
    "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "model.norm.weight",
})  # fmt: skip
_ATTN_ROWS = frozenset({"self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight"})
_ATTN_COLS = frozenset({"self_attn.o_proj.weight"})
_MLP_COLS = frozenset({"mlp.down_proj.weight", "mlp.shared_experts.down_proj.weight"})
_MLP_MERGED = frozenset({"mlp.gate_up_proj.weight", "mlp.shared_experts.gate_up_proj.weight"})
_QKV = frozenset({"self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"})
_EXPERTS = frozenset({"mlp.experts.w13_weight", "mlp.experts.w2_weight"})
_VOCAB = frozenset({"model.embed_tokens.weight", "lm_head.weight", "shared_head.head.weight"})
_DOC = "docs/layouts.md#shard-size-rules"


def _check_int(field: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"EngineLayout.{field}: expected an int >= {minimum}, got {value!r}")


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

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    sequence_parallel_moe: bool | None = None

    def __post_init__(self) -> None:
        for size in ("tp_size", "ep_size", "dp_size"):
            _check_int(size, getattr(self, size), 1)
        for rank, size in (("tp_rank", "tp_size"), ("dp_rank", "dp_size"), ("ep_rank", "ep_size")):
            _check_int(rank, getattr(self, rank), 0)
            if getattr(self, rank) >= getattr(self, size):
                raise ValueError(f"EngineLayout.{rank}: expected 0 <= {rank} < {size}={getattr(self, size)}, "
                                 f"got {getattr(self, rank)}")  # fmt: skip
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
        return [cls.from_vllm(tp_size, r, dp_size, d, enable_expert_parallel, all2all_backend)
                for d in range(dp_size) for r in range(tp_size)]  # fmt: skip

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
            raise ValueError(f"Shard({self.kind}): expected a full tensor of size {self.full} along dim "
                             f"{self.dim}, got shape {list(full_shape)}")  # fmt: skip


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
        raise ValueError(f"copy_shard_into: dst dtype {dst.dtype} differs from the source's {full.dtype} "
                         "(the copy never converts)")  # fmt: skip
    expected = shard.shape(full.shape)
    if tuple(dst.shape) != expected:
        raise ValueError(f"copy_shard_into: dst shape {list(dst.shape)}, expected {list(expected)} for a "
                         f"{shard.kind} shard of a {list(full.shape)} tensor")  # fmt: skip
    if shard.kind == "replicated":
        return dst.copy_(full)
    offset = 0
    for a, b in shard.parts:
        dst.narrow(shard.dim, offset, b - a).copy_(full.narrow(shard.dim, a, b - a))
        offset += b - a
    if shard.pad:
        dst.narrow(shard.dim, offset, shard.pad).zero_()
    return dst


# --- the rules ------------------------------------------------------------------------------------


def split_name(name: str) -> tuple[int | None, str]:
    """(layer index or None, name relative to the layer) of a kernel-format or vLLM name: strips
    ``model.layers.{i}.``, the MTP ``mtp_block.`` level and the ``routed_experts.`` level, so
    ``model.layers.78.mtp_block.mlp.experts.routed_experts.w13_weight`` -> (78,
    ``mlp.experts.w13_weight``). Non-layer names and names without the prefix give None."""
    if name in NON_LAYER or not name.startswith("model.layers."):
        return None, name
    idx, _, rest = name[len("model.layers.") :].partition(".")
    if not idx.isdigit() or not rest:
        raise ValueError(f"{name}: expected model.layers.<int>.<name>")
    rest = rest.removeprefix("mtp_block.").replace("mlp.experts.routed_experts.", "mlp.experts.")
    return int(idx), rest


def kernel_entry_shapes(config: object, *, quantize: bool = True) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Full kernel-format shape and fp8-ness of every entry a model config can hold, by name
    relative to its layer (dense and sparse layers merged, MTP-own and non-layer names too)."""
    config = as_config(config)
    model_type = config["model_type"]
    h = config["hidden_size"]
    table: dict[str, tuple[tuple[int, ...], bool]] = {}
    for sparse in (False, True):
        if not sparse and "intermediate_size" not in config:
            continue
        inputs = {k: (s, torch.bfloat16) for k, s in SHAPES[model_type](config, sparse).items()}
        for e in build_plan(model_type, inputs, quantize=quantize).entries:
            table[e.name] = (tuple(e.shape), e.op == "quantize")
    table.update({"model.norm.weight": ((h,), False), "enorm.weight": ((h,), False),
                  "hnorm.weight": ((h,), False), "eh_proj.weight": ((h, 2 * h), False),
                  "shared_head.norm.weight": ((h,), False)})  # fmt: skip
    if "vocab_size" in config:
        v = config["vocab_size"]
        for n in _VOCAB:
            table[n] = ((v, h), False)
    return table


class _Rules:
    """The per-entry rules of docs/layouts.md#names-dtypes-shards-glm-5 for one config and rank."""

    def __init__(
        self, config: object, layout: EngineLayout, quantize: bool = True, table: dict | None = None
    ) -> None:
        if not isinstance(layout, EngineLayout):
            raise TypeError(f"layout: expected an EngineLayout, got {type(layout).__name__}")
        self.config, self.layout, self.quantize = as_config(config), layout, quantize
        self.table = kernel_entry_shapes(config, quantize=quantize) if table is None else table
        self.suggest = True  # errors name the sizes that would work (off while trying those sizes)

    def _fits(self, layout: EngineLayout) -> bool:
        """Whether every entry of the model shards as vLLM accepts at ``layout``."""
        trial = _Rules(self.config, layout, self.quantize, self.table)
        trial.suggest = False
        try:
            for name, (shape, _) in self.table.items():
                trial.shard(name, shape)
        except ValueError:
            return False
        return True

    def _valid_tp_sizes(self, ep: bool) -> list[int]:
        """The tensor-parallel sizes (divisors of num_attention_heads, which vLLM requires) at which
        every rank of this layout's data-parallel size, with expert parallelism or not, holds
        every parameter as vLLM accepts. Sequence-parallel MoE is this layout's setting under its
        own EP choice, else what vLLM derives with its default all2all backend."""
        lay, heads = self.layout, self.config["num_attention_heads"]
        sp = lay.sequence_parallel_moe
        out = []
        for t in (d for d in range(1, heads + 1) if heads % d == 0):
            # Every TP rank of one replica: the data-parallel rank moves only the MoE rank, and no
            # check of a MoE shard depends on which rank holds it.
            ranks = [EngineLayout.from_vllm(t, r, lay.dp_size, 0, ep) for r in range(t)]
            if sp is not None and ep == lay.expert_parallel:  # this layout's SP-MoE, where vLLM allows it
                ranks = [dataclasses.replace(x, sequence_parallel_moe=sp and x.sp_moe) for x in ranks]
            if all(self._fits(x) for x in ranks):
                out.append(t)
        return out

    def _change(self) -> str:
        """What to change, for an error about this layout's sizes: the tensor-parallel sizes that
        fit the model with this data-parallel size, with and without expert parallelism."""
        if not self.suggest:
            return ""
        lay = self.layout
        ep = lay.expert_parallel
        sizes = self._valid_tp_sizes(ep)
        where = f"data_parallel_size {lay.dp_size}, expert parallelism {'on' if ep else 'off'}"
        msg = (f"; for this model ({where}) the valid tensor-parallel sizes are "
               f"{', '.join(map(str, sizes)) or 'none'}")  # fmt: skip
        if sizes:
            msg += ": set vLLM's --tensor-parallel-size (EngineLayout tp_size) to one of them"
        if not ep:
            more = [t for t in self._valid_tp_sizes(True) if t not in sizes]
            if more:  # only where expert parallelism lifts the MoE TP limit
                msg += (f"{', or' if sizes else ';'} turn on expert parallelism (--enable-expert-parallel), "
                        f"with which tensor-parallel sizes {', '.join(map(str, more))} fit too")  # fmt: skip
        return msg

    def shard(self, name: str, full_shape: Sequence[int]) -> Shard:
        _, short = split_name(name)
        full_shape = tuple(int(s) for s in full_shape)
        if short not in self.table:
            hint = "" if "vocab_size" in self.config else " (config has no vocab_size)"
            raise ValueError(f"{name}: not a parameter of a {self.config['model_type']} engine{hint}")
        expected, fp8 = self.table[short]
        if full_shape != expected:
            raise ValueError(f"{name}: full kernel-format shape {list(full_shape)} does not match the "
                             f"config's {list(expected)}")  # fmt: skip
        if not short.endswith("_scale_inv"):
            return self._weight(name, short, full_shape, fp8)
        base = short[: -len("_scale_inv")]
        w_shape, _ = self.table[base]
        try:
            ws = self._weight(name[: -len("_scale_inv")], base, w_shape, True)
        except ValueError as e:
            raise ValueError(f"{name}: the scale of a weight that cannot be sharded: {e}") from None
        if ws.kind in ("replicated", "experts"):
            return ws
        n = w_shape[ws.dim]
        parts = tuple((a // BLOCK, ceil_blocks(b)) for a, b in ws.parts)
        return Shard(ws.kind, ws.dim, parts, 0, ceil_blocks(n), ws.group, ws.group_size)

    # -- helpers
    def _split(self, name: str, what: str, n: int, size: int, rank: int, group: str) -> tuple[int, int]:
        if n % size:
            raise ValueError(f"{name}: {what} {n} is not divisible by the {group} size {size} "
                             f"(vLLM's divide() asserts it){self._change()}")  # fmt: skip
        per = n // size
        return rank * per, (rank + 1) * per

    def _aligned(self, name: str, shard: Shard, fp8: bool) -> Shard:
        if not fp8 or shard.kind == "replicated":
            return shard
        for a, b in shard.parts:
            if a % BLOCK or (b % BLOCK and b != shard.full):
                raise ValueError(
                    f"{name}: full size {shard.full} along dim {shard.dim} split over {shard.group} size "
                    f"{shard.group_size} ({shard.kind}) gives parts {list(shard.parts)}; vLLM requires every "
                    f"sharded part of a block-FP8 weight to be a multiple of {BLOCK} "
                    f"(validate_fp8_block_shape, {_DOC}){self._change()}"
                )
        return shard

    def _heads(self, name: str) -> None:
        heads, tp = self.config["num_attention_heads"], self.layout.tp_size
        if heads % tp:
            raise ValueError(
                f"{name}: num_attention_heads {heads} is not divisible by tp_size {tp}{self._change()}"
            )

    def _weight(self, name: str, short: str, shape: tuple[int, ...], fp8: bool) -> Shard:
        lay = self.layout
        tp, r = lay.tp_size, lay.tp_rank
        if short in _VOCAB:
            return self._vocab(name, shape[-2])
        if short in _EXPERTS:
            return self._experts(name, short, shape, fp8)
        if short in _REPLICATED:
            return Shard("replicated")
        mlp = short in _MLP_COLS or short in _MLP_MERGED
        if tp == 1 or (mlp and lay.sp_moe and self.config["model_type"] == "glm_moe_dsa"):
            return Shard("replicated")
        if short in _ATTN_ROWS or short in _ATTN_COLS:
            self._heads(name)
        if short in _ATTN_ROWS:
            a, b = self._split(name, "rows", shape[-2], tp, r, "tp")
            return self._aligned(name, Shard("rows", -2, ((a, b),), 0, shape[-2], "tp", tp), fp8)
        if short in _ATTN_COLS or short in _MLP_COLS:
            a, b = self._split(name, "columns", shape[-1], tp, r, "tp")
            return self._aligned(name, Shard("cols", -1, ((a, b),), 0, shape[-1], "tp", tp), fp8)
        if short in _MLP_MERGED:
            half = shape[-2] // 2
            a, b = self._split(name, "gate/up rows", half, tp, r, "tp")
            shard = Shard("merged_rows", -2, ((a, b), (half + a, half + b)), 0, shape[-2], "tp", tp)
            return self._aligned(name, shard, fp8)
        if short in _QKV:
            return self._qkv(name, short, shape, fp8)
        raise ValueError(f"{name}: no sharding rule for this entry")  # pragma: no cover

    def _vocab(self, name: str, v: int) -> Shard:
        """VocabParallelEmbedding / ParallelLMHead: the table padded to Vp = ceil(V/64)*64 rows, rank
        r holds rows [r*Vp/tp, (r+1)*Vp/tp), rows >= V zero (vocab_parallel_embedding.py)."""
        tp, r = self.layout.tp_size, self.layout.tp_rank
        vp = math.ceil(v / VOCAB_PAD) * VOCAB_PAD
        if tp == 1 and vp == v:
            return Shard("replicated")
        a, b = self._split(
            name, f"padded vocabulary Vp = ceil({v}/{VOCAB_PAD})*{VOCAB_PAD} =", vp, tp, r, "tp"
        )
        real = max(0, min(b, v) - a)
        parts = ((a, a + real),) if real else ()
        return Shard("vocab", -2, parts, (b - a) - real, v, "tp", tp)

    def _qkv(self, name: str, short: str, shape: tuple[int, ...], fp8: bool) -> Shard:
        """QKVParallelLinear.weight_loader: [q rows r/tp ; k rows of KV group g ; v rows of group g],
        g = r // (tp / kv) when tp >= kv (each KV head replicated tp/kv times), else kv/tp heads."""
        c, tp, r = self.config, self.layout.tp_size, self.layout.tp_rank
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim") or c["hidden_size"] // heads
        self._heads(name)
        if tp >= kv:
            if tp % kv:
                raise ValueError(
                    f"{name}: tp_size {tp} is not a multiple of num_key_value_heads {kv}{self._change()}"
                )
            g, kvs = r // (tp // kv), hd
        else:
            if kv % tp:
                raise ValueError(
                    f"{name}: num_key_value_heads {kv} is not divisible by tp_size {tp}{self._change()}"
                )
            g, kvs = r, kv // tp * hd
        q, kv_rows = heads * hd, kv * hd
        qs = q // tp
        parts = ((r * qs, (r + 1) * qs), (q + g * kvs, q + (g + 1) * kvs),
                 (q + kv_rows + g * kvs, q + kv_rows + (g + 1) * kvs))  # fmt: skip
        dim = -1 if short.endswith(".bias") else -2
        return self._aligned(name, Shard("qkv_rows", dim, parts, 0, shape[dim], "tp", tp), fp8)

    def _experts(self, name: str, short: str, shape: tuple[int, ...], fp8: bool) -> Shard:
        """RoutedExperts: under EP the rank's experts whole (linear placement); else every expert,
        w13 as [gate rows t/T ; up rows t/T] and w2 as columns t/T over the MoE group of size T."""
        lay, c = self.layout, self.config
        inter = c["moe_intermediate_size"]
        t_size, t = lay.moe_tp_size, lay.moe_tp_rank
        if inter % t_size:
            raise ValueError(f"{name}: moe_intermediate_size {inter} is not divisible by the MoE TP size "
                             f"{t_size} (tp_size * dp_size without EP){self._change()}")  # fmt: skip
        local = inter // t_size
        if fp8 and local % BLOCK:
            g = math.gcd(BLOCK, local, c["hidden_size"])
            what = (f"vLLM 0.34 then refines the block-scale grid to {g}x{g} (refine_fp8_moe_block_shape), a "
                    "layout glm_fp8 does not support yet" if g >= 32 else
                    "vLLM 0.34 refuses this layout (validate_fp8_block_shape_moe)")  # fmt: skip
            raise ValueError(
                f"{name}: routed experts' per-rank intermediate size {inter} / {t_size} = {local} "
                f"(MoE TP size {t_size}, EP size {lay.ep_size}) is not a multiple of {BLOCK}; {what} "
                f"({_DOC}){self._change()}"
            )
        if lay.expert_parallel:
            start, stop = lay.expert_range(shape[0])
            return Shard("experts", -3, ((start, stop),), 0, shape[0], "ep", lay.ep_size)
        if t_size == 1:
            return Shard("replicated")
        a, b = t * local, (t + 1) * local
        if short == "mlp.experts.w2_weight":
            return Shard("cols", -1, ((a, b),), 0, shape[-1], "moe_tp", t_size)
        return Shard("merged_rows", -2, ((a, b), (inter + a, inter + b)), 0, shape[-2], "moe_tp", t_size)


def shard_for(
    name: str, full_shape: Sequence[int], config: object, layout: EngineLayout, *, quantize: bool = True
) -> Shard:
    """How ``layout``'s rank holds the kernel-format entry ``name`` (or its vLLM name) of full shape
    ``full_shape``, for a block-FP8 checkpoint (``quantize``) or a bf16 one.

    Rules (docs/layouts.md#names-dtypes-shards-glm-5, "rows/cols r/tp" over the attention TP group):
    replicated: norms, ``fused_qkv_a_proj``, ``indexer.*``, ``mlp.gate.*``, MTP ``enorm``/``hnorm``/
    ``eh_proj``/``shared_head.norm``, ``model.norm``, GLM-4.5 ``q_norm``/``k_norm``; rows:
    ``q_b_proj``, ``kv_b_proj``; cols: ``o_proj``, dense and shared ``down_proj``; merged_rows: dense
    and shared ``gate_up_proj``; qkv_rows: GLM-4.5 ``qkv_proj`` (weight and bias); the dense and
    shared MLP are replicated under sequence-parallel MoE (GLM-5 only); routed experts: see
    ``_Rules._experts``; vocab: ``embed_tokens``, ``lm_head``, MTP ``shared_head.head``. A
    ``_scale_inv`` follows its weight in block units (row range [a, b) -> block rows
    [a/128, ceil(b/128))).

    Raises ValueError, naming the parameter, when vLLM 0.34 would refuse the layout (a sharded
    fp8 part not a multiple of 128, sizes not divisible) or would refine the routed experts' scale
    grid (docs/layouts.md#shard-size-rules; not supported yet).
    """
    return _Rules(config, layout, quantize).shard(name, full_shape)


__all__ = [
    "EngineLayout",
    "MTP_OWN",
    "NON_LAYER",
    "SHARD_KINDS",
    "Shard",
    "copy_shard_into",
    "kernel_entry_shapes",
    "shard_for",
    "split_name",
    "take_shard",
]
