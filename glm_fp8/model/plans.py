"""Layer plans: which kernel-format entries a trainer layer becomes, and where each one lives
in the layer's single broadcast buffer (docs/layouts.md#layer-buffer).

A plan is built once per layer shape, from a model config (``glm_fp8.model.families``: presets, a
config.json, a transformers config object) or inferred from one layer's state dict, and then
reused for every update. Its entries (names, order, shapes, dtypes, offsets: the manifest)
depend on the model only; where they come from depends on the trainer's layout of its tensors
(docs/trainers.md#trainer-layouts): ``adapt_plan`` gives the same plan reading another layout.
Here: building plans, and which trainer tensors are not sent (``unsent_keys``); what a plan is,
``glm_fp8.model.layer_plan``; trainer layouts, ``glm_fp8.model.trainer_layouts``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence

import torch

from glm_fp8.core.vocab import INDEXER_FORMS, SCALE_FORMATS, TARGETS, check_choice
from glm_fp8.model.config import FAMILY_TRAITS, as_config
from glm_fp8.model.families import (
    EXPERT,
    FAMILIES,
    HF_CHECKPOINT,
    MTP_RULES,
    REST,
    REST_RULES,
    TRAINER_LAYOUTS,
    expert_index,
    expert_sources,
    float32_entries,
    infer_model_type,
    is_sparse_names,
    layer_kind,
    layer_shapes,
    layout_sources,
    mtp_layer_index,
    with_indexer_form,
)
from glm_fp8.model.indexer import INDEXER_FAMILIES, INDEXER_PREFIX, has_indexer
from glm_fp8.model.layer_plan import LayerPlan, PlanEntry, align, scale_entry
from glm_fp8.model.trainer_layouts import (
    layer_prefix,
    trainer_layout,
)

BIAS_ENTRY = "mlp.gate.e_score_correction_bias"
_BIAS_SOURCES = frozenset(s for t in TRAINER_LAYOUTS.values() for s in t.get(BIAS_ENTRY, ()))


def build_plan(
    model_type: str,
    inputs: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
    *,
    target: str = "hopper",
    quantize: bool = True,
    scale_fmt: str | None = None,
    model_dtype: torch.dtype | None = None,
    indexer_form: str = "fused",
) -> LayerPlan:
    """Plan one layer from its trainer tensors' shapes and dtypes (dtype None: not known yet),
    in whichever trainer layout their names follow (``trainer_layout``). The layer is a decoder
    layer, the MTP layer (it holds ``enorm.weight``) or the non-layer tensors
    (``model.embed_tokens.weight`` and the rest, under their full names). ``scale_fmt``: "fp32"
    (default for Hopper) or "ue8m0" (power-of-two scales, as DeepGEMM needs; Blackwell's only
    format). Passthrough entries take ``model_dtype`` as the engine does (float32 for
    ``glm_fp8.model.families.float32_entries``), and so do their inputs; None: their first source's dtype
    (a state dict's plan keeps the trainer's dtypes). ``indexer_form``: the DSA indexer's wk and
    weights_proj "fused" into one bf16 entry (default), "split", or "both" (the fused entry, then the
    split ones: ``glm_fp8.core.vocab.IndexerForm``)."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type: expected one of {sorted(FAMILIES)}, got {model_type!r}")
    check_choice("target", target, TARGETS)
    if scale_fmt is None:
        scale_fmt = "ue8m0" if target == "blackwell" else "fp32"
    check_choice("scale_fmt", scale_fmt, SCALE_FORMATS)
    if target == "blackwell" and scale_fmt != "ue8m0":
        raise ValueError("scale_fmt: Blackwell's packed scales are ue8m0 only, got 'fp32'")
    check_choice("indexer_form", indexer_form, INDEXER_FORMS)
    layout = trainer_layout(inputs)
    attention, dense, sparse = FAMILIES[model_type]
    attention = with_indexer_form(attention, indexer_form)
    indexer = False
    if any(r.out in inputs for r in REST_RULES):
        kind, rules = "rest", REST_RULES
    else:
        kind = "sparse" if is_sparse_names(inputs) else "dense"
        rules = attention + (sparse if kind == "sparse" else dense)
        # The indexer is all or nothing: an IndexShare "shared" layer holds none of its tensors.
        indexer = any(k.startswith(INDEXER_PREFIX) for k in inputs)
        if model_type in INDEXER_FAMILIES and not indexer:
            kind += "/no-indexer"
        if kind.startswith("sparse") and FAMILY_TRAITS[model_type].routing_bias:
            if not any(s in inputs for s in _BIAS_SOURCES):
                kind += "/no-bias"
        if "enorm.weight" in inputs:
            kind, rules = kind.replace("sparse", "mtp"), rules + MTP_RULES
    experts = _experts_held(inputs) if layout == HF_CHECKPOINT else 0
    fp32 = float32_entries(model_type)
    entries: list[PlanEntry] = []
    offset = 0
    used: set[str] = set()
    planned = dict(inputs)
    for rule in rules:
        sources = layout_sources(layout, rule.out) or rule.sources
        per_expert = any(EXPERT in s for s in sources)
        if per_expert:
            sources = tuple(s for j in range(max(experts, 1)) for s in expert_sources(sources, j))
        present = [s in inputs for s in sources]
        if (rule.optional and not any(present)) or (rule.group == "indexer" and not indexer):
            continue
        for src, ok in zip(sources, present):
            if not ok:
                hint = (
                    f"; a layer holds every {INDEXER_PREFIX}* tensor or none (a shared IndexShare layer)"
                    if rule.group == "indexer"
                    else ""
                )
                raise KeyError(f"{src}: missing from the layer (needed for {rule.out}){hint}")
        used.update(sources)
        if per_expert:
            shape = _per_expert_shape(rule.out, sources, inputs, experts)
        else:
            shapes = [squeezed(tuple(inputs[s][0]), rule.squeeze) for s in sources]
            rows = sum(s[-2] for s in shapes) if len(shapes[0]) >= 2 else sum(s[0] for s in shapes)
            shape = (*shapes[0][:-2], rows, shapes[0][-1]) if len(shapes[0]) >= 2 else (rows,)
        if rule.quantize and quantize:
            entries.append(
                PlanEntry(
                    rule.out,
                    "quantize",
                    torch.float8_e4m3fn,
                    shape,
                    offset,
                    sources,
                    rule.squeeze,
                    per_expert=per_expert,
                )
            )
            offset = align(offset + entries[-1].nbytes)
            entries.append(scale_entry(rule.out + "_scale_inv", shape, target, offset))
        else:
            op = "copy" if len(sources) == 1 else "concat"
            if model_dtype is None:
                dtype = inputs[sources[0]][1] or torch.bfloat16
            else:
                dtype = torch.float32 if rule.out in fp32 else model_dtype
                planned.update({s: (tuple(inputs[s][0]), dtype) for s in sources})
            entries.append(
                PlanEntry(rule.out, op, dtype, shape, offset, sources, rule.squeeze, per_expert=per_expert)
            )
        offset = align(offset + entries[-1].nbytes)
    extra = sorted(set(inputs) - used)
    if extra:
        raise KeyError(f"{extra[0]}: not a tensor of a {model_type} {kind} layer (no rule uses it)")
    return LayerPlan(kind, target, quantize, tuple(entries), planned, offset, scale_fmt, layout, model_type)


def _experts_held(inputs: Iterable[str]) -> int:
    """E of a layer in per-expert names: one more than the largest expert index (a gap is then
    reported as a missing key)."""
    return 1 + max((expert_index(k) for k in inputs if expert_index(k) is not None), default=-1)


def _per_expert_shape(out: str, sources: tuple[str, ...], inputs: Mapping, experts: int) -> tuple[int, ...]:
    """[E, R, C] of a per-expert entry: every expert's group of 2-D sources alike."""
    k = len(sources) // experts
    first = [tuple(inputs[s][0]) for s in sources[:k]]
    for s, want in zip(sources, first * experts):
        got = tuple(inputs[s][0])
        if len(got) != 2 or got != want:
            raise ValueError(f"{s}: expected shape {want} (as expert 0's, for {out}), got {got}")
    if any(s[-1] != first[0][-1] for s in first):
        raise ValueError(f"{sources[1]}: expected {first[0][-1]} columns (as {sources[0]}), got {first[1]}")
    return (experts, sum(s[0] for s in first), first[0][-1])


def squeezed(x: torch.Tensor | tuple[int, ...], squeeze: bool):
    """The squeeze rule, for a tensor or a shape: a rule marked ``squeeze`` reads a 3-D source
    with a leading dim of 1 as 2-D (a [1, I, H] shared expert as [I, H])."""
    shape = tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x)
    if squeeze and len(shape) == 3 and shape[0] == 1:
        return x[0] if isinstance(x, torch.Tensor) else shape[1:]
    return x


def plan_from_config(
    config: object,
    layer_idx: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    target: str = "hopper",
    quantize: bool = True,
    scale_fmt: str | None = None,
    indexer_form: str = "fused",
) -> LayerPlan:
    """Plan layer ``layer_idx`` of a model config (anything ``glm_fp8.model.config.as_config`` takes; a
    decoder layer, the MTP layer or ``REST``) in prime-rl's trainer layout (``adapt_plan`` reads
    others). ``dtype``: the engine's model dtype; passthrough entries are written in the dtype
    the engine holds them in (float32 for ``glm_fp8.model.families.float32_entries``, else ``dtype``),
    from whatever floating dtype the trainer holds. The layer follows the config's indexer
    schedule (``glm_fp8.model.indexer.skip_topk_layers``) and routing bias (``has_routing_bias``)."""
    c = as_config(config)
    shapes = layer_shapes(c, layer_idx)
    return build_plan(
        c["model_type"],
        {k: (s, dtype) for k, s in shapes.items()},
        target=target,
        quantize=quantize,
        scale_fmt=scale_fmt,
        model_dtype=dtype,
        indexer_form=indexer_form,
    )


def plans_for_model(
    config: object,
    wire: str = "fp8",
    target: str = "hopper",
    layer_ids: Sequence[int] | None = None,
    scale_fmt: str | None = None,
    indexer_form: str = "fused",
) -> list[LayerPlan]:
    """One plan per layer of ``layer_ids`` (default: every decoder layer; the MTP layer and
    ``REST`` may be listed too, and need not be: a trainer that does not model the MTP layer
    updates the target only), built once per kind of layer (``glm_fp8.model.families.layer_kind``:
    dense or sparse MLP, with or without an indexer). ``wire``: "fp8" (kernel format) or "bf16"
    (unquantized entries); ``indexer_form`` as ``build_plan`` takes it."""
    c = as_config(config)
    cache: dict[object, LayerPlan] = {}
    out = []
    mtp = mtp_layer_index(c)
    for i in range(c["num_hidden_layers"]) if layer_ids is None else layer_ids:
        kind = i if i in (REST, mtp) else layer_kind(c, i)
        if kind not in cache:
            cache[kind] = plan_from_config(
                c, i, target=target, quantize=wire == "fp8", scale_fmt=scale_fmt, indexer_form=indexer_form
            )
        out.append(cache[kind])
    return out


def check_schedule(config: object, layer_idx: int, names: Iterable[str]) -> None:
    """Refuse a layer's tensors (short names) that lack the indexer the config's schedule gives
    the layer (a full layer): KeyError naming the layer's key. Indexer tensors on a layer the
    schedule shares are not refused: they are not sent (``unsent_keys``)."""
    c = as_config(config)
    if c["model_type"] not in INDEXER_FAMILIES or not has_indexer(c, layer_idx):
        return
    if not any(k.startswith(INDEXER_PREFIX) for k in names):
        raise KeyError(
            f"{layer_prefix(layer_idx)}{INDEXER_PREFIX}wq_b.weight: missing; the config's indexer "
            f"schedule gives layer {layer_idx} an indexer (a full layer)"
        )


def plan_from_state_dict(
    layer: Mapping[str, torch.Tensor], *, target: str = "hopper", quantize: bool = True
) -> LayerPlan:
    """Plan a layer from its tensors (names without the ``model.layers.{i}.`` prefix, any
    trainer layout); passthrough entries keep the tensors' dtypes."""
    inputs = {k: (tuple(t.shape), t.dtype) for k, t in layer.items()}
    return build_plan(infer_model_type(set(layer)), inputs, target=target, quantize=quantize)


# --- trainer tensors the engine has no parameter for ------------------------------------------------

_UNSENT_WHY = {
    "indexer": "self_attn.indexer.* on a layer the config's indexer schedule shares (IndexShare): the engine "
    "builds no indexer there (a Hugging Face trainer builds one in every layer)",
    "routing bias": "the routing bias (e_score_correction_bias) under a config whose topk_method is not "
    "'noaux_tc': the engine builds none",
}
_warned: set[str] = set()


def unsent_keys(kind: str, names: Iterable[str]) -> dict[str, str]:
    """The trainer tensors (short names) of a layer of ``kind`` (``LayerPlan.kind``, or
    ``glm_fp8.model.families.layer_kind`` of a config's layer) that the engine has no parameter for, by
    what they are: "indexer" (``self_attn.indexer.*`` on a "/no-indexer" layer, which a Hugging
    Face trainer holds) and "routing bias" (on a "/no-bias" layer: the config's ``topk_method``
    is not "noaux_tc"). They are not sent (docs/trainers.md#unsent-tensors)."""
    no_indexer, no_bias = "/no-indexer" in kind, "/no-bias" in kind
    out = {}
    for n in names:
        if no_indexer and n.startswith(INDEXER_PREFIX):
            out[n] = "indexer"
        elif no_bias and n in _BIAS_SOURCES:
            out[n] = "routing bias"
    return out


def warn_unsent(unsent: Mapping[str, str], prefix: str) -> None:
    """Say, once per process and kind, that tensors are not sent (``warnings.warn``)."""
    for key, kind in unsent.items():
        if kind not in _warned:
            _warned.add(kind)
            warnings.warn(
                f"{prefix}{key} (and every such tensor, said once): not sent; {_UNSENT_WHY[kind]}",
                stacklevel=3,
            )


__all__ = [
    "BIAS_ENTRY",
    "build_plan",
    "check_schedule",
    "plan_from_config",
    "plan_from_state_dict",
    "plans_for_model",
    "squeezed",
    "unsent_keys",
    "warn_unsent",
]
