"""Layer plans: which kernel-format entries a trainer layer becomes, and where each one lives
in the layer's single broadcast buffer (docs/layouts.md#layer-buffer).

A plan is built once per layer shape, from a model config (``glm_fp8.models``: presets, a
config.json, a transformers config object) or inferred from one layer's state dict, and then
reused for every update. Its entries (names, order, shapes, dtypes, offsets: the manifest)
depend on the model only; where they come from depends on the trainer's layout of its tensors
(docs/trainers.md#trainer-layouts): ``adapt_plan`` gives the same plan reading another layout.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from glm_fp8.config import FAMILY_TRAITS, as_config
from glm_fp8.indexer import INDEXER_FAMILIES, INDEXER_PREFIX, has_indexer
from glm_fp8.models import (
    EXPERT,
    FAMILIES,
    HF,
    HF_CHECKPOINT,
    MTP_RULES,
    PRIME_RL,
    REST,
    REST_RULES,
    SOURCE_LAYOUTS,
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
)
from glm_fp8.models import model_layer_ids as model_layer_ids  # re-exported: whole-model layer_ids
from glm_fp8.numerics import SCALE_FMTS, ceil_blocks

ALIGN = 256  # bytes: every view is aligned for any dtype, and NCCL likes 256-byte chunks
TARGETS = ("hopper", "blackwell")
LAYOUTS = (PRIME_RL, HF, HF_CHECKPOINT)  # trainer layouts, in the order ``trainer_layout`` prefers
BIAS_ENTRY = "mlp.gate.e_score_correction_bias"
_BIAS_SOURCES = frozenset(s for t in TRAINER_LAYOUTS.values() for s in t.get(BIAS_ENTRY, ()))
_DTYPE_NAMES = {
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int32: "int32",
}


@dataclass(frozen=True)
class PlanEntry:
    """One named view of the layer buffer.

    ``op``: "quantize" (fp8 from ``sources``), "scale" (block scales of the entry before it),
    "concat" (sources copied row after row, converted to ``dtype``), "copy" (one source,
    converted to ``dtype``). A Blackwell scale is int32 stored [G, P, align(N, 4)] and viewed as
    [G, N, P] (MN-major). ``per_expert``: a [E, R, C] entry whose ``sources`` are E groups of
    2-D tensors, group j (``groups()[j]``) row-concatenated into expert j (a Hugging Face
    checkpoint's ``mlp.experts.{j}.*``).
    """

    name: str
    op: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    sources: tuple[str, ...] = ()
    squeeze: bool = False
    storage_shape: tuple[int, ...] | None = None  # set when the view is not contiguous
    per_expert: bool = False

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.storage_shape or self.shape)

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        raw = buffer[self.offset : self.offset + self.nbytes].view(self.dtype)
        if self.storage_shape is None:
            return raw.view(self.shape)
        return raw.view(self.storage_shape).transpose(-1, -2)[..., : self.shape[-2], :]

    def groups(self) -> list[tuple[str, ...]]:
        """The sources of each expert (``per_expert``), else one group of all of them."""
        if not self.per_expert:
            return [self.sources]
        k = len(self.sources) // self.shape[0] if self.shape[0] else 0
        return [self.sources[j * k : (j + 1) * k] for j in range(self.shape[0])]


@dataclass(frozen=True)
class LayerPlan:
    """Every kernel-format entry of one layer, packed into one byte buffer of ``nbytes``;
    ``inputs``: the trainer tensors they are made from (short names, in ``layout``), with their
    shapes and the dtype they are expected in (None: any)."""

    # "dense" or "sparse", + "/no-indexer" for an indexer family's shared layer, + "/no-bias" for a
    # family whose engine has no routing bias under this config (models.layer_kind); "mtp" (a
    # sparse layer and the MTP layer's own tensors) or "rest" (the non-layer tensors)
    kind: str
    target: str
    quantize: bool
    entries: tuple[PlanEntry, ...]
    inputs: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = field(default_factory=dict)
    nbytes: int = 0
    scale_fmt: str = "fp32"  # "ue8m0": power-of-two scales (DeepGEMM); always so for Blackwell
    layout: str = PRIME_RL  # the trainer layout of ``inputs`` and the entries' ``sources``
    model_type: str = ""

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

    def entry(self, name: str) -> PlanEntry:
        """The entry named ``name`` (short kernel-format name); ValueError naming it if none."""
        for e in self.entries:
            if e.name == name:
                return e
        raise ValueError(f"{name}: not an entry of this {self.kind} layer's plan (entries: "
                         f"{', '.join(e.name for e in self.entries)})")  # fmt: skip

    def subset(self, names: Iterable[str]) -> LayerPlan:
        """The plan of only the entries named in ``names`` (a quantized entry keeps its scale
        when both are named), laid out afresh one after another; ``inputs`` keeps their
        sources. A sender that converts part of a layer (``glm_fp8.transfer.owners``) fills one."""
        names = set(names)
        entries, offset = [], 0
        for e in self.entries:
            if e.name in names:
                entries.append(dataclasses.replace(e, offset=offset))
                offset = align(offset + e.nbytes)
        sources = {s for e in entries for s in e.sources}
        inputs = {k: v for k, v in self.inputs.items() if k in sources}
        return dataclasses.replace(self, entries=tuple(entries), inputs=inputs, nbytes=offset)

    def with_rows(self, rows: Mapping[str, tuple[int, int]]) -> LayerPlan:
        """The plan of only rows [lo, hi) along dim 0 of each entry named in ``rows`` (short
        kernel-format names: an expert stack such as "mlp.experts.w13_weight", whose rows are
        experts, quantized or not, or a passthrough matrix copied from one source such as
        "model.embed_tokens.weight"); a quantized entry's scale follows it (naming the scale too,
        with the same rows, is allowed), other entries are
        unchanged; laid out afresh. Its ``inputs`` are the sources of those rows: a stacked
        source with ``hi - lo`` rows (``source_rows`` narrows it), the per-expert keys of experts
        lo..hi-1 under their own (global) names. Cached per plan. Many senders use it: each
        trainer rank converts its own experts (``glm_fp8.transfer.owners``)."""
        key = ("rows", tuple(sorted((str(k), tuple(v)) for k, v in rows.items())))
        memo = _memo(self)
        if key not in memo:
            memo[key] = self._with_rows(rows)
        return memo[key]

    def _with_rows(self, rows: Mapping[str, tuple[int, int]]) -> LayerPlan:
        rows = dict(rows)
        for name in [n for n in rows if self.entry(n).op == "scale"]:  # a scale goes with its weight
            weight = name.removesuffix("_scale_inv")
            if rows.setdefault(weight, rows[name]) != rows[name]:
                raise ValueError(f"rows[{name!r}]: {rows[name]!r}, but its weight {weight!r} has "
                                 f"{rows[weight]!r}; a scale follows its weight")  # fmt: skip
            del rows[name]
        for name, bounds in rows.items():
            e = self.entry(name)
            # A 2-D concatenation's rows span its sources, a quantized matrix's rows its blocks.
            if e.squeeze or not (len(e.shape) == 3 or e.op == "copy"):
                raise ValueError(f"rows[{name!r}]: only an expert stack (a 3-D entry) or a matrix copied "
                                 f"from one source is cut by rows, got a {e.op} entry of shape "
                                 f"{e.shape}")  # fmt: skip
            _check_rows(f"rows[{name!r}]", bounds, e.shape[0])
        entries: list[PlanEntry] = []
        inputs = dict(self.inputs)
        offset = 0
        for k, e in enumerate(self.entries):
            if e.op == "scale" and self.entries[k - 1].name in rows:
                e = _scale_entry(e.name, entries[-1].shape, self.target, offset)
            elif e.name in rows:
                lo, hi = rows[e.name]
                if e.per_expert:
                    sources = tuple(s for g in e.groups()[lo:hi] for s in g)
                    for s in set(e.sources) - set(sources):
                        del inputs[s]
                else:
                    sources = e.sources
                    for s in sources:
                        shape, dtype = inputs[s]
                        inputs[s] = ((hi - lo, *shape[1:]), dtype)
                e = dataclasses.replace(e, shape=(hi - lo, *e.shape[1:]), sources=sources, offset=offset)
            else:
                e = dataclasses.replace(e, offset=offset)
            entries.append(e)
            offset = align(offset + e.nbytes)
        return dataclasses.replace(self, entries=tuple(entries), inputs=inputs, nbytes=offset)

    def input_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the trainer tensors this layer reads (in ``dtype`` if given)."""
        return sum(
            (dtype or dt or torch.bfloat16).itemsize * math.prod(shape) for shape, dt in self.inputs.values()
        )


def _memo(plan: LayerPlan) -> dict:
    """Per-plan cache of derived plans (relayouts, row cuts): held by the plan itself, outside its
    fields, so that it neither changes its equality nor outlives it."""
    return plan.__dict__.setdefault("_derived", {})


def _check_rows(what: str, bounds: object, n: int) -> tuple[int, int]:
    ok = isinstance(bounds, (tuple, list)) and len(bounds) == 2
    ok = ok and all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
    if not ok or not 0 <= bounds[0] <= bounds[1] <= n:
        raise ValueError(f"{what}: expected (lo, hi) with 0 <= lo <= hi <= {n}, got {bounds!r}")
    return bounds[0], bounds[1]


def align(n: int, a: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a`` (default: ``ALIGN``, where every buffer view starts)."""
    return -(-n // a) * a


def _scale_entry(name: str, shape: tuple[int, ...], target: str, offset: int) -> PlanEntry:
    *g, n, k = shape
    nb = (ceil_blocks(n), ceil_blocks(k))
    if target == "hopper":
        return PlanEntry(name, "scale", torch.float32, (*g, *nb), offset)
    p = -(-nb[1] // 4)  # four ue8m0 exponent bytes per int32, DeepGEMM SM100
    return PlanEntry(name, "scale", torch.int32, (*g, n, p), offset, storage_shape=(*g, p, align(n, 4)))


def build_plan(
    model_type: str,
    inputs: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
    *,
    target: str = "hopper",
    quantize: bool = True,
    scale_fmt: str | None = None,
    model_dtype: torch.dtype | None = None,
) -> LayerPlan:
    """Plan one layer from its trainer tensors' shapes and dtypes (dtype None: not known yet),
    in whichever trainer layout their names follow (``trainer_layout``). The layer is a decoder
    layer, the MTP layer (it holds ``enorm.weight``) or the non-layer tensors
    (``model.embed_tokens.weight`` and the rest, under their full names). ``scale_fmt``: "fp32"
    (default for Hopper) or "ue8m0" (power-of-two scales, as DeepGEMM needs; Blackwell's only
    format). Passthrough entries take ``model_dtype`` as the engine does (float32 for
    ``glm_fp8.models.float32_entries``), and so do their inputs; None: their first source's dtype
    (a state dict's plan keeps the trainer's dtypes)."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type: expected one of {sorted(FAMILIES)}, got {model_type!r}")
    if target not in TARGETS:
        raise ValueError(f"target: expected one of {TARGETS}, got {target!r}")
    if scale_fmt is None:
        scale_fmt = "ue8m0" if target == "blackwell" else "fp32"
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt: expected one of {SCALE_FMTS}, got {scale_fmt!r}")
    if target == "blackwell" and scale_fmt != "ue8m0":
        raise ValueError("scale_fmt: Blackwell's packed scales are ue8m0 only, got 'fp32'")
    layout = trainer_layout(inputs)
    attention, dense, sparse = FAMILIES[model_type]
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
                hint = (f"; a layer holds every {INDEXER_PREFIX}* tensor or none (a shared IndexShare layer)"
                        if rule.group == "indexer" else "")  # fmt: skip
                raise KeyError(f"{src}: missing from the layer (needed for {rule.out}){hint}")
        used.update(sources)
        if per_expert:
            shape = _per_expert_shape(rule.out, sources, inputs, experts)
        else:
            shapes = [squeezed(tuple(inputs[s][0]), rule.squeeze) for s in sources]
            rows = sum(s[-2] for s in shapes) if len(shapes[0]) >= 2 else sum(s[0] for s in shapes)
            shape = (*shapes[0][:-2], rows, shapes[0][-1]) if len(shapes[0]) >= 2 else (rows,)
        if rule.quantize and quantize:
            entries.append(PlanEntry(rule.out, "quantize", torch.float8_e4m3fn, shape, offset, sources,
                                     rule.squeeze, per_expert=per_expert))  # fmt: skip
            offset = align(offset + entries[-1].nbytes)
            entries.append(_scale_entry(rule.out + "_scale_inv", shape, target, offset))
        else:
            op = "copy" if len(sources) == 1 else "concat"
            if model_dtype is None:
                dtype = inputs[sources[0]][1] or torch.bfloat16
            else:
                dtype = torch.float32 if rule.out in fp32 else model_dtype
                planned.update({s: (tuple(inputs[s][0]), dtype) for s in sources})
            entries.append(PlanEntry(rule.out, op, dtype, shape, offset, sources, rule.squeeze,
                                     per_expert=per_expert))  # fmt: skip
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
        return (f"{key}: a decoder layer's key, but layer_idx={REST} (REST: the non-layer tensors, "
                f"{', '.join(r.out for r in REST_RULES)}, under these full names){own}")  # fmt: skip
    expected = f"{layer_prefix(layer_idx)}<name> or short names such as input_layernorm.weight"
    return f"{key}: a key of another layer, but layer_idx={layer_idx} (expected keys {expected}){own}"


def plan_from_config(
    config: object,
    layer_idx: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    target: str = "hopper",
    quantize: bool = True,
    scale_fmt: str | None = None,
) -> LayerPlan:
    """Plan layer ``layer_idx`` of a model config (anything ``glm_fp8.config.as_config`` takes; a
    decoder layer, the MTP layer or ``REST``) in prime-rl's trainer layout (``adapt_plan`` reads
    others). ``dtype``: the engine's model dtype; passthrough entries are written in the dtype
    the engine holds them in (float32 for ``glm_fp8.models.float32_entries``, else ``dtype``),
    from whatever floating dtype the trainer holds. The layer follows the config's indexer
    schedule (``glm_fp8.indexer.skip_topk_layers``) and routing bias (``has_routing_bias``)."""
    c = as_config(config)
    shapes = layer_shapes(c, layer_idx)
    return build_plan(c["model_type"], {k: (s, dtype) for k, s in shapes.items()}, target=target,
                      quantize=quantize, scale_fmt=scale_fmt, model_dtype=dtype)  # fmt: skip


def plans_for_model(
    config: object,
    mode: str = "fp8",
    target: str = "hopper",
    layer_ids: Sequence[int] | None = None,
    scale_fmt: str | None = None,
) -> list[LayerPlan]:
    """One plan per layer of ``layer_ids`` (default: every decoder layer; the MTP layer and
    ``REST`` may be listed too, and need not be: a trainer that does not model the MTP layer
    updates the target only), built once per kind of layer (``glm_fp8.models.layer_kind``:
    dense or sparse MLP, with or without an indexer)."""
    c = as_config(config)
    cache: dict[object, LayerPlan] = {}
    out = []
    mtp = mtp_layer_index(c)
    for i in range(c["num_hidden_layers"]) if layer_ids is None else layer_ids:
        kind = i if i in (REST, mtp) else layer_kind(c, i)
        if kind not in cache:
            cache[kind] = plan_from_config(c, i, target=target, quantize=mode == "fp8", scale_fmt=scale_fmt)
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
        raise KeyError(f"{layer_prefix(layer_idx)}{INDEXER_PREFIX}wq_b.weight: missing; the config's indexer "
                       f"schedule gives layer {layer_idx} an indexer (a full layer)")  # fmt: skip


def plan_from_state_dict(
    layer: Mapping[str, torch.Tensor], *, target: str = "hopper", quantize: bool = True
) -> LayerPlan:
    """Plan a layer from its tensors (names without the ``model.layers.{i}.`` prefix, any
    trainer layout); passthrough entries keep the tensors' dtypes."""
    inputs = {k: (tuple(t.shape), t.dtype) for k, t in layer.items()}
    return build_plan(infer_model_type(set(layer)), inputs, target=target, quantize=quantize)


# --- trainer layouts (docs/trainers.md#trainer-layouts) ----------------------------------------------


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
                raise KeyError(f"{prefix}{n}: not a tensor name of any trainer layout ({', '.join(LAYOUTS)}; "
                               "docs/trainers.md#trainer-layouts)")  # fmt: skip
            continue
        if allowed <= layouts:
            continue
        if not allowed & layouts:
            other, theirs = next((m for m in reversed(markers) if not m[1] & layouts), markers[-1])
            raise KeyError(f"{prefix}{n}: a {'/'.join(sorted(layouts))} name, but {prefix}{other} is a "
                           f"{'/'.join(sorted(theirs))} name; a layer's tensors follow one trainer layout "
                           "(docs/trainers.md#trainer-layouts)")  # fmt: skip
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
    memo = _memo(plan)
    if ("layout", layout) not in memo:
        other = _relayout(plan, layout)
        memo[("layout", layout)] = other
        _memo(other)[("layout", plan.layout)] = plan
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
            raise ValueError(f"{e.name}: {rows} rows do not split into the {len(sources)} sources of the "
                             f"{layout} layout ({', '.join(sources)})")  # fmt: skip
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
    of two layouts; a name of none is left to the checks (``glm_fp8.convert.check_layer_keys``:
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
    fields = ("mlp_only_layers / decoder_sparse_step" if plan.model_type == "qwen3_moe"
              else "first_k_dense_replace / mlp_layer_types")  # fmt: skip
    if sparse_plan:
        what = "sparse (MoE)" if kind == "sparse" else "the MTP layer, sparse (MoE),"
        held = "a dense MLP"
        want = ("its router and routed experts: mlp.router.gate.weight, mlp.experts.w1/w2/w3 in prime-rl's "
                "names; mlp.gate.weight, mlp.experts.gate_up_proj/down_proj in transformers' (or "
                "mlp.experts.{j}.gate_proj.weight... per expert)")  # fmt: skip
    else:
        what, held = "dense", "a sparse (MoE) MLP"
        want = "a dense MLP: mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight"
    raise KeyError(f"{prefix}{bad}: {layer} is {what} in this config but the state dict holds {held}; "
                   f"pass {layer}'s own tensors ({want}), or check the config's {fields} "
                   "(docs/trainers.md#trainer-layouts)")  # fmt: skip


def source_rows(
    plan: LayerPlan, entry_name: str, layer: Mapping[str, torch.Tensor], lo: int, hi: int
) -> dict[str, torch.Tensor]:
    """The trainer tensors of rows [lo, hi) of entry ``entry_name`` (short kernel-format name) of
    ``plan`` (adapted to ``layer``'s layout): a narrow of dim 0 of each stacked source (a view),
    or the per-expert tensors of experts lo..hi-1 under their own names. The inputs of
    ``plan.with_rows({entry_name: (lo, hi)})`` for that entry."""
    e = plan.entry(entry_name)
    lo, hi = _check_rows(f"rows of {entry_name}", (lo, hi), e.shape[0])
    names = [s for g in e.groups()[lo:hi] for s in g] if e.per_expert else list(e.sources)
    missing = [s for s in names if s not in layer]
    if missing:
        raise KeyError(f"{missing[0]}: missing from the layer (a source of {entry_name} rows {lo}..{hi - 1})")
    if e.per_expert:
        return {s: layer[s] for s in names}
    return {s: layer[s].narrow(0, lo, hi - lo) for s in names}


# --- trainer tensors the engine has no parameter for ------------------------------------------------

_UNSENT_WHY = {
    "indexer": "self_attn.indexer.* on a layer the config's indexer schedule shares (IndexShare): the engine "
               "builds no indexer there (a Hugging Face trainer builds one in every layer)",
    "routing bias": "the routing bias (e_score_correction_bias) under a config whose topk_method is not "
                    "'noaux_tc': the engine builds none",
}  # fmt: skip
_warned: set[str] = set()


def unsent_keys(kind: str, names: Iterable[str]) -> dict[str, str]:
    """The trainer tensors (short names) of a layer of ``kind`` (``LayerPlan.kind``, or
    ``glm_fp8.models.layer_kind`` of a config's layer) that the engine has no parameter for, by
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
            warnings.warn(f"{prefix}{key} (and every such tensor, said once): not sent; {_UNSENT_WHY[kind]}",
                          stacklevel=3)  # fmt: skip
