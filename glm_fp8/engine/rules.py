"""Which cut of the full kernel-format tensor a vLLM 0.34 engine rank holds, entry by entry
(``ShardRules``, ``shard_for``), with the names and shapes those rules read (``split_name``,
``kernel_entry_shapes``, ``MTP_OWN``, ``NON_LAYER``). The layout and the cut themselves are
``glm_fp8.engine.layout`` (``EngineLayout``, ``Shard``).

Every rule here is read from docs/layouts.md, "Engine side (vLLM 0.34)": "Parallel sizes" (which
group shards what), "Names, dtypes, shards (GLM-5)" and the GLM-4.5 note (the per-entry table)
and "Shard-size rules" (what vLLM refuses, and the refined MoE scale grid this module refuses in
its turn). Not modelled: ``VLLM_REPLICATE_EMBED=1`` and the padded-TP MoE loading of an explicit
``--moe-backend``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from glm_fp8.core.numerics import BLOCK, ceil_blocks
from glm_fp8.core.vocab import INDEXER_FORMS
from glm_fp8.engine.layout import EngineLayout, Shard
from glm_fp8.model.config import as_config
from glm_fp8.model.families import SHAPES
from glm_fp8.model.plans import build_plan

# --- which rule each kernel-format entry follows (names without ``model.layers.{i}.``) -------------
MTP_OWN = (
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
)
NON_LAYER = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
_REPLICATED = frozenset(
    {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.fused_qkv_a_proj.weight",
        "self_attn.q_a_layernorm.weight",
        "self_attn.kv_a_layernorm.weight",
        "self_attn.indexer.wq_b.weight",
        "self_attn.indexer.wk_weights_proj.weight",
        "self_attn.indexer.wk.weight",
        "self_attn.indexer.weights_proj.weight",
        "self_attn.indexer.k_norm.weight",
        "self_attn.indexer.k_norm.bias",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias",
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "model.norm.weight",
    }
)
_ATTN_ROWS = frozenset({"self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight"})
_ATTN_COLS = frozenset({"self_attn.o_proj.weight"})
_MLP_COLS = frozenset({"mlp.down_proj.weight", "mlp.shared_experts.down_proj.weight"})
_MLP_MERGED = frozenset({"mlp.gate_up_proj.weight", "mlp.shared_experts.gate_up_proj.weight"})
_QKV = frozenset({"self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"})
_EXPERTS = frozenset({"mlp.experts.w13_weight", "mlp.experts.w2_weight"})
_VOCAB = frozenset({"model.embed_tokens.weight", "lm_head.weight", "shared_head.head.weight"})
_DOC = "docs/layouts.md#shard-size-rules"


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
    relative to its layer (dense and sparse layers merged, both indexer forms, MTP-own and
    non-layer names too)."""
    config = as_config(config)
    model_type = config["model_type"]
    h = config["hidden_size"]
    table: dict[str, tuple[tuple[int, ...], bool]] = {}
    for sparse in (False, True):
        if not sparse and "intermediate_size" not in config:
            continue
        inputs = {k: (s, torch.bfloat16) for k, s in SHAPES[model_type](config, sparse).items()}
        for form in INDEXER_FORMS:
            for e in build_plan(model_type, inputs, quantize=quantize, indexer_form=form).entries:
                table[e.name] = (tuple(e.shape), e.op == "quantize")
    table.update(
        {
            "model.norm.weight": ((h,), False),
            "enorm.weight": ((h,), False),
            "hnorm.weight": ((h,), False),
            "eh_proj.weight": ((h, 2 * h), False),
            "shared_head.norm.weight": ((h,), False),
        }
    )
    if "vocab_size" in config:
        v = config["vocab_size"]
        for n in _VOCAB:
            table[n] = ((v, h), False)
    return table


class ShardRules:
    """The per-entry rules of docs/layouts.md#names-dtypes-shards-glm-5 for one config and rank.

    ``shard(name, full_shape)`` is ``shard_for`` without rebuilding the config's entry table
    (``kernel_entry_shapes``, or ``table`` when given) on every call: build one per config, layout
    and ``quantize`` when cutting many entries."""

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
        trial = ShardRules(self.config, layout, self.quantize, self.table)
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
        if not self.suggest or self.layout.engine != "vllm":  # the sizes tried are vLLM's
            return ""
        lay = self.layout
        ep = lay.expert_parallel
        sizes = self._valid_tp_sizes(ep)
        where = f"data_parallel_size {lay.dp_size}, expert parallelism {'on' if ep else 'off'}"
        msg = (
            f"; for this model ({where}) the valid tensor-parallel sizes are "
            f"{', '.join(map(str, sizes)) or 'none'}"
        )
        if sizes:
            msg += ": set vLLM's --tensor-parallel-size (EngineLayout tp_size) to one of them"
        if not ep:
            more = [t for t in self._valid_tp_sizes(True) if t not in sizes]
            if more:  # only where expert parallelism lifts the MoE TP limit
                msg += (
                    f"{', or' if sizes else ';'} turn on expert parallelism (--enable-expert-parallel), "
                    f"with which tensor-parallel sizes {', '.join(map(str, more))} fit too"
                )
        return msg

    def shard(self, name: str, full_shape: Sequence[int]) -> Shard:
        _, short = split_name(name)
        full_shape = tuple(int(s) for s in full_shape)
        if short not in self.table:
            hint = "" if "vocab_size" in self.config else " (config has no vocab_size)"
            raise ValueError(f"{name}: not a parameter of a {self.config['model_type']} engine{hint}")
        expected, fp8 = self.table[short]
        if full_shape != expected:
            raise ValueError(
                f"{name}: full kernel-format shape {list(full_shape)} does not match the "
                f"config's {list(expected)}"
            )
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
            raise ValueError(
                f"{name}: {what} {n} is not divisible by the {group} size {size} "
                f"(vLLM's divide() asserts it){self._change()}"
            )
        per = n // size
        return rank * per, (rank + 1) * per

    def _aligned(self, name: str, shard: Shard, fp8: bool) -> Shard:
        if not fp8 or shard.kind == "replicated":
            return shard
        for a, b in shard.parts:
            if a % BLOCK or (b % BLOCK and b != shard.full):
                raise ValueError(
                    f"{name}: full size {shard.full} along dim {shard.dim} split over {shard.group} size "
                    f"{shard.group_size} ({shard.kind}) gives parts {list(shard.parts)}; {self._engine} "
                    f"requires every sharded part of a block-FP8 weight to be a multiple of {BLOCK} "
                    f"(validate_fp8_block_shape, {_DOC}){self._change()}"
                )
        return shard

    @property
    def _engine(self) -> str:
        """The engine, for messages (SGLang's Fp8LinearMethod checks what vLLM's does)."""
        return "SGLang" if self.layout.engine == "sglang" else "vLLM"

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
        if short in _MLP_COLS or short in _MLP_MERGED:
            return self._mlp(name, short, shape, fp8)
        if tp == 1:
            return Shard("replicated")
        if short in _ATTN_ROWS or short in _ATTN_COLS:
            self._heads(name)
        if short in _ATTN_ROWS:
            a, b = self._split(name, "rows", shape[-2], tp, r, "tp")
            return self._aligned(name, Shard("rows", -2, ((a, b),), 0, shape[-2], "tp", tp), fp8)
        if short in _ATTN_COLS:
            a, b = self._split(name, "columns", shape[-1], tp, r, "tp")
            return self._aligned(name, Shard("cols", -1, ((a, b),), 0, shape[-1], "tp", tp), fp8)
        if short in _QKV:
            return self._qkv(name, short, shape, fp8)
        raise ValueError(f"{name}: no sharding rule for this entry")  # pragma: no cover

    def _mlp(self, name: str, short: str, shape: tuple[int, ...], fp8: bool) -> Shard:
        """The dense MLP and the shared experts, over the layout's MLP group (``mlp_group``): down
        by columns, gate_up as [gate part ; up part]."""
        shared = short.startswith("mlp.shared_experts.")
        size, r = self.layout.mlp_group(shared, self.config["model_type"])
        if size == 1:
            return Shard("replicated")
        if short in _MLP_COLS:
            a, b = self._split(name, "columns", shape[-1], size, r, "tp")
            return self._aligned(name, Shard("cols", -1, ((a, b),), 0, shape[-1], "tp", size), fp8)
        half = shape[-2] // 2
        a, b = self._split(name, "gate/up rows", half, size, r, "tp")
        shard = Shard("merged_rows", -2, ((a, b), (half + a, half + b)), 0, shape[-2], "tp", size)
        return self._aligned(name, shard, fp8)

    def _vocab(self, name: str, v: int) -> Shard:
        """VocabParallelEmbedding / ParallelLMHead: the table padded to Vp rows (``padded_vocab``:
        ceil(V/64)*64 in vLLM), rank r of the layout's vocabulary group (``vocab_group``) holds rows
        [r*Vp/size, (r+1)*Vp/size), rows >= V zero (vocab_parallel_embedding.py)."""
        lay = self.layout
        tp, r = lay.vocab_group(head=not name.endswith("embed_tokens.weight"))
        vp = lay.padded_vocab(v, tp)
        if tp == 1 and vp == v:
            return Shard("replicated")
        a, b = self._split(
            name, f"padded vocabulary (V = {v}, padded as {lay.engine} pads it) Vp =", vp, tp, r, "tp"
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
        parts = (
            (r * qs, (r + 1) * qs),
            (q + g * kvs, q + (g + 1) * kvs),
            (q + kv_rows + g * kvs, q + kv_rows + (g + 1) * kvs),
        )
        dim = -1 if short.endswith(".bias") else -2
        return self._aligned(name, Shard("qkv_rows", dim, parts, 0, shape[dim], "tp", tp), fp8)

    def _experts(self, name: str, short: str, shape: tuple[int, ...], fp8: bool) -> Shard:
        """RoutedExperts: under EP the rank's experts whole (linear placement); else every expert,
        w13 as [gate rows t/T ; up rows t/T] and w2 as columns t/T over the MoE group of size T."""
        lay, c = self.layout, self.config
        inter = c["moe_intermediate_size"]
        t_size, t = lay.moe_tp_size, lay.moe_tp_rank
        if inter % t_size:
            raise ValueError(
                f"{name}: moe_intermediate_size {inter} is not divisible by the MoE TP size "
                f"{t_size} (tp_size * dp_size without EP){self._change()}"
            )
        local = inter // t_size
        if fp8 and local % BLOCK:
            g = math.gcd(BLOCK, local, c["hidden_size"])
            what = (
                f"vLLM 0.34 then refines the block-scale grid to {g}x{g} (refine_fp8_moe_block_shape), a "
                "layout glm_fp8 does not support yet"
                if g >= 32
                else "vLLM 0.34 refuses this layout (validate_fp8_block_shape_moe)"
            )
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
    ``ShardRules._experts``; vocab: ``embed_tokens``, ``lm_head``, MTP ``shared_head.head``. A
    ``_scale_inv`` follows its weight in block units (row range [a, b) -> block rows
    [a/128, ceil(b/128))).

    Raises ValueError, naming the parameter, when vLLM 0.34 would refuse the layout (a sharded
    fp8 part not a multiple of 128, sizes not divisible) or would refine the routed experts' scale
    grid (docs/layouts.md#shard-size-rules; not supported yet).
    """
    return ShardRules(config, layout, quantize).shard(name, full_shape)


__all__ = [
    "MTP_OWN",
    "NON_LAYER",
    "ShardRules",
    "kernel_entry_shapes",
    "shard_for",
    "split_name",
]
