"""Model families: which trainer tensors a layer holds and which kernel-format entries they
become (docs/layouts.md), the trainers' layouts of those tensors (docs/trainers.md), and the
shapes and kind of a config's layers, read by ``glm_fp8.model.plans``. Presets and small test configs
live in ``glm_fp8.model.presets``, the DSA indexer's rules in ``glm_fp8.model.indexer``.
Adding a model family is one table of ``Rule`` rows in ``FAMILIES``, a shape function in
``SHAPES`` and its keys in ``glm_fp8.model.config.FAMILY_TRAITS``; adding a trainer layout, one table
in ``TRAINER_LAYOUTS``."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from glm_fp8.model.config import FAMILY_TRAITS, as_config, check_untied_vocab
from glm_fp8.model.indexer import INDEXER_FAMILIES, has_indexer, indexer_shapes


@dataclass(frozen=True)
class Rule:
    """One kernel-format output built from trainer tensors (names without the layer prefix)."""

    out: str
    sources: tuple[str, ...]  # row-concatenated (dim -2) in this order; prime-rl's names
    quantize: bool  # fp8 with 128x128 block scales; else copied in the entry's dtype
    squeeze: bool = False  # the trainer may hold a leading dim of 1 ([1, I, H] shared expert)
    optional: bool = False  # emitted only when the trainer layer has its sources
    group: str = ""  # "indexer": emitted all together or not at all (IndexShare layers have none)


def _r(out: str, *sources: str, q: bool = False, **kw) -> Rule:
    return Rule(out, sources or (out,), q, **kw)


# --- trainer layouts (docs/trainers.md#trainer-layouts) ------------------------------------------
# Trainers name the sparse MLP's tensors differently; every other tensor (norms, attention, the
# indexer, the dense MLP, the MTP layer's own, the non-layer ones) has the checkpoint's name in
# every layout. A source holding EXPERT is one 2-D tensor per routed expert j (0..E-1); the
# sources of a multi-source entry split its rows equally (gate rows, then up rows).
PRIME_RL, HF, HF_CHECKPOINT = "prime_rl", "hf", "hf_checkpoint"
EXPERT = "{j}"
_HF_ROUTER_AND_SHARED = {
    "mlp.gate.weight": ("mlp.gate.weight",),
    "mlp.gate.e_score_correction_bias": ("mlp.gate.e_score_correction_bias",),  # a float32 buffer
    "mlp.shared_experts.gate_up_proj.weight": (
        "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight",
    ),
    "mlp.shared_experts.down_proj.weight": ("mlp.shared_experts.down_proj.weight",),
}
TRAINER_LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    # prime-rl / torchtitan: stacks [E, I, H] (w1 gate, w3 up) and [E, H, I] (w2).
    PRIME_RL: {
        "mlp.gate.weight": ("mlp.router.gate.weight",),
        "mlp.gate.e_score_correction_bias": ("mlp.expert_bias",),
        "mlp.experts.w13_weight": ("mlp.experts.w1", "mlp.experts.w3"),
        "mlp.experts.w2_weight": ("mlp.experts.w2",),
        "mlp.shared_experts.gate_up_proj.weight": ("mlp.shared_expert.w1", "mlp.shared_expert.w3"),
        "mlp.shared_experts.down_proj.weight": ("mlp.shared_expert.w2",),
    },
    # transformers' modules (modeling_glm_moe_dsa.py, GlmMoeDsaNaiveMoe): gate_up_proj [E, 2I, H]
    # holds the gate rows first (forward's .chunk(2)), already w13's row order: one source.
    HF: {
        **_HF_ROUTER_AND_SHARED,
        "mlp.experts.w13_weight": ("mlp.experts.gate_up_proj",),
        "mlp.experts.w2_weight": ("mlp.experts.down_proj",),
    },
    # The checkpoint's per-expert names (what a WeightSource over a checkpoint-style model yields).
    HF_CHECKPOINT: {
        **_HF_ROUTER_AND_SHARED,
        "mlp.experts.w13_weight": (
            f"mlp.experts.{EXPERT}.gate_proj.weight",
            f"mlp.experts.{EXPERT}.up_proj.weight",
        ),
        "mlp.experts.w2_weight": (f"mlp.experts.{EXPERT}.down_proj.weight",),
    },
}
_PER_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def expert_index(name: str) -> int | None:
    """j of a per-expert checkpoint name ``mlp.experts.{j}.<gate|up|down>_proj.weight``, else None."""
    m = _PER_EXPERT.match(name)
    return int(m.group(1)) if m else None


def expert_sources(sources: tuple[str, ...], j: int) -> tuple[str, ...]:
    """Expert ``j``'s names of per-expert sources (``EXPERT`` replaced by ``j``)."""
    return tuple(s.replace(EXPERT, str(j)) for s in sources)


def layout_sources(layout: str, out: str) -> tuple[str, ...] | None:
    """The sources of entry ``out`` in trainer ``layout``; None where every layout has the same."""
    if layout not in TRAINER_LAYOUTS:
        raise ValueError(f"layout: expected one of {sorted(TRAINER_LAYOUTS)}, got {layout!r}")
    return TRAINER_LAYOUTS[layout].get(out)


_PR = TRAINER_LAYOUTS[PRIME_RL]

# Output order follows docs/layouts.md; a quantized entry's scale follows it.
_NORMS = [_r("input_layernorm.weight"), _r("post_attention_layernorm.weight")]
_MLA_ATTENTION = [
    _r(
        "self_attn.fused_qkv_a_proj.weight",
        "self_attn.q_a_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        q=True,
    ),
    _r("self_attn.q_a_layernorm.weight"),
    _r("self_attn.kv_a_layernorm.weight"),
    _r("self_attn.q_b_proj.weight", q=True),
    _r("self_attn.kv_b_proj.weight", q=True),
    _r("self_attn.o_proj.weight", q=True),
]
_INDEXER = [
    _r("self_attn.indexer.wq_b.weight", q=True, group="indexer"),
    _r(
        "self_attn.indexer.wk_weights_proj.weight",
        "self_attn.indexer.wk.weight",
        "self_attn.indexer.weights_proj.weight",
        group="indexer",
    ),
    _r("self_attn.indexer.k_norm.weight", group="indexer"),
    _r("self_attn.indexer.k_norm.bias", group="indexer"),
]
_MLA_DSA_ATTENTION = _MLA_ATTENTION + _INDEXER
FUSED_INDEXER = "self_attn.indexer.wk_weights_proj.weight"
# The indexer "split" (glm_fp8.core.vocab.IndexerForm): wk block-FP8, weights_proj as it is, in
# place of FUSED_INDEXER (SGLang 0.5.23 when the config does not interleave the indexer's rotary).
SPLIT_INDEXER = [
    _r("self_attn.indexer.wk.weight", q=True, group="indexer"),
    _r("self_attn.indexer.weights_proj.weight", group="indexer"),
]


def with_indexer_form(rules: list[Rule], form: str) -> list[Rule]:
    """``rules`` with the indexer's wk / weights_proj in ``form``: "fused" as they are, "split" with
    ``SPLIT_INDEXER`` in place of ``FUSED_INDEXER``, "both" with ``SPLIT_INDEXER`` after it."""
    if form == "fused":
        return rules
    out: list[Rule] = []
    for r in rules:
        if r.out == FUSED_INDEXER:
            out += [r, *SPLIT_INDEXER] if form == "both" else SPLIT_INDEXER
        else:
            out.append(r)
    return out


def indexer_entry_form(name: str) -> str | None:
    """The indexer form (``glm_fp8.core.vocab.IndexerForm``) whose entry ``name`` is (relative to its
    layer or with its prefix): "fused" for ``FUSED_INDEXER``, "split" for ``SPLIT_INDEXER``'s, None
    for any other entry (a quantized entry's ``_scale_inv`` is its weight's)."""
    name = name.removesuffix("_scale_inv")
    if name.endswith(FUSED_INDEXER):
        return "fused"
    return "split" if any(name.endswith(r.out) for r in SPLIT_INDEXER) else None


_GQA_ATTENTION = [
    _r(
        "self_attn.qkv_proj.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        q=True,
    ),
    _r(
        "self_attn.qkv_proj.bias",
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
        optional=True,
    ),
    _r("self_attn.q_norm.weight", optional=True),
    _r("self_attn.k_norm.weight", optional=True),
    _r("self_attn.o_proj.weight", q=True),
]
_DENSE_MLP = [
    _r("mlp.gate_up_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", q=True),
    _r("mlp.down_proj.weight", q=True),
]
# The routing bias is optional: vLLM builds it only with topk_method "noaux_tc" (layer_shapes).
_MOE_MLP = [
    _r("mlp.gate.weight", *_PR["mlp.gate.weight"]),
    _r("mlp.gate.e_score_correction_bias", *_PR["mlp.gate.e_score_correction_bias"], optional=True),
    _r("mlp.experts.w13_weight", *_PR["mlp.experts.w13_weight"], q=True),
    _r("mlp.experts.w2_weight", *_PR["mlp.experts.w2_weight"], q=True),
    _r(
        "mlp.shared_experts.gate_up_proj.weight",
        *_PR["mlp.shared_experts.gate_up_proj.weight"],
        q=True,
        squeeze=True,
    ),
    _r(
        "mlp.shared_experts.down_proj.weight",
        *_PR["mlp.shared_experts.down_proj.weight"],
        q=True,
        squeeze=True,
    ),
]

# The MTP layer's own tensors (beside a sparse layer's; docs/layouts.md#mtp-layer-glm-5-layer-78)
# and the model's non-layer tensors: never quantized, passed through in the trainer's dtype.
MTP_RULES = [
    _r("enorm.weight"),
    _r("hnorm.weight"),
    _r("eh_proj.weight"),
    _r("shared_head.norm.weight"),
    _r("shared_head.head.weight"),
]
REST_RULES = [_r("model.embed_tokens.weight"), _r("model.norm.weight"), _r("lm_head.weight")]
REST = -1  # the layer index the non-layer tensors travel under (their names carry no prefix)

# Qwen3-MoE: no shared experts and no routing bias (vLLM 0.34 qwen3_moe.py::Qwen3MoeSparseMoeBlock).
_QWEN3_MOE_MLP = [
    _r("mlp.gate.weight", *_PR["mlp.gate.weight"]),
    _r("mlp.experts.w13_weight", *_PR["mlp.experts.w13_weight"], q=True),
    _r("mlp.experts.w2_weight", *_PR["mlp.experts.w2_weight"], q=True),
]

FAMILIES: dict[str, tuple[list[Rule], list[Rule], list[Rule]]] = {
    # model_type: (attention + norms, dense MLP, sparse MLP)
    "glm_moe_dsa": (_NORMS + _MLA_DSA_ATTENTION, _DENSE_MLP, _MOE_MLP),
    "deepseek_v32": (_NORMS + _MLA_DSA_ATTENTION, _DENSE_MLP, _MOE_MLP),
    "deepseek_v3": (_NORMS + _MLA_ATTENTION, _DENSE_MLP, _MOE_MLP),
    "kimi_k2": (_NORMS + _MLA_ATTENTION, _DENSE_MLP, _MOE_MLP),
    "glm4_moe": (_NORMS + _GQA_ATTENTION, _DENSE_MLP, _MOE_MLP),
    "qwen3_moe": (_NORMS + _GQA_ATTENTION, _DENSE_MLP, _QWEN3_MOE_MLP),
}
# Passthrough entries vLLM 0.34 builds in float32 whatever the model dtype
# (docs/layouts.md#names-dtypes-shards-glm-5): plans from a config write them so.
FLOAT32_ENTRIES = frozenset(
    {"self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias", "mlp.gate.e_score_correction_bias"}
)
_FLOAT32_GLM4 = FLOAT32_ENTRIES | {"mlp.gate.weight"}  # glm4_moe.py: GateLinear(params_dtype=torch.float32)


def float32_entries(model_type: str) -> frozenset[str]:
    """Entries (short kernel-format names) the engine holds in float32 for ``model_type``."""
    return _FLOAT32_GLM4 if model_type == "glm4_moe" else FLOAT32_ENTRIES


def _mla_shapes(c: Mapping, sparse: bool, indexer: bool = True) -> dict[str, tuple[int, ...]]:
    """MLA with a q LoRA (GLM-5, DeepSeek-V3 / V3.2, Kimi-K2), plus the DSA indexer when the
    family has one and ``indexer`` (False: an IndexShare "shared" layer)."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    ql, kvl = c["q_lora_rank"], c["kv_lora_rank"]
    shapes = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_a_proj.weight": (ql, h),
        "self_attn.kv_a_proj_with_mqa.weight": (kvl + rope, h),
        "self_attn.q_a_layernorm.weight": (ql,),
        "self_attn.kv_a_layernorm.weight": (kvl,),
        "self_attn.q_b_proj.weight": (heads * (nope + rope), ql),
        "self_attn.kv_b_proj.weight": (heads * (nope + v), kvl),
        "self_attn.o_proj.weight": (h, heads * v),
    }
    if indexer and c["model_type"] in INDEXER_FAMILIES:
        shapes.update(indexer_shapes(c))
    return {**shapes, **_mlp_shapes(c, sparse)}


def _gqa_shapes(c: Mapping, sparse: bool, indexer: bool = True) -> dict[str, tuple[int, ...]]:
    """GQA (GLM-4.5, Qwen3-MoE): q/k/v/o, the bias with ``attention_bias``, q/k norms with
    ``use_qk_norm`` (always for Qwen3-MoE)."""
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // heads
    shapes = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (heads * hd, h),
        "self_attn.k_proj.weight": (kv * hd, h),
        "self_attn.v_proj.weight": (kv * hd, h),
        "self_attn.o_proj.weight": (h, heads * hd),
    }
    if c.get("attention_bias"):
        shapes.update(
            {
                "self_attn.q_proj.bias": (heads * hd,),
                "self_attn.k_proj.bias": (kv * hd,),
                "self_attn.v_proj.bias": (kv * hd,),
            }
        )
    if c.get("use_qk_norm") or c["model_type"] == "qwen3_moe":
        shapes.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    return {**shapes, **_mlp_shapes(c, sparse)}


def _mlp_shapes(c: Mapping, sparse: bool) -> dict[str, tuple[int, ...]]:
    """prime-rl's names (``TRAINER_LAYOUTS[PRIME_RL]``); the routing bias only where the engine
    builds it (``has_routing_bias``)."""
    h = c["hidden_size"]
    if not sparse:
        inter = c["intermediate_size"]
        return {
            "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
        }
    traits = FAMILY_TRAITS[c["model_type"]]
    e, i = c[traits.experts], c["moe_intermediate_size"]
    shapes = {"mlp.router.gate.weight": (e, h)}
    if has_routing_bias(c):
        shapes["mlp.expert_bias"] = (e,)
    shapes.update({"mlp.experts.w1": (e, i, h), "mlp.experts.w3": (e, i, h), "mlp.experts.w2": (e, h, i)})
    if traits.shared_experts:
        si = i * c["n_shared_experts"]
        shapes.update(
            {
                "mlp.shared_expert.w1": (1, si, h),
                "mlp.shared_expert.w3": (1, si, h),
                "mlp.shared_expert.w2": (1, h, si),
            }
        )
    return shapes


def has_routing_bias(config: Mapping) -> bool:
    """vLLM 0.34 builds ``mlp.gate.e_score_correction_bias`` only when ``config.topk_method ==
    "noaux_tc"`` (deepseek_v2.py ~line 327; the same rule in glm4_moe.py and the DeepSeek-V3.2 /
    GLM-5 models). A config of such a family without ``topk_method`` is taken as "noaux_tc": every
    released GLM and DeepSeek-V3 config.json says so, and the trainers always hold the bias."""
    c = as_config(config)
    return FAMILY_TRAITS[c["model_type"]].routing_bias and c.get("topk_method", "noaux_tc") == "noaux_tc"


# (config, sparse, indexer) -> trainer shapes; ``indexer`` matters only for INDEXER_FAMILIES.
SHAPES: dict[str, Callable[..., dict[str, tuple[int, ...]]]] = {
    "glm_moe_dsa": _mla_shapes,
    "deepseek_v32": _mla_shapes,
    "deepseek_v3": _mla_shapes,
    "kimi_k2": _mla_shapes,
    "glm4_moe": _gqa_shapes,
    "qwen3_moe": _gqa_shapes,
}


def mtp_layer_index(config: object) -> int | None:
    """The MTP layer's index (``num_hidden_layers``) when the config has one, else None. Only one
    MTP layer (``num_nextn_predict_layers`` 1) is supported (``as_config`` refuses more)."""
    c = as_config(config)
    return c["num_hidden_layers"] if c.get("num_nextn_predict_layers") == 1 else None


def model_layer_ids(config: object, *, mtp: bool = True) -> list[int]:
    """Every decoder layer of a config, then its MTP layer when it has one (and ``mtp``): the
    ``layer_ids`` of a whole-model update. A trainer that does not model the MTP layer (Hugging
    Face's ``GlmMoeDsa*``) updates ``model_layer_ids(config, mtp=False)``."""
    c = as_config(config)
    ids = list(range(c["num_hidden_layers"]))
    m = mtp_layer_index(c)
    return ids + [m] if mtp and m is not None else ids


def rest_shapes(config: object) -> dict[str, tuple[int, ...]]:
    """Trainer shapes of the non-layer tensors (embeddings, final norm, untied lm_head)."""
    c = as_config(config)
    check_untied_vocab(c, "the non-layer tensors", "its own tensor")
    v, h = c["vocab_size"], c["hidden_size"]
    return {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}


def is_sparse_layer(config: object, layer_idx: int) -> bool:
    """The one dense-or-sparse rule: transformers' ``mlp_layer_types`` when the config has it,
    else layers from ``first_k_dense_replace`` on hold experts (``as_config`` makes the two
    agree); Qwen3-MoE: vLLM's rule (``qwen3_moe.py::Qwen3MoeDecoderLayer``), a layer not in
    ``mlp_only_layers`` with ``(layer_idx + 1) % decoder_sparse_step == 0``. The MTP layer
    (index ``num_hidden_layers``) is sparse."""
    c = as_config(config)
    if layer_idx >= c["num_hidden_layers"]:
        return True
    if FAMILY_TRAITS[c["model_type"]].dense == "qwen3":
        step = c.get("decoder_sparse_step") or 1
        return layer_idx not in (c.get("mlp_only_layers") or ()) and (layer_idx + 1) % step == 0
    types = c.get("mlp_layer_types")
    if types is not None:
        return types[layer_idx] == "sparse"
    return layer_idx >= c["first_k_dense_replace"]


def layer_kind(config: object, layer_idx: int) -> str:
    """The kind of layer ``layer_idx``, which decides its plan: "dense" or "sparse" (MLP), with
    "/no-indexer" for a layer of an indexer family that the schedule shares and "/no-bias" for a
    sparse layer of a family with a routing bias that the config's engine does not build."""
    c = as_config(config)
    sparse = is_sparse_layer(c, layer_idx)
    kind = "sparse" if sparse else "dense"
    if c["model_type"] in INDEXER_FAMILIES and not has_indexer(c, layer_idx):
        kind += "/no-indexer"
    if sparse and FAMILY_TRAITS[c["model_type"]].routing_bias and not has_routing_bias(c):
        kind += "/no-bias"
    return kind


def layer_shapes(config: object, layer_idx: int) -> dict[str, tuple[int, ...]]:
    """Trainer tensor shapes of layer ``layer_idx`` of a config (prime-rl's names, without the
    prefix): a decoder layer, the MTP layer (a sparse layer and its own tensors) or ``REST`` (the
    non-layer tensors under their full names)."""
    c = as_config(config)
    if layer_idx == REST:
        return rest_shapes(c)
    n = c["num_hidden_layers"]
    mtp = mtp_layer_index(c)
    if (
        isinstance(layer_idx, bool)
        or not isinstance(layer_idx, int)
        or (not 0 <= layer_idx < n and layer_idx != mtp)
    ):
        extra = f" or {mtp} (the MTP layer)" if mtp is not None else ""
        raise ValueError(
            f"layer_idx: expected 0..{n - 1}{extra} or {REST} (the non-layer tensors), got {layer_idx!r}"
        )
    shapes = SHAPES[c["model_type"]](c, is_sparse_layer(c, layer_idx), has_indexer(c, layer_idx))
    if layer_idx == mtp:
        if "vocab_size" not in c:
            raise ValueError("config.vocab_size: required for the MTP layer's shared_head.head")
        h, v = c["hidden_size"], c["vocab_size"]
        shapes.update(
            {
                "enorm.weight": (h,),
                "hnorm.weight": (h,),
                "eh_proj.weight": (h, 2 * h),
                "shared_head.norm.weight": (h,),
                "shared_head.head.weight": (v, h),
            }
        )
    return shapes


def _known_sources() -> dict[str, frozenset[str]]:
    """Every trainer name a layer can hold, and the layouts that use it (all of them for a name
    outside ``TRAINER_LAYOUTS``)."""
    every = frozenset(TRAINER_LAYOUTS)
    known: dict[str, set[str]] = {}
    for attention, dense, sparse in FAMILIES.values():
        for rule in attention + dense + sparse + MTP_RULES + REST_RULES:
            for s in rule.sources:
                known.setdefault(s, set())
    for layout, table in TRAINER_LAYOUTS.items():
        for sources in table.values():
            for s in sources:
                if EXPERT not in s:
                    known.setdefault(s, set()).add(layout)
    return {s: frozenset(layouts) or every for s, layouts in known.items()}


# trainer name -> the layouts that hold it; a per-expert name (expert_index) is HF_CHECKPOINT's.
SOURCE_LAYOUTS = _known_sources()
# Names only sparse MLPs hold, in some layout (per-expert names aside).
SPARSE_SOURCES = frozenset(
    s for t in TRAINER_LAYOUTS.values() for v in t.values() for s in v if EXPERT not in s
)
SHARED_EXPERT_SOURCES = frozenset(
    s
    for t in TRAINER_LAYOUTS.values()
    for out, v in t.items()
    if out.startswith("mlp.shared_experts.")
    for s in v
)


def is_sparse_names(names: object) -> bool:
    """True when a layer's tensor names (short) are a sparse MLP's, in any trainer layout."""
    return any(n in SPARSE_SOURCES or expert_index(n) is not None for n in names)


def infer_model_type(names: set[str]) -> str:
    """The rule set for a layer's tensors (short names, any trainer layout): MLA layers plan as
    ``glm_moe_dsa`` (its indexer entries are emitted only when the layer holds
    ``self_attn.indexer.*``, which covers DeepSeek-V3 / V3.2 and Kimi-K2), GQA layers as
    ``glm4_moe``, or ``qwen3_moe`` when a sparse layer has no shared expert."""
    if "self_attn.q_a_proj.weight" in names:
        return "glm_moe_dsa"
    if "self_attn.q_proj.weight" in names:
        if is_sparse_names(names) and not any(n in SHARED_EXPERT_SOURCES for n in names):
            return "qwen3_moe"
        return "glm4_moe"
    raise ValueError(
        "state_dict: cannot tell the model family (no self_attn.q_a_proj.weight or "
        f"self_attn.q_proj.weight); known families: {sorted(FAMILIES)}"
    )
