"""The DSA indexer (GLM-5, DeepSeek-V3.2): the families whose layers carry one, its trainer
tensors' shapes, and the schedule (IndexShare / IndexCache, docs/layouts.md#indexer-schedule) that
decides which layers hold one. Pure rules over a config (validated by
``glm_fp8.model.config.as_config``); ``glm_fp8.model.families`` builds a layer's shapes and kind
from them.
"""

from __future__ import annotations

from collections.abc import Mapping

from glm_fp8.model.config import FAMILY_TRAITS, as_config

INDEXER_PREFIX = "self_attn.indexer."  # every indexer tensor, trainer and kernel format
# Families whose layers carry a DSA indexer (unless the config's schedule shares it).
INDEXER_FAMILIES = frozenset(t for t, traits in FAMILY_TRAITS.items() if traits.indexer)


def indexer_shapes(config: Mapping) -> dict[str, tuple[int, ...]]:
    """The DSA indexer's trainer tensors (an indexer family's full layer, or what a Hugging Face
    trainer holds on every layer, shared ones included)."""
    c = as_config(config)
    h, ql, ih, idim = c["hidden_size"], c["q_lora_rank"], c["index_n_heads"], c["index_head_dim"]
    return {
        "self_attn.indexer.wq_b.weight": (ih * idim, ql),
        "self_attn.indexer.wk.weight": (idim, h),
        "self_attn.indexer.weights_proj.weight": (ih, h),
        "self_attn.indexer.k_norm.weight": (idim,),
        "self_attn.indexer.k_norm.bias": (idim,),
    }


def _prime_rl_skips_topk(config: Mapping, layer_idx: int) -> bool:
    """prime-rl's trainer (``configuration_glm_moe_dsa.py::_index_cache_skip_topk``, with the
    auto-enable of ``trainer/model.py``: a schedule in ``indexer_types`` with a "shared" entry
    turns ``use_index_cache`` on). Precedence: ``index_topk_pattern``, then ``indexer_types``,
    then ``layer_idx % index_topk_freq != 0`` (no offset). Nothing is skipped without
    ``use_index_cache``."""
    types = config.get("indexer_types")
    if not (config.get("use_index_cache", False) or (types and "shared" in types)):
        return False
    pattern = config.get("index_topk_pattern")
    if pattern is not None:
        return layer_idx < len(pattern) and pattern[layer_idx] == "S"
    if types is not None:
        return layer_idx < len(types) and types[layer_idx] == "shared"
    return layer_idx % (config.get("index_topk_freq") or 1) != 0


def vllm_skip_topk_layers(config: Mapping) -> set[int]:
    """vLLM 0.34's ``model_executor/models/utils.py::compute_skip_topk_layers`` (what
    ``deepseek_v32/attention.py`` builds from on CUDA). Precedence: ``indexer_types`` (one entry
    per layer, "full" or "shared"), then ``index_topk_pattern``, then
    ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq != 0`` (offset 2 by default);
    ``use_index_cache`` is not read. vLLM applies it only when the config has ``index_topk``;
    for the indexer families here it is applied whether the field is there or not."""
    c = as_config(config)
    n = c["num_hidden_layers"]
    types = c.get("indexer_types")
    if types is not None:
        return {i for i, t in enumerate(types) if t == "shared"}
    freq = c.get("index_topk_freq") or 1
    pattern = c.get("index_topk_pattern")
    offset = c.get("index_skip_topk_offset")
    offset = 2 if offset is None else offset
    if pattern is not None:
        return {i for i in range(min(n, len(pattern))) if pattern[i] == "S"}
    return {i for i in range(n) if max(i - offset + 1, 0) % freq != 0}


def skip_topk_layers(config: object) -> frozenset[int]:
    """Decoder layers built without a DSA indexer (IndexShare "shared" layers: they reuse the
    top-k of the previous full layer and hold no ``self_attn.indexer.*`` tensors). Empty for
    families without an indexer. The MTP layer (index ``num_hidden_layers``) always has one.

    The trainer (prime-rl) and the engine (vLLM 0.34) read the schedule with different rules
    (``_prime_rl_skips_topk``, ``vllm_skip_topk_layers``); an update can only land when they agree,
    so a config on which they disagree is refused here, naming the first layer that differs."""
    c = as_config(config)
    if c["model_type"] not in INDEXER_FAMILIES:
        return frozenset()
    engine = vllm_skip_topk_layers(c)
    for i in range(c["num_hidden_layers"]):
        trainer = _prime_rl_skips_topk(c, i)
        if trainer != (i in engine):
            verdict = {True: "no indexer (shared)", False: "an indexer (full)"}
            raise ValueError(
                f"config: the indexer schedule is read differently by prime-rl and vLLM 0.34: layer {i} has "
                f"{verdict[trainer]} for prime-rl (_index_cache_skip_topk: index_topk_pattern, then "
                f"indexer_types, then i % index_topk_freq, only with use_index_cache) and "
                f"{verdict[i in engine]} for vLLM (compute_skip_topk_layers: indexer_types, then "
                "index_topk_pattern, then "
                "max(i - index_skip_topk_offset + 1, 0) % index_topk_freq); give an explicit indexer_types "
                "(docs/layouts.md#indexer-schedule)"
            )
    return frozenset(engine)


def has_indexer(config: object, layer_idx: int) -> bool:
    """True when layer ``layer_idx`` carries ``self_attn.indexer.*`` (see ``skip_topk_layers``)."""
    c = as_config(config)
    if c["model_type"] not in INDEXER_FAMILIES:
        return False
    return layer_idx >= c["num_hidden_layers"] or layer_idx not in skip_topk_layers(c)
