"""Model families: which trainer tensors a layer holds and which kernel-format entries they
become (docs/layouts.md), the embedded presets, and the small configs that tests, the demo and
the CPU benchmarks use. Pure tables and the rules that read a config; the plan machinery that
lays entries out in a buffer is ``glm_fp8.plan``.

Adding a model family is one table of ``Rule`` rows in ``FAMILIES`` plus a shape function in
``SHAPES``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """One kernel-format output built from trainer tensors (names without the layer prefix)."""

    out: str
    sources: tuple[str, ...]  # row-concatenated (dim -2) in this order
    quantize: bool  # fp8 with 128x128 block scales; else copied in the source dtype
    squeeze: bool = False  # the trainer may hold a leading dim of 1 ([1, I, H] shared expert)
    optional: bool = False  # emitted only when the trainer layer has its sources


def _r(out: str, *sources: str, q: bool = False, **kw: bool) -> Rule:
    return Rule(out, sources or (out,), q, **kw)


# Output order follows docs/layouts.md; a quantized entry's scale follows it.
_NORMS = [_r("input_layernorm.weight"), _r("post_attention_layernorm.weight")]
_MLA_DSA_ATTENTION = [
    _r("self_attn.fused_qkv_a_proj.weight", "self_attn.q_a_proj.weight",
       "self_attn.kv_a_proj_with_mqa.weight", q=True),
    _r("self_attn.q_a_layernorm.weight"),
    _r("self_attn.kv_a_layernorm.weight"),
    _r("self_attn.q_b_proj.weight", q=True),
    _r("self_attn.kv_b_proj.weight", q=True),
    _r("self_attn.o_proj.weight", q=True),
    _r("self_attn.indexer.wq_b.weight", q=True),
    _r("self_attn.indexer.wk_weights_proj.weight", "self_attn.indexer.wk.weight",
       "self_attn.indexer.weights_proj.weight"),
    _r("self_attn.indexer.k_norm.weight"),
    _r("self_attn.indexer.k_norm.bias"),
]  # fmt: skip
_GQA_ATTENTION = [
    _r("self_attn.qkv_proj.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
       "self_attn.v_proj.weight", q=True),
    _r("self_attn.qkv_proj.bias", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
       "self_attn.v_proj.bias", optional=True),
    _r("self_attn.q_norm.weight", optional=True),
    _r("self_attn.k_norm.weight", optional=True),
    _r("self_attn.o_proj.weight", q=True),
]  # fmt: skip
_DENSE_MLP = [
    _r("mlp.gate_up_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", q=True),
    _r("mlp.down_proj.weight", q=True),
]
_MOE_MLP = [
    _r("mlp.gate.weight", "mlp.router.gate.weight"),
    _r("mlp.gate.e_score_correction_bias", "mlp.expert_bias"),
    _r("mlp.experts.w13_weight", "mlp.experts.w1", "mlp.experts.w3", q=True),
    _r("mlp.experts.w2_weight", "mlp.experts.w2", q=True),
    _r("mlp.shared_experts.gate_up_proj.weight", "mlp.shared_expert.w1", "mlp.shared_expert.w3",
       q=True, squeeze=True),
    _r("mlp.shared_experts.down_proj.weight", "mlp.shared_expert.w2", q=True, squeeze=True),
]  # fmt: skip

# The MTP layer's own tensors (beside a sparse layer's; docs/layouts.md#mtp-layer-glm-5-layer-78)
# and the model's non-layer tensors: never quantized, passed through in the trainer's dtype.
MTP_RULES = [_r("enorm.weight"), _r("hnorm.weight"), _r("eh_proj.weight"), _r("shared_head.norm.weight"),
             _r("shared_head.head.weight")]  # fmt: skip
REST_RULES = [_r("model.embed_tokens.weight"), _r("model.norm.weight"), _r("lm_head.weight")]
REST = -1  # the layer index the non-layer tensors travel under (their names carry no prefix)

FAMILIES: dict[str, tuple[list[Rule], list[Rule], list[Rule]]] = {
    # model_type: (attention + norms, dense MLP, sparse MLP)
    "glm_moe_dsa": (_NORMS + _MLA_DSA_ATTENTION, _DENSE_MLP, _MOE_MLP),
    "glm4_moe": (_NORMS + _GQA_ATTENTION, _DENSE_MLP, _MOE_MLP),
}


def _glm_moe_dsa_shapes(c: Mapping, sparse: bool) -> dict[str, tuple[int, ...]]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    ql, kvl = c["q_lora_rank"], c["kv_lora_rank"]
    ih, idim = c["index_n_heads"], c["index_head_dim"]
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
        "self_attn.indexer.wq_b.weight": (ih * idim, ql),
        "self_attn.indexer.wk.weight": (idim, h),
        "self_attn.indexer.weights_proj.weight": (ih, h),
        "self_attn.indexer.k_norm.weight": (idim,),
        "self_attn.indexer.k_norm.bias": (idim,),
    }
    return {**shapes, **_mlp_shapes(c, sparse)}


def _glm4_moe_shapes(c: Mapping, sparse: bool) -> dict[str, tuple[int, ...]]:
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
    if c.get("attention_bias", False):
        shapes.update({"self_attn.q_proj.bias": (heads * hd,), "self_attn.k_proj.bias": (kv * hd,),
                       "self_attn.v_proj.bias": (kv * hd,)})  # fmt: skip
    if c.get("use_qk_norm", False):
        shapes.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    return {**shapes, **_mlp_shapes(c, sparse)}


def _mlp_shapes(c: Mapping, sparse: bool) -> dict[str, tuple[int, ...]]:
    h = c["hidden_size"]
    if not sparse:
        inter = c["intermediate_size"]
        return {"mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                "mlp.down_proj.weight": (h, inter)}  # fmt: skip
    e, i = c["n_routed_experts"], c["moe_intermediate_size"]
    si = i * c.get("n_shared_experts", 1)
    return {
        "mlp.router.gate.weight": (e, h),
        "mlp.expert_bias": (e,),
        "mlp.experts.w1": (e, i, h),
        "mlp.experts.w3": (e, i, h),
        "mlp.experts.w2": (e, h, i),
        "mlp.shared_expert.w1": (1, si, h),
        "mlp.shared_expert.w3": (1, si, h),
        "mlp.shared_expert.w2": (1, h, si),
    }


SHAPES: dict[str, Callable[[Mapping, bool], dict[str, tuple[int, ...]]]] = {
    "glm_moe_dsa": _glm_moe_dsa_shapes,
    "glm4_moe": _glm4_moe_shapes,
}

# Embedded configs (the fields the plans read), so `glm-fp8 plan` needs no download.
PRESETS: dict[str, dict] = {
    "glm-5": {  # docs/layouts.md
        "model_type": "glm_moe_dsa", "hidden_size": 6144, "num_hidden_layers": 78,
        "first_k_dense_replace": 3, "n_routed_experts": 256, "moe_intermediate_size": 2048,
        "n_shared_experts": 1, "intermediate_size": 12288, "num_attention_heads": 64,
        "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64, "v_head_dim": 256, "index_n_heads": 32, "index_head_dim": 128,
        "vocab_size": 154880, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    },
    "glm-4.5": {  # zai-org/GLM-4.5 config.json
        "model_type": "glm4_moe", "hidden_size": 5120, "num_hidden_layers": 92,
        "first_k_dense_replace": 3, "n_routed_experts": 160, "moe_intermediate_size": 1536,
        "n_shared_experts": 1, "intermediate_size": 12288, "num_attention_heads": 96,
        "num_key_value_heads": 8, "head_dim": 128, "attention_bias": True, "use_qk_norm": True,
    },
}  # fmt: skip


# GLM-5 with every width divided by 24 (hidden 256, 11 experts): the demo's and the CPU
# benchmarks' model, small enough for Triton's CPU interpreter.
SMALL_GLM5 = {
    "model_type": "glm_moe_dsa", "hidden_size": 256, "num_hidden_layers": 4,
    "first_k_dense_replace": 1, "n_routed_experts": 11, "moe_intermediate_size": 88,
    "n_shared_experts": 1, "intermediate_size": 512, "num_attention_heads": 4,
    "q_lora_rank": 88, "kv_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
    "v_head_dim": 12, "index_n_heads": 2, "index_head_dim": 8,
}  # fmt: skip

# Each preset scaled down with sizes that are not multiples of 128, so that blocks straddle
# every concatenation: the converter's test configs.
SMALL_CONFIGS = {
    "glm-5": {
        **PRESETS["glm-5"], "hidden_size": 200, "num_hidden_layers": 3, "first_k_dense_replace": 1,
        "n_routed_experts": 3, "moe_intermediate_size": 72, "intermediate_size": 150,
        "num_attention_heads": 2, "q_lora_rank": 130, "kv_lora_rank": 70, "qk_nope_head_dim": 24,
        "qk_rope_head_dim": 8, "v_head_dim": 40, "index_n_heads": 3, "index_head_dim": 24,
    },
    "glm-4.5": {
        **PRESETS["glm-4.5"], "hidden_size": 200, "num_hidden_layers": 3, "first_k_dense_replace": 1,
        "n_routed_experts": 3, "moe_intermediate_size": 72, "intermediate_size": 150,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 40,
    },
}  # fmt: skip


# GLM-5 shrunk so that every width vLLM shards is a multiple of 128 per rank at TP=2, EP=2 and
# TP=2 x DP=2 without EP (MoE TP over 4: moe_intermediate 512 / 4 = 128); vocab 1000 is not a
# multiple of 64 (padded to 1024). At TP=4 o_proj's 256 columns give 64 per rank: refused.
TINY_GLM5 = {
    "model_type": "glm_moe_dsa", "hidden_size": 256, "num_hidden_layers": 4, "first_k_dense_replace": 2,
    "n_routed_experts": 4, "moe_intermediate_size": 512, "n_shared_experts": 1, "intermediate_size": 512,
    "num_attention_heads": 4, "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64, "v_head_dim": 64, "index_n_heads": 2, "index_head_dim": 64,
    "vocab_size": 1000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
}  # fmt: skip


def load_config(model: str | None = None, config_path: str | None = None) -> dict:
    """A preset by name ("glm-5", "glm-4.5") or a Hugging Face config.json."""
    if config_path:
        with open(config_path) as f:
            return json.load(f)
    if model not in PRESETS:
        raise ValueError(f"model: expected one of {sorted(PRESETS)}, got {model!r}")
    return dict(PRESETS[model])


def mtp_layer_index(config: Mapping) -> int | None:
    """The MTP layer's index (``num_hidden_layers``) when the config has one, else None. Only one
    MTP layer (``num_nextn_predict_layers`` 1) is supported."""
    n = config.get("num_nextn_predict_layers") or 0
    if n not in (0, 1):
        raise ValueError(f"config.num_nextn_predict_layers: only 0 or 1 MTP layer is supported, got {n!r}")
    return config["num_hidden_layers"] if n == 1 else None


def model_layer_ids(config: Mapping, *, mtp: bool = True) -> list[int]:
    """Every decoder layer of a config, then its MTP layer when it has one (and ``mtp``): the
    ``layer_ids`` of a whole-model update."""
    ids = list(range(config["num_hidden_layers"]))
    m = mtp_layer_index(config)
    return ids + [m] if mtp and m is not None else ids


def rest_shapes(config: Mapping) -> dict[str, tuple[int, ...]]:
    """Trainer shapes of the non-layer tensors (embeddings, final norm, untied lm_head)."""
    for key in ("vocab_size", "hidden_size"):
        if key not in config:
            raise ValueError(
                f"config.{key}: required for the non-layer tensors (e.g. vocab_size 154880 for GLM-5)"
            )
    if config.get("tie_word_embeddings", False):
        raise ValueError("config.tie_word_embeddings: tied embeddings are not supported (GLM's lm_head is "
                         "its own tensor)")  # fmt: skip
    v, h = config["vocab_size"], config["hidden_size"]
    return {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}


def is_sparse_layer(config: Mapping, layer_idx: int) -> bool:
    """The one dense-or-sparse rule: layers from ``first_k_dense_replace`` on hold experts."""
    return layer_idx >= config.get("first_k_dense_replace", 0)


def layer_shapes(config: Mapping, layer_idx: int) -> dict[str, tuple[int, ...]]:
    """Trainer tensor shapes of layer ``layer_idx`` of a config (names without the prefix): a
    decoder layer, the MTP layer (a sparse layer and its own tensors) or ``REST`` (the non-layer
    tensors under their full names)."""
    model_type = config.get("model_type")
    if model_type not in SHAPES:
        raise ValueError(f"config.model_type: expected one of {sorted(SHAPES)}, got {model_type!r}")
    if layer_idx == REST:
        return rest_shapes(config)
    n = config["num_hidden_layers"]
    mtp = mtp_layer_index(config)
    if not 0 <= layer_idx < n and layer_idx != mtp:
        extra = f" or {mtp} (the MTP layer)" if mtp is not None else ""
        raise ValueError(
            f"layer_idx: expected 0..{n - 1}{extra} or {REST} (the non-layer tensors), got {layer_idx}"
        )
    shapes = SHAPES[model_type](config, is_sparse_layer(config, layer_idx))
    if layer_idx == mtp:
        h, v = config["hidden_size"], config["vocab_size"]
        shapes.update({"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
                       "shared_head.norm.weight": (h,), "shared_head.head.weight": (v, h)})  # fmt: skip
    return shapes


def infer_model_type(names: set[str]) -> str:
    if "self_attn.q_a_proj.weight" in names:
        return "glm_moe_dsa"
    if "self_attn.q_proj.weight" in names:
        return "glm4_moe"
    raise ValueError(
        "state_dict: cannot tell the model family (no self_attn.q_a_proj.weight or "
        f"self_attn.q_proj.weight); known families: {sorted(FAMILIES)}"
    )
