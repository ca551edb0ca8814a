"""Trainer layouts (docs/trainers.md#trainer-layouts): which layout a layer's tensor names follow,
a plan read in another layout (``relayout``, ``adapt_plan``), the check that a layer's MLP is of
its plan's kind, and a layer's keys under their short names (``layer_prefix``, ``strip_layer``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

import torch

from glm_fp8.model.families import (
    EXPERT,
    FAMILIES,
    HF,
    HF_CHECKPOINT,
    PRIME_RL,
    REST,
    REST_RULES,
    SOURCE_LAYOUTS,
    expert_index,
    expert_sources,
    is_sparse_names,
    layout_sources,
)
from glm_fp8.model.layer_plan import LayerPlan, check_rows, plan_memo

LAYOUTS = (PRIME_RL, HF, HF_CHECKPOINT)  # trainer layouts, in the order ``trainer_layout`` prefers


def layer_prefix(layer_idx: int) -> str:
    """The one place the decoder-layer prefix is spelled: ``model.layers.{i}.`` (and none for
    ``REST``, the non-layer tensors, whose plan names are full names)."""
    return "" if layer_idx == REST else f"model.layers.{layer_idx}."


def strip_layer(state_dict: Mapping[str, torch.Tensor], layer_idx: int) -> dict[str, torch.Tensor]:
    """The layer's tensors under their short names. A key is either prefixed with this layer's
    ``model.layers.{layer_idx}.`` or short (taken as this layer's); a key of another layer
    (``model.layers.{j}.``, j != layer_idx, or any ``model.layers.`` key for ``REST``) and a name
    given both ways are refused (KeyError naming the key): a tensor is never renamed into
    another layer."""
    prefix = layer_prefix(layer_idx)
    out: dict[str, torch.Tensor] = {}
    for k, t in state_dict.items():
        if prefix and k.startswith(prefix):
            short = k[len(prefix) :]
        elif k.startswith("model.layers."):
            raise KeyError(_other_layer_key(k, layer_idx))
        else:
            short = k
        if short in out:
            raise KeyError(f"{k}: {short!r} is given twice, with and without the {prefix!r} prefix")
        out[short] = t
    return out


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def _other_layer_key(key: str, layer_idx: int) -> str:
    """The message for a decoder-layer key handed in under another ``layer_idx``: what that index
    expects, and the index the key belongs to."""
    m = _LAYER_KEY.match(key)
    own = f"; pass it with layer_idx={int(m.group(1))}, its own layer" if m else ""
    if layer_idx == REST:
        return (
            f"{key}: a decoder layer's key, but layer_idx={REST} (REST: the non-layer tensors, "
            f"{', '.join(r.out for r in REST_RULES)}, under these full names){own}"
        )
    expected = f"{layer_prefix(layer_idx)}<name> or short names such as input_layernorm.weight"
    return f"{key}: a key of another layer, but layer_idx={layer_idx} (expected keys {expected}){own}"


def _layouts_of(names: Iterable[str], prefix: str = "", strict: bool = True) -> tuple[str, ...]:
    """Every trainer layout consistent with a layer's tensor names (short), in ``LAYOUTS`` order.
    KeyError for names of two layouts, and (``strict``) for an ``mlp.`` name no layout has;
    messages name ``prefix + key``."""
    allowed = set(LAYOUTS)
    markers: list[tuple[str, frozenset[str]]] = []  # the names that narrowed ``allowed``, in turn
    for n in names:
        layouts = _layouts_of_name(n)
        if layouts is None:
            if strict and n.startswith("mlp."):
                raise KeyError(
                    f"{prefix}{n}: not a tensor name of any trainer layout ({', '.join(LAYOUTS)}; "
                    "docs/trainers.md#trainer-layouts)"
                )
            continue
        if allowed <= layouts:
            continue
        if not allowed & layouts:
            other, theirs = next((m for m in reversed(markers) if not m[1] & layouts), markers[-1])
            raise KeyError(
                f"{prefix}{n}: a {'/'.join(sorted(layouts))} name, but {prefix}{other} is a "
                f"{'/'.join(sorted(theirs))} name; a layer's tensors follow one trainer layout "
                "(docs/trainers.md#trainer-layouts)"
            )
        allowed &= layouts
        markers.append((n, frozenset(layouts)))
    return tuple(x for x in LAYOUTS if x in allowed)


_NAME_LAYOUTS: dict[str, frozenset[str] | None] = {}
_PER_EXPERT = frozenset({HF_CHECKPOINT})


def _layouts_of_name(name: str) -> frozenset[str] | None:
    """The layouts that hold a tensor name (None: none), memoized: a model has a few hundred
    names, read again for every layer of every update."""
    if name not in _NAME_LAYOUTS:
        if len(_NAME_LAYOUTS) > 1 << 16:  # names from many models in one process: start again
            _NAME_LAYOUTS.clear()
        _NAME_LAYOUTS[name] = _PER_EXPERT if expert_index(name) is not None else SOURCE_LAYOUTS.get(name)
    return _NAME_LAYOUTS[name]


def trainer_layout(names: Iterable[str]) -> str:
    """The trainer layout a layer's tensor names (short) follow: "prime_rl" (prime-rl /
    torchtitan stacks ``mlp.experts.w1``...), "hf" (transformers' modules,
    ``mlp.experts.gate_up_proj``...) or "hf_checkpoint" (per-expert ``mlp.experts.{j}.*``). Names
    common to several layouts (a dense layer, attention only, the non-layer tensors) give the
    first of them in ``LAYOUTS`` order: "prime_rl" when every layout fits, "hf" when only the
    router and shared experts are named. KeyError naming a key no layout has (under ``mlp.``) or
    two keys of different layouts."""
    return _layouts_of(names)[0]


def relayout(plan: LayerPlan, layout: str) -> LayerPlan:
    """``plan`` reading the trainer tensors of ``layout``: the same entries (names, order, shapes,
    dtypes, offsets: the same manifest) from that layout's sources, ``inputs`` in its names.
    Cached per plan."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if layout == plan.layout:
        return plan
    memo = plan_memo(plan)
    if ("layout", layout) not in memo:
        other = _relayout(plan, layout)
        memo[("layout", layout)] = other
        plan_memo(other)[("layout", plan.layout)] = plan
    return memo[("layout", layout)]


def _relayout(plan: LayerPlan, layout: str) -> LayerPlan:
    entries, inputs = [], {}
    for e in plan.entries:
        sources = None if e.op == "scale" else layout_sources(layout, e.name)
        if sources is None:  # the same names in every layout
            entries.append(e)
            inputs.update({s: plan.inputs[s] for s in e.sources})
            continue
        dtype = plan.inputs[e.sources[0]][1]
        per_expert = any(EXPERT in s for s in sources)
        rows = e.shape[-2] if len(e.shape) >= 2 else e.shape[0]
        if rows % len(sources):
            raise ValueError(
                f"{e.name}: {rows} rows do not split into the {len(sources)} sources of the "
                f"{layout} layout ({', '.join(sources)})"
            )
        part = (rows // len(sources), *e.shape[-1:]) if len(e.shape) >= 2 else (rows // len(sources),)
        if per_expert:
            sources = tuple(s for j in range(e.shape[0]) for s in expert_sources(sources, j))
        elif len(e.shape) == 3:
            part = (e.shape[0], *part)
        elif e.squeeze and layout == PRIME_RL:
            part = (1, *part)  # prime-rl's shared expert is [1, I, H]
        entries.append(dataclasses.replace(e, sources=sources, per_expert=per_expert))
        inputs.update({s: (part, dtype) for s in sources})
    return dataclasses.replace(plan, entries=tuple(entries), inputs=inputs, layout=layout)


def adapt_plan(plan: LayerPlan, names: Iterable[str], *, prefix: str = "") -> LayerPlan:
    """The plan equivalent to ``plan`` (the same manifest: entries, offsets, dtypes) whose entry
    ``sources`` and ``inputs`` follow the trainer layout of ``names`` (a layer's short tensor
    names, or the layer itself): ``plan`` itself when it already fits (names common to every
    layout fit any plan), else ``relayout`` (cached). KeyError naming ``prefix + key`` for names
    of two layouts; a name of none is left to the checks (``glm_fp8.kernels.convert.check_layer_keys``:
    an unexpected key). KeyError when the names are a layer of the other kind (a dense MLP under a
    sparse plan, or the reverse: ``check_layer_kind``)."""
    names = list(names)
    check_layer_kind(plan, names, prefix)
    layouts = _layouts_of(names, prefix, strict=False)
    return plan if plan.layout in layouts else relayout(plan, layouts[0])


_DENSE_SOURCES = frozenset(s for _, dense, _ in FAMILIES.values() for r in dense for s in r.sources)


def check_layer_kind(plan: LayerPlan, names: Iterable[str], prefix: str = "") -> None:
    """Refuse a layer's tensors (short names, any trainer layout, any part of the layer) whose MLP
    is of the other kind than ``plan``'s: a dense MLP's tensors under a sparse (or MTP) plan, or a
    sparse one's under a dense plan. The two name sets are disjoint in every layout, so one name
    decides; KeyError naming it (``prefix + key``: the user's own name) and the layer's kind.
    Without this the first tensor the plan misses would be named, in the plan's layout."""
    kind = plan.kind.split("/")[0]
    if kind not in ("dense", "sparse", "mtp"):
        return
    sparse_plan = kind != "dense"
    bad = next((n for n in names if (n in _DENSE_SOURCES if sparse_plan else is_sparse_names((n,)))), None)
    if bad is None:
        return
    m = _LAYER_KEY.match(prefix)
    layer = f"layer {m.group(1)}" if m else "this layer"
    fields = (
        "mlp_only_layers / decoder_sparse_step"
        if plan.model_type == "qwen3_moe"
        else "first_k_dense_replace / mlp_layer_types"
    )
    if sparse_plan:
        what = "sparse (MoE)" if kind == "sparse" else "the MTP layer, sparse (MoE),"
        held = "a dense MLP"
        want = (
            "its router and routed experts: mlp.router.gate.weight, mlp.experts.w1/w2/w3 in prime-rl's "
            "names; mlp.gate.weight, mlp.experts.gate_up_proj/down_proj in transformers' (or "
            "mlp.experts.{j}.gate_proj.weight... per expert)"
        )
    else:
        what, held = "dense", "a sparse (MoE) MLP"
        want = "a dense MLP: mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight"
    raise KeyError(
        f"{prefix}{bad}: {layer} is {what} in this config but the state dict holds {held}; "
        f"pass {layer}'s own tensors ({want}), or check the config's {fields} "
        "(docs/trainers.md#trainer-layouts)"
    )


def source_rows(
    plan: LayerPlan, entry_name: str, layer: Mapping[str, torch.Tensor], lo: int, hi: int
) -> dict[str, torch.Tensor]:
    """The trainer tensors of rows [lo, hi) of entry ``entry_name`` (short kernel-format name) of
    ``plan`` (adapted to ``layer``'s layout): a narrow of dim 0 of each stacked source (a view),
    or the per-expert tensors of experts lo..hi-1 under their own names. The inputs of
    ``plan.with_rows({entry_name: (lo, hi)})`` for that entry."""
    e = plan.entry(entry_name)
    lo, hi = check_rows(f"rows of {entry_name}", (lo, hi), e.shape[0])
    names = [s for g in e.groups()[lo:hi] for s in g] if e.per_expert else list(e.sources)
    missing = [s for s in names if s not in layer]
    if missing:
        raise KeyError(f"{missing[0]}: missing from the layer (a source of {entry_name} rows {lo}..{hi - 1})")
    if e.per_expert:
        return {s: layer[s] for s in names}
    return {s: layer[s].narrow(0, lo, hi - lo) for s in names}
