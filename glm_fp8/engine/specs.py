"""What a vLLM 0.34 worker holds for a GLM model: every parameter's vLLM name, the rank's shard
shape and its dtype, before the post-load step (docs/layouts.md, "Engine side (vLLM 0.34)":
"Names, dtypes, shards (GLM-5)", "MTP layer (GLM-5 layer 78)" and the GLM-4.5 note).

Derived parameters that post-load hooks create (MLA's ``W_UK_T`` / ``W_UV``) are not listed, and
scales are listed in load format (float32 ``[.., nb(N), nb(K)]``), as a loader holds them
(docs/layouts.md#post-load-rewrites).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from glm_fp8.engine.layout import EngineLayout, Shard
from glm_fp8.engine.rules import MTP_OWN, ShardRules, split_name
from glm_fp8.engine.sglang import check_sglang_config, sglang_drafter_name, sglang_indexer_form, sglang_name
from glm_fp8.model.config import as_config, check_untied_vocab
from glm_fp8.model.families import float32_entries, layer_kind, mtp_layer_index
from glm_fp8.model.indexer import skip_topk_layers
from glm_fp8.model.plans import plan_from_config
from glm_fp8.model.trainer_layouts import layer_prefix

# Families whose vLLM 0.34 modules the shard rules were read from (engine/layout.py).
ENGINE_FAMILIES = frozenset({"glm_moe_dsa", "glm4_moe"})


@dataclass(frozen=True)
class EngineParam:
    """One parameter of one engine rank: vLLM's ``name``, our kernel-format ``kernel_name``, the
    full kernel-format shape, the rank's ``shape`` and ``dtype``, and the ``shard`` that cuts it."""

    name: str
    kernel_name: str
    full_shape: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    shard: Shard


def engine_name(kernel_name: str, config: object = None) -> str:
    """vLLM 0.34's name for one of our kernel-format entries: routed experts one level deeper
    (``mlp.experts.w13_weight`` -> ``mlp.experts.routed_experts.w13_weight``) and, given the
    ``config``, the MTP layer's decoder entries under ``mtp_block.`` (``model.layers.78.self_attn.
    ...`` -> ``model.layers.78.mtp_block.self_attn...``; its ``enorm``/``hnorm``/``eh_proj``/
    ``shared_head.*`` stay). Names already in vLLM's form are returned unchanged."""
    idx, short = split_name(kernel_name)
    if idx is None:
        return kernel_name
    if short.startswith("mlp.experts."):
        short = "mlp.experts.routed_experts." + short[len("mlp.experts.") :]
    mtp = config is not None and idx == mtp_layer_index(as_config(config))
    if mtp and short not in MTP_OWN:
        short = "mtp_block." + short
    return layer_prefix(idx) + short


def engine_dtype(
    name: str, config: object, *, dtype: torch.dtype = torch.bfloat16, quantize: bool = True
) -> torch.dtype:
    """The dtype vLLM 0.34 builds ``name`` (kernel-format or vLLM name) in: float8_e4m3fn for a
    block-FP8 weight, float32 for its ``_scale_inv`` and for ``indexer.k_norm.*``,
    ``mlp.gate.e_score_correction_bias`` (and GLM-4.5's ``mlp.gate.weight``:
    ``glm_fp8.model.families.float32_entries``), else the model ``dtype`` (``eh_proj``, norms, router,
    embeddings and ``lm_head`` are never fp8). Plans from a config write passthrough entries in
    these dtypes."""
    c = as_config(config)
    return _dtype(name, c, ShardRules(c, EngineLayout(), quantize).table, dtype)


def _dtype(name: str, config: Mapping, table: Mapping[str, tuple[tuple[int, ...], bool]], dtype: torch.dtype):
    _, short = split_name(name)
    if short not in table:
        raise ValueError(f"{name}: not a parameter of a {config.get('model_type')} engine")
    if short.endswith("_scale_inv"):
        return torch.float32
    if short in float32_entries(config["model_type"]):
        return torch.float32
    return torch.float8_e4m3fn if table[short][1] else dtype


def _check_config(config: object, engine: str = "vllm") -> Mapping:
    c = as_config(config)
    check_untied_vocab(c, "the engine's parameters", f"its own ParallelLMHead in {engine}")
    if engine == "sglang":
        check_sglang_config(c)
    elif c["model_type"] not in ENGINE_FAMILIES:
        raise ValueError(
            f"config.model_type: the engine's parameters are modelled for "
            f"{sorted(ENGINE_FAMILIES)} only (docs/layouts.md#engine-side-vllm-034), got "
            f"{c['model_type']!r}"
        )
    skip_topk_layers(c)  # the indexer schedule: refused when it is read two ways
    return c


def engine_params(
    config: object, layout: EngineLayout, *, dtype: torch.dtype = torch.bfloat16, quantize: bool = True
) -> dict[str, EngineParam]:
    """Every parameter a vLLM 0.34 worker at ``layout`` holds for the model (target model then
    the MTP drafter), keyed by vLLM name: ``model.embed_tokens.weight``, each decoder layer's
    entries (in plan order), ``model.norm.weight``, ``lm_head.weight``, then the MTP layer
    (``num_nextn_predict_layers`` 1): ``mtp_block.<sparse-layer names>``, then ``enorm``,
    ``hnorm``, ``eh_proj``, ``shared_head.norm`` and ``shared_head.head``; the routing bias only
    with ``topk_method`` "noaux_tc" (``glm_fp8.model.families.has_routing_bias``). The drafter's
    ``embed_tokens`` is the target's (aliased), so it is listed once; ``shared_head.head`` is
    listed, though a running engine makes it the target's ``lm_head`` too (docs/vllm.md).
    An ``SGLangLayout`` (glm_fp8.engine.sglang) gives an SGLang 0.5.23 rank's target model under
    SGLang's names instead (``sglang_name``; no MTP layer: SGLang's drafter is a model of its own),
    or with ``drafter`` that drafter's: the MTP layer's entries but ``shared_head.head``, under its
    names (``sglang_drafter_name``). Raises ValueError where the engine would refuse the layout or
    glm_fp8 does not support it (see ``shard_for``)."""
    sglang = layout.engine == "sglang"
    drafter = sglang and layout.drafter
    config = _check_config(config, layout.engine)
    rules = ShardRules(config, layout, quantize)
    # SGLang's MTP drafter is a model of its own (its NextN class, in the draft worker): listed
    # for a drafter's layout alone.
    mtp = mtp_layer_index(config) if drafter or not sglang else None
    if drafter and mtp is None:
        raise ValueError(
            "SGLangLayout.drafter: the config has no MTP layer (num_nextn_predict_layers 0): no drafter "
            "to update"
        )
    form = sglang_indexer_form(config) if sglang else "fused"
    out: dict[str, EngineParam] = {}

    def add(kernel: str, full: tuple[int, ...]) -> None:
        if drafter and not layout.holds(config, kernel):
            return
        shard = rules.shard(kernel, full)
        if sglang:
            name = sglang_drafter_name(kernel, config) if drafter else sglang_name(kernel)
        else:
            name = engine_name(kernel, config)
        dt = _dtype(kernel, config, rules.table, dtype)
        out[name] = EngineParam(name, kernel, full, shard.shape(full), dt, shard)

    h, v = config["hidden_size"], config["vocab_size"]
    plans: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    if drafter:
        layer_entries = _layer_entries(config, mtp, "mtp", dtype, quantize, form, plans)
        for short, full in layer_entries:
            add(layer_prefix(mtp) + short, full)
        return out

    def layer(i: int) -> None:
        # dense / sparse, with or without an indexer (the schedule's), or the MTP layer
        kind = "mtp" if i == mtp else layer_kind(config, i)
        for short, full in _layer_entries(config, i, kind, dtype, quantize, form, plans):
            add(layer_prefix(i) + short, full)

    add("model.embed_tokens.weight", (v, h))
    for i in range(config["num_hidden_layers"]):
        layer(i)
    add("model.norm.weight", (h,))
    add("lm_head.weight", (v, h))
    if mtp is not None:
        layer(mtp)  # its plan: the sparse layer's entries, then enorm, hnorm, eh_proj, shared_head
    return out


def _layer_entries(
    config: Mapping,
    i: int,
    kind: str,
    dtype: torch.dtype,
    quantize: bool,
    form: str,
    plans: dict[str, list[tuple[str, tuple[int, ...]]]],
) -> list[tuple[str, tuple[int, ...]]]:
    """Layer ``i``'s entries (short name, full shape), its plan built once per ``kind`` in ``plans``."""
    if kind not in plans:
        plan = plan_from_config(config, i, dtype=dtype, quantize=quantize, indexer_form=form)
        plans[kind] = [(e.name, tuple(e.shape)) for e in plan.entries]
    return plans[kind]


def engine_param_specs(
    config: object, layout: EngineLayout, *, dtype: torch.dtype = torch.bfloat16, quantize: bool = True
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{vLLM name: (rank's shape, dtype)} of every parameter a vLLM 0.34 worker at ``layout`` holds
    for the model before its post-load step (``engine_params`` without the shard details)."""
    return {
        n: (p.shape, p.dtype)
        for n, p in engine_params(config, layout, dtype=dtype, quantize=quantize).items()
    }


__all__ = ["EngineParam", "engine_dtype", "engine_name", "engine_param_specs", "engine_params"]
