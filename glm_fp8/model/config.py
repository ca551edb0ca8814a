"""Model configs as trainers hold them: a mapping, a Hugging Face ``PretrainedConfig`` (anything
with ``to_dict()``), or the path of a config.json, turned into one validated, read-only dict
(``as_config``). Every key a model family reads is checked here once, for type, range and
consistency, so the rules of ``glm_fp8.model.families`` read plain values (docs/trainers.md#configs).

What each family reads is the table ``FAMILY_TRAITS``; ``glm_fp8.model.families`` holds the tensors that
follow from it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from glm_fp8.core.checks import check_int

MAX_LAYERS = 4096  # decoder layers: far above any model (GLM-5 has 78), far below a typo's 10**9
MAX_SIZE = 1 << 24  # widths, heads and vocabulary: 16M, beyond every released model
MAX_EXPERTS = 1 << 16
DOC = "docs/trainers.md#configs"


@dataclass(frozen=True)
class FamilyTraits:
    """What a model family's config must say: ``attention`` "mla" (q/kv LoRA, GLM-5 and
    DeepSeek-V3) or "gqa" (q/k/v heads, GLM-4.5 and Qwen3-MoE); ``indexer``: a DSA indexer per
    layer (its schedule may share it); ``experts``: the key of the routed-expert count;
    ``routing_bias``: vLLM builds ``e_score_correction_bias`` when ``topk_method`` is
    "noaux_tc"; ``shared_experts``: ``n_shared_experts`` >= 1; ``dense``: how dense layers are
    placed, "first_k" (``first_k_dense_replace`` / ``mlp_layer_types``) or "qwen3"
    (``mlp_only_layers`` / ``decoder_sparse_step``)."""

    attention: str
    indexer: bool
    experts: str
    routing_bias: bool
    shared_experts: bool
    dense: str


_DEEPSEEK = dict(experts="n_routed_experts", routing_bias=True, shared_experts=True, dense="first_k")
FAMILY_TRAITS: dict[str, FamilyTraits] = {
    "glm_moe_dsa": FamilyTraits("mla", True, **_DEEPSEEK),
    "deepseek_v32": FamilyTraits("mla", True, **_DEEPSEEK),
    "deepseek_v3": FamilyTraits("mla", False, **_DEEPSEEK),
    "kimi_k2": FamilyTraits("mla", False, **_DEEPSEEK),
    "glm4_moe": FamilyTraits("gqa", False, **_DEEPSEEK),
    "qwen3_moe": FamilyTraits("gqa", False, "num_experts", False, False, "qwen3"),
}


class Config(dict):
    """A config ``as_config`` validated: a dict that refuses changes, so that passing it again
    costs one ``isinstance`` check. ``{**config, key: value}`` is a new, unvalidated dict."""

    __slots__ = ()

    def _read_only(self, *args: object, **kwargs: object) -> None:
        raise TypeError(
            "Config is read-only (validated once): build a new one with as_config({**config, key: value})"
        )

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only

    def __reduce__(self) -> tuple:  # pickled to spawned ranks: rebuilt without a __setitem__ per key
        return Config, (dict(self),)


def as_config(config: object) -> Config:
    """The validated config of ``config``: a mapping (a config.json's dict), an object with
    ``to_dict()`` (a transformers ``PretrainedConfig``, whose ``to_dict()`` also holds the
    config.json keys its class does not declare, e.g. ``topk_method``), or a path (str or
    ``os.PathLike``) to a config.json or to a directory holding one. A multimodal wrapper without
    ``num_hidden_layers`` but with a ``text_config`` (Kimi-K2.5) gives its text backbone.

    Raises ValueError ``config.<key>: expected ..., got ...`` for the first key the family reads
    that is missing, of the wrong type (an int is never a bool, a float or a str; an integer
    scalar of numpy or torch is kept as its plain int), out of range or inconsistent with another;
    nothing is defaulted that the engine would read differently.
    A ``Config`` is returned as it is."""
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        raw: object = _read_json(config)
    elif isinstance(config, Mapping):
        raw = config
    elif callable(getattr(config, "to_dict", None)):
        raw = config.to_dict()
        if not isinstance(raw, Mapping):
            raise ValueError(
                f"config: {type(config).__name__}.to_dict() returned a {type(raw).__name__}, expected a dict"
            )
    else:
        raise TypeError(
            f"config: expected a dict, an object with to_dict() (a transformers "
            "PretrainedConfig) or the path of a config.json, got "
            f"{type(config).__name__}"
        )
    if "num_hidden_layers" not in raw and isinstance(raw.get("text_config"), Mapping):
        raw = raw["text_config"]  # a multimodal wrapper (e.g. Kimi-K2.5): its text backbone
    c = Config(raw)
    _validate(c)
    return c


def _read_json(path: str | os.PathLike) -> object:
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise ValueError(f"config: cannot read {path!r}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"config: {path!r} is not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(
            f"config: {path!r} holds a JSON {type(raw).__name__}, expected an object "
            "(a Hugging Face config.json)"
        )
    return raw


def check_untied_vocab(config: Mapping, needed_for: str, lm_head: str) -> None:
    """The non-layer tensors need ``vocab_size`` and an lm_head of its own: ValueError naming the
    field, ``needed_for`` (who reads it) and ``lm_head`` (what the untied head is there)."""
    if "vocab_size" not in config:
        raise ValueError(f"config.vocab_size: required for {needed_for} (e.g. 154880 for GLM-5)")
    if config.get("tie_word_embeddings"):
        raise ValueError(
            f"config.tie_word_embeddings: tied embeddings are not supported (GLM's lm_head is {lm_head})"
        )


# --- the checks ------------------------------------------------------------------------------------

_MISSING = object()


def _get(c: Mapping, key: str, what: str, required: bool) -> Any:
    """The value of ``key``; absent (or None, as Hugging Face writes unset optional keys) gives
    ``_MISSING`` unless ``required``."""
    value = c.get(key)
    if value is None:
        if required:
            raise ValueError(f"config.{key}: missing; expected {what} ({DOC})")
        return _MISSING
    return value


def _int(c: Config, key: str, lo: int, hi: int, *, required: bool = True, why: str = "") -> int | None:
    value = _get(c, key, f"an integer in [{lo}, {hi}]{why}", required)
    if value is _MISSING:
        return None
    value = check_int(f"config.{key}", value, lo, hi, why)
    # check_int takes integer scalars of numpy and torch too: keep the plain int, so that what reads
    # the config (shapes, the JSON manifest) never meets another type.
    dict.__setitem__(c, key, value)
    return value


def _size(c: Config, key: str, *, required: bool = True, hi: int = MAX_SIZE) -> int | None:
    return _int(c, key, 1, hi, required=required)


def _bool(c: Mapping, key: str) -> bool | None:
    value = _get(c, key, "a bool", False)
    if value is _MISSING:
        return None
    if not isinstance(value, bool):
        raise ValueError(f"config.{key}: expected a bool, got {value!r} ({type(value).__name__})")
    return value


def _choices(c: Mapping, key: str, allowed: Sequence[str], n: int, what: str) -> list[str] | None:
    """A list of one of ``allowed`` per hidden layer (``n``), or None when absent."""
    value = _get(c, key, "a list", False)
    if value is _MISSING:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"config.{key}: expected a list of {what} per hidden layer, got {value!r}")
    if len(value) != n:
        raise ValueError(f"config.{key}: expected one entry per hidden layer ({n}), got {len(value)}")
    bad = sorted({repr(v) for v in value if v not in allowed})
    if bad:
        names = " and ".join(repr(a) for a in allowed)
        raise ValueError(f"config.{key}: only {names} are allowed, got [{', '.join(bad)}]")
    return list(value)


def _validate(c: Config) -> None:
    model_type = c.get("model_type")
    if model_type is None:
        raise ValueError(f"config.model_type: missing; expected one of {sorted(FAMILY_TRAITS)}")
    if not isinstance(model_type, str) or model_type not in FAMILY_TRAITS:
        raise ValueError(f"config.model_type: expected one of {sorted(FAMILY_TRAITS)}, got {model_type!r}")
    traits = FAMILY_TRAITS[model_type]
    n = _int(c, "num_hidden_layers", 1, MAX_LAYERS, why=" (the decoder layers)")
    h = _size(c, "hidden_size")
    heads = _size(c, "num_attention_heads")
    _size(c, "vocab_size", required=False)
    _bool(c, "tie_word_embeddings")
    _int(c, "num_nextn_predict_layers", 0, 1, required=False, why=" (MTP layers; only 0 or 1 is supported)")
    if traits.attention == "mla":
        _check_mla(c)
    else:
        _check_gqa(c, h, heads)
    if traits.indexer:
        _check_indexer(c, n)
    _size(c, traits.experts, hi=MAX_EXPERTS)
    _size(c, "moe_intermediate_size")
    if traits.shared_experts:
        _int(c, "n_shared_experts", 1, MAX_EXPERTS, why=" (this family always has a shared expert)")
    if traits.routing_bias:
        method = _get(c, "topk_method", "a str", False)
        if method is not _MISSING and not isinstance(method, str):
            raise ValueError(f"config.topk_method: expected a str (e.g. 'noaux_tc'), got {method!r}")
    dense = _check_first_k(c, n) if traits.dense == "first_k" else _check_qwen3(c, n)
    _size(c, "intermediate_size", required=dense)


def _check_mla(c: Config) -> None:
    if "q_lora_rank" in c and c["q_lora_rank"] is None:
        raise ValueError(
            "config.q_lora_rank: MLA without a q LoRA (q_proj, e.g. DeepSeek-V2-Lite) is not "
            "supported; expected an int"
        )
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        _size(c, key)
    if _bool(c, "attention_bias"):
        raise ValueError(
            "config.attention_bias: expected False (MLA projections without biases, as "
            "GLM-5 and DeepSeek-V3 have), got True"
        )


def _check_gqa(c: Config, h: int, heads: int) -> None:
    kv = _size(c, "num_key_value_heads")
    if heads % kv:
        raise ValueError(
            f"config.num_key_value_heads: expected a divisor of num_attention_heads ({heads}), got {kv}"
        )
    if _size(c, "head_dim", required=False) is None and h % heads:
        raise ValueError(
            f"config.head_dim: missing, and hidden_size {h} is not a multiple of "
            f"num_attention_heads {heads} to derive it from"
        )
    _bool(c, "attention_bias")
    _bool(c, "use_qk_norm")


def _check_indexer(c: Config, n: int) -> None:
    _size(c, "index_n_heads")
    _size(c, "index_head_dim")
    _size(c, "index_topk", required=False)
    _choices(c, "indexer_types", ("full", "shared"), n, "'full' or 'shared'")
    pattern = _get(c, "index_topk_pattern", "a str", False)
    if pattern is not _MISSING and (
        not isinstance(pattern, (str, list, tuple)) or any(ch not in ("F", "S") for ch in pattern)
    ):
        raise ValueError(
            f"config.index_topk_pattern: expected a str of 'F' (full) and 'S' (shared), one per "
            f"layer, got {pattern!r}"
        )
    _int(c, "index_topk_freq", 1, MAX_LAYERS, required=False, why=" (a positive int)")
    _int(c, "index_skip_topk_offset", 0, MAX_LAYERS, required=False)
    _bool(c, "use_index_cache")


def _check_first_k(c: Config, n: int) -> bool:
    """``first_k_dense_replace`` and transformers' derived ``mlp_layer_types`` (the latter
    decides when alone; both must agree when given). True when some layer is dense."""
    types = _choices(c, "mlp_layer_types", ("dense", "sparse"), n, "'dense' or 'sparse'")
    k = _int(
        c,
        "first_k_dense_replace",
        0,
        n,
        required=types is None,
        why=" (the leading dense layers, at most num_hidden_layers)",
    )
    if types is not None and k is not None:
        want = ["dense"] * k + ["sparse"] * (n - k)
        bad = next((i for i in range(n) if types[i] != want[i]), None)
        if bad is not None:
            raise ValueError(
                f"config.mlp_layer_types: layer {bad} is {types[bad]!r}, but "
                f"first_k_dense_replace {k} makes it {want[bad]!r}; expected them to "
                "agree"
            )
    freq = _int(c, "moe_layer_freq", 1, MAX_LAYERS, required=False)
    if freq not in (None, 1):
        raise ValueError(
            f"config.moe_layer_freq: only 1 (every layer from first_k_dense_replace on is "
            f"sparse) is supported, got {freq}"
        )
    return "dense" in types if types is not None else k > 0


def _check_qwen3(c: Config, n: int) -> bool:
    """Qwen3-MoE's placement (vLLM ``qwen3_moe.py``): ``mlp_only_layers`` and
    ``decoder_sparse_step`` (transformers' defaults: none, 1). True when some layer is dense."""
    step = _int(c, "decoder_sparse_step", 1, MAX_LAYERS, required=False) or 1
    only = _get(c, "mlp_only_layers", "a list", False)
    only = [] if only is _MISSING else only
    if (
        isinstance(only, (str, bytes))
        or not isinstance(only, Sequence)
        or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n for i in only)
    ):
        raise ValueError(
            f"config.mlp_only_layers: expected a list of layer indices in [0, {n - 1}], got {only!r}"
        )
    return bool(only) or step > 1


__all__ = ["Config", "FAMILY_TRAITS", "FamilyTraits", "MAX_LAYERS", "as_config", "check_untied_vocab"]
