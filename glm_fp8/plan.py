"""Layer plans: which kernel-format entries a trainer layer becomes, and where each one lives
in the layer's single broadcast buffer (shared/spec/vllm_layout.md).

A plan is built once per layer shape, from a model config (embedded presets or a config.json)
or inferred from one layer's state dict, and then reused for every update. Adding a model
family is one table of ``Rule`` rows in ``FAMILIES`` plus a shape function in ``SHAPES``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from glm_fp8.reference import ceil_blocks

ALIGN = 256  # bytes: every view is aligned for any dtype, and NCCL likes 256-byte chunks
TARGETS = ("hopper", "blackwell")
_DTYPE_NAMES = {
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int32: "int32",
}


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


# Output order follows vllm_layout.md; a quantized entry's scale follows it.
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
    "glm-5": {  # vllm_layout.md
        "model_type": "glm_moe_dsa", "hidden_size": 6144, "num_hidden_layers": 78,
        "first_k_dense_replace": 3, "n_routed_experts": 256, "moe_intermediate_size": 2048,
        "n_shared_experts": 1, "intermediate_size": 12288, "num_attention_heads": 64,
        "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64, "v_head_dim": 256, "index_n_heads": 32, "index_head_dim": 128,
    },
    "glm-4.5": {  # zai-org/GLM-4.5 config.json
        "model_type": "glm4_moe", "hidden_size": 5120, "num_hidden_layers": 92,
        "first_k_dense_replace": 3, "n_routed_experts": 160, "moe_intermediate_size": 1536,
        "n_shared_experts": 1, "intermediate_size": 12288, "num_attention_heads": 96,
        "num_key_value_heads": 8, "head_dim": 128, "attention_bias": True, "use_qk_norm": True,
    },
}  # fmt: skip


@dataclass(frozen=True)
class PlanEntry:
    """One named view of the layer buffer.

    ``op``: "quantize" (fp8 from ``sources``), "scale" (block scales of the entry before it),
    "concat" (sources copied row after row, in their dtype), "copy" (one source as it is).
    A Blackwell scale is int32 stored [G, P, align(N, 4)] and viewed as [G, N, P] (MN-major).
    """

    name: str
    op: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    sources: tuple[str, ...] = ()
    squeeze: bool = False
    storage_shape: tuple[int, ...] | None = None  # set when the view is not contiguous

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.storage_shape or self.shape)

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        raw = buffer[self.offset : self.offset + self.nbytes].view(self.dtype)
        if self.storage_shape is None:
            return raw.view(self.shape)
        return raw.view(self.storage_shape).transpose(-1, -2)[..., : self.shape[-2], :]


@dataclass(frozen=True)
class LayerPlan:
    """Every kernel-format entry of one layer, packed into one byte buffer of ``nbytes``."""

    kind: str  # "dense" or "sparse"
    target: str
    quantize: bool
    entries: tuple[PlanEntry, ...]
    inputs: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = field(default_factory=dict)
    nbytes: int = 0

    def views(self, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for e in self.entries:
            yield e.name, e.view(buffer)

    def manifest(self) -> list[dict]:
        """Data-only description (name, dtype, shape, offset, nbytes) of every entry."""
        return [
            {"name": e.name, "dtype": _DTYPE_NAMES[e.dtype], "shape": list(e.shape),
             "offset": e.offset, "nbytes": e.nbytes}
            for e in self.entries
        ]  # fmt: skip

    def input_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the trainer tensors this layer reads (in ``dtype`` if given)."""
        return sum(
            (dtype or dt or torch.bfloat16).itemsize * math.prod(shape) for shape, dt in self.inputs.values()
        )


def _align(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def _scale_entry(name: str, shape: tuple[int, ...], target: str, offset: int) -> PlanEntry:
    *g, n, k = shape
    nb = (ceil_blocks(n), ceil_blocks(k))
    if target == "hopper":
        return PlanEntry(name, "scale", torch.float32, (*g, *nb), offset)
    p = -(-nb[1] // 4)  # four ue8m0 exponent bytes per int32, DeepGEMM SM100
    return PlanEntry(name, "scale", torch.int32, (*g, n, p), offset, storage_shape=(*g, p, _align(n, 4)))


def build_plan(
    model_type: str,
    inputs: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
    *,
    target: str = "hopper",
    quantize: bool = True,
) -> LayerPlan:
    """Plan one layer from its trainer tensors' shapes and dtypes (dtype None: not known yet,
    the entry takes the source's dtype at conversion)."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type: expected one of {sorted(FAMILIES)}, got {model_type!r}")
    if target not in TARGETS:
        raise ValueError(f"target: expected one of {TARGETS}, got {target!r}")
    attention, dense, sparse = FAMILIES[model_type]
    kind = "sparse" if "mlp.experts.w1" in inputs else "dense"
    rules = attention + (sparse if kind == "sparse" else dense)
    entries: list[PlanEntry] = []
    offset = 0
    used: set[str] = set()
    for rule in rules:
        present = [s in inputs for s in rule.sources]
        if rule.optional and not any(present):
            continue
        for src, ok in zip(rule.sources, present):
            if not ok:
                raise KeyError(f"{src}: missing from the layer (needed for {rule.out})")
        used.update(rule.sources)
        shapes = [_squeezed(inputs[s][0], rule.squeeze) for s in rule.sources]
        rows = sum(s[-2] for s in shapes) if len(shapes[0]) >= 2 else sum(s[0] for s in shapes)
        shape = (*shapes[0][:-2], rows, shapes[0][-1]) if len(shapes[0]) >= 2 else (rows,)
        if rule.quantize and quantize:
            entries.append(PlanEntry(rule.out, "quantize", torch.float8_e4m3fn, shape, offset,
                                     rule.sources, rule.squeeze))  # fmt: skip
            offset = _align(offset + entries[-1].nbytes)
            entries.append(_scale_entry(rule.out + "_scale_inv", shape, target, offset))
        else:
            op = "copy" if len(rule.sources) == 1 else "concat"
            dtype = inputs[rule.sources[0]][1] or torch.bfloat16
            entries.append(PlanEntry(rule.out, op, dtype, shape, offset, rule.sources, rule.squeeze))
        offset = _align(offset + entries[-1].nbytes)
    extra = sorted(set(inputs) - used)
    if extra:
        raise KeyError(f"{extra[0]}: not a tensor of a {model_type} {kind} layer (no rule uses it)")
    return LayerPlan(kind, target, quantize, tuple(entries), dict(inputs), offset)


def _squeezed(shape: tuple[int, ...], squeeze: bool) -> tuple[int, ...]:
    return shape[1:] if squeeze and len(shape) == 3 and shape[0] == 1 else shape


def load_config(model: str | None = None, config_path: str | None = None) -> dict:
    """A preset by name ("glm-5", "glm-4.5") or a Hugging Face config.json."""
    if config_path:
        with open(config_path) as f:
            return json.load(f)
    if model not in PRESETS:
        raise ValueError(f"model: expected one of {sorted(PRESETS)}, got {model!r}")
    return dict(PRESETS[model])


def is_sparse_layer(config: Mapping, layer_idx: int) -> bool:
    return layer_idx >= config.get("first_k_dense_replace", 0)


def plan_from_config(
    config: Mapping,
    layer_idx: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    target: str = "hopper",
    quantize: bool = True,
) -> LayerPlan:
    """Plan layer ``layer_idx`` of a model config; passthrough entries take ``dtype``."""
    model_type = config.get("model_type")
    if model_type not in SHAPES:
        raise ValueError(f"config.model_type: expected one of {sorted(SHAPES)}, got {model_type!r}")
    shapes = SHAPES[model_type](config, is_sparse_layer(config, layer_idx))
    return build_plan(model_type, {k: (s, dtype) for k, s in shapes.items()}, target=target,
                      quantize=quantize)  # fmt: skip


def infer_model_type(names: set[str]) -> str:
    if "self_attn.q_a_proj.weight" in names:
        return "glm_moe_dsa"
    if "self_attn.q_proj.weight" in names:
        return "glm4_moe"
    raise ValueError(
        "state_dict: cannot tell the model family (no self_attn.q_a_proj.weight or "
        f"self_attn.q_proj.weight); known families: {sorted(FAMILIES)}"
    )


def plan_from_state_dict(
    layer: Mapping[str, torch.Tensor], *, target: str = "hopper", quantize: bool = True
) -> LayerPlan:
    """Plan a layer from its tensors (names without the ``model.layers.{i}.`` prefix)."""
    inputs = {k: (tuple(t.shape), t.dtype) for k, t in layer.items()}
    return build_plan(infer_model_type(set(layer)), inputs, target=target, quantize=quantize)


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak transient bytes of converting one layer on the sender, above its
    resident master shards. ``inputs``: the gathered layer in the broadcast dtype."""

    inputs: int
    output: int
    eager: int  # inputs + torch.cat([w1, w3]) + per-expert fp8 lists + torch.stack of them
    preallocated_stack: int  # inputs + output stack + one expert's fp32 working set
    glm_fp8: int  # inputs + output buffer (+ O(blocks))


def estimate_memory(plan: LayerPlan, gather_dtype: torch.dtype = torch.bfloat16) -> MemoryEstimate:
    """The model behind ``glm-fp8 plan``: what each conversion path holds at its peak.

    eager (prime-rl's path): the gathered layer, the concatenated [E, 2I, H] w13 in the gather
    dtype, the per-expert fp8 tensors and their ``torch.stack`` (both alive while stacking).
    Preallocated stack: the gathered layer, the fp8 output, and one expert's [2I, H] concat
    with its float32 upcast and quotient. glm_fp8: the gathered layer and the output buffer.
    """
    inputs = plan.input_bytes(gather_dtype)
    item = gather_dtype.itemsize
    quantized = sum(e.nbytes for e in plan.entries if e.op in ("quantize", "scale"))
    cat = 0
    expert_ws = 0
    for e in plan.entries:
        if e.op == "quantize" and len(e.sources) > 1:
            n = math.prod(e.shape)
            cat += n * item
            per_matrix = n // (e.shape[0] if len(e.shape) == 3 else 1)
            expert_ws = max(expert_ws, per_matrix * (item + 4 + 4))
    return MemoryEstimate(
        inputs=inputs,
        output=plan.nbytes,
        eager=inputs + cat + 2 * quantized,
        preallocated_stack=inputs + plan.nbytes + expert_ws,
        glm_fp8=inputs + plan.nbytes,
    )


def master_bytes_per_gpu(config: Mapping, world_size: int, master_dtype=torch.float32) -> int:
    """Resident master weights of all decoder layers per GPU when sharded over ``world_size``
    (embeddings and lm_head are left out)."""
    total = 0
    for i in range(config["num_hidden_layers"]):
        shapes = SHAPES[config["model_type"]](config, is_sparse_layer(config, i))
        total += sum(math.prod(shape) for shape in shapes.values())
    return total * master_dtype.itemsize // world_size
