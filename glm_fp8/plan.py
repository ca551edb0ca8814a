"""Layer plans: which kernel-format entries a trainer layer becomes, and where each one lives
in the layer's single broadcast buffer (docs/layouts.md#layer-buffer).

A plan is built once per layer shape, from a model config (``glm_fp8.models``: presets or a
config.json) or inferred from one layer's state dict, and then reused for every update.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from glm_fp8.models import (
    FAMILIES,
    INDEXER_FAMILIES,
    INDEXER_PREFIX,
    MTP_RULES,
    REST,
    REST_RULES,
    has_indexer,
    infer_model_type,
    layer_kind,
    layer_shapes,
    mtp_layer_index,
)
from glm_fp8.models import model_layer_ids as model_layer_ids  # re-exported: whole-model layer_ids
from glm_fp8.numerics import ceil_blocks

ALIGN = 256  # bytes: every view is aligned for any dtype, and NCCL likes 256-byte chunks
TARGETS = ("hopper", "blackwell")
SCALE_FMTS = ("fp32", "ue8m0")
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

    # "dense" or "sparse", + "/no-indexer" for an indexer family's shared layer (models.layer_kind);
    # "mtp" (a sparse layer and the MTP layer's own tensors) or "rest" (the non-layer tensors)
    kind: str
    target: str
    quantize: bool
    entries: tuple[PlanEntry, ...]
    inputs: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = field(default_factory=dict)
    nbytes: int = 0
    scale_fmt: str = "fp32"  # "ue8m0": power-of-two scales (DeepGEMM); always so for Blackwell

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

    def subset(self, names: Iterable[str]) -> LayerPlan:
        """The plan of only the entries named in ``names`` (a quantized entry keeps its scale
        when both are named), laid out afresh one after another; ``inputs`` keeps their
        sources. A sender that converts part of a layer (``glm_fp8.engine.routes``) fills one."""
        names = set(names)
        entries, offset = [], 0
        for e in self.entries:
            if e.name in names:
                entries.append(dataclasses.replace(e, offset=offset))
                offset = align(offset + e.nbytes)
        sources = {s for e in entries for s in e.sources}
        inputs = {k: v for k, v in self.inputs.items() if k in sources}
        return dataclasses.replace(self, entries=tuple(entries), inputs=inputs, nbytes=offset)

    def input_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the trainer tensors this layer reads (in ``dtype`` if given)."""
        return sum(
            (dtype or dt or torch.bfloat16).itemsize * math.prod(shape) for shape, dt in self.inputs.values()
        )


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
) -> LayerPlan:
    """Plan one layer from its trainer tensors' shapes and dtypes (dtype None: not known yet,
    the entry takes the source's dtype at conversion). The layer is a decoder layer, the MTP
    layer (it holds ``enorm.weight``) or the non-layer tensors (``model.embed_tokens.weight``
    and the rest, under their full names). ``scale_fmt``: "fp32" (default for Hopper) or
    "ue8m0" (power-of-two scales, as DeepGEMM needs; Blackwell's only format)."""
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
    attention, dense, sparse = FAMILIES[model_type]
    indexer = False
    if any(r.out in inputs for r in REST_RULES):
        kind, rules = "rest", REST_RULES
    else:
        kind = "sparse" if "mlp.experts.w1" in inputs else "dense"
        rules = attention + (sparse if kind == "sparse" else dense)
        # The indexer is all or nothing: an IndexShare "shared" layer holds none of its tensors.
        indexer = any(k.startswith(INDEXER_PREFIX) for k in inputs)
        if model_type in INDEXER_FAMILIES and not indexer:
            kind += "/no-indexer"
        if "enorm.weight" in inputs:
            kind, rules = "mtp", rules + MTP_RULES
    entries: list[PlanEntry] = []
    offset = 0
    used: set[str] = set()
    for rule in rules:
        present = [s in inputs for s in rule.sources]
        if (rule.optional and not any(present)) or (rule.group == "indexer" and not indexer):
            continue
        for src, ok in zip(rule.sources, present):
            if not ok:
                hint = (f"; a layer holds every {INDEXER_PREFIX}* tensor or none (a shared IndexShare layer)"
                        if rule.group == "indexer" else "")  # fmt: skip
                raise KeyError(f"{src}: missing from the layer (needed for {rule.out}){hint}")
        used.update(rule.sources)
        shapes = [squeezed(tuple(inputs[s][0]), rule.squeeze) for s in rule.sources]
        rows = sum(s[-2] for s in shapes) if len(shapes[0]) >= 2 else sum(s[0] for s in shapes)
        shape = (*shapes[0][:-2], rows, shapes[0][-1]) if len(shapes[0]) >= 2 else (rows,)
        if rule.quantize and quantize:
            entries.append(PlanEntry(rule.out, "quantize", torch.float8_e4m3fn, shape, offset,
                                     rule.sources, rule.squeeze))  # fmt: skip
            offset = align(offset + entries[-1].nbytes)
            entries.append(_scale_entry(rule.out + "_scale_inv", shape, target, offset))
        else:
            op = "copy" if len(rule.sources) == 1 else "concat"
            dtype = inputs[rule.sources[0]][1] or torch.bfloat16
            entries.append(PlanEntry(rule.out, op, dtype, shape, offset, rule.sources, rule.squeeze))
        offset = align(offset + entries[-1].nbytes)
    extra = sorted(set(inputs) - used)
    if extra:
        raise KeyError(f"{extra[0]}: not a tensor of a {model_type} {kind} layer (no rule uses it)")
    return LayerPlan(kind, target, quantize, tuple(entries), dict(inputs), offset, scale_fmt)


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
    """The layer's tensors under their short names. Keys may carry the ``model.layers.{i}.``
    prefix (keys of other layers are then ignored) or be short already."""
    prefix = layer_prefix(layer_idx)
    if any(k.startswith(prefix) for k in state_dict):
        return {k[len(prefix) :]: t for k, t in state_dict.items() if k.startswith(prefix)}
    if any(k.startswith("model.layers.") for k in state_dict):
        raise KeyError(f"state_dict: no key starts with {prefix!r} (layer_idx={layer_idx})")
    return dict(state_dict)


def plan_from_config(
    config: Mapping,
    layer_idx: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    target: str = "hopper",
    quantize: bool = True,
    scale_fmt: str | None = None,
) -> LayerPlan:
    """Plan layer ``layer_idx`` of a model config (a decoder layer, the MTP layer or ``REST``);
    passthrough entries take ``dtype``. The layer follows the config's indexer schedule
    (``glm_fp8.models.skip_topk_layers``)."""
    shapes = layer_shapes(config, layer_idx)
    return build_plan(config["model_type"], {k: (s, dtype) for k, s in shapes.items()}, target=target,
                      quantize=quantize, scale_fmt=scale_fmt)  # fmt: skip


def plans_for_model(
    config: Mapping,
    mode: str = "fp8",
    target: str = "hopper",
    layer_ids: Sequence[int] | None = None,
    scale_fmt: str | None = None,
) -> list[LayerPlan]:
    """One plan per layer of ``layer_ids`` (default: every decoder layer; the MTP layer and
    ``REST`` may be listed too), built once per kind of layer (``glm_fp8.models.layer_kind``:
    dense or sparse MLP, with or without an indexer)."""
    cache: dict[object, LayerPlan] = {}
    out = []
    mtp = mtp_layer_index(config)
    for i in range(config["num_hidden_layers"]) if layer_ids is None else layer_ids:
        kind = i if i in (REST, mtp) else layer_kind(config, i)
        if kind not in cache:
            cache[kind] = plan_from_config(
                config, i, target=target, quantize=mode == "fp8", scale_fmt=scale_fmt
            )
        out.append(cache[kind])
    return out


def check_schedule(config: Mapping, layer_idx: int, names: Iterable[str]) -> None:
    """Refuse a layer's tensors (short names) that disagree with the config's indexer schedule:
    an ``self_attn.indexer.*`` tensor in a layer the schedule shares, or none in a full layer.
    KeyError naming the layer's key."""
    names = sorted(names)
    if config.get("model_type") not in INDEXER_FAMILIES:
        return
    prefix = layer_prefix(layer_idx)
    found = [k for k in names if k.startswith(INDEXER_PREFIX)]
    if has_indexer(config, layer_idx):
        if not found:
            raise KeyError(f"{prefix}{INDEXER_PREFIX}wq_b.weight: missing; the config's indexer schedule "
                           f"gives layer {layer_idx} an indexer (a full layer)")  # fmt: skip
    elif found:
        raise KeyError(f"{prefix}{found[0]}: unexpected; the config's indexer schedule makes layer "
                       f"{layer_idx} a shared layer without an indexer (it reuses the previous full layer's "
                       "top-k)")  # fmt: skip


def plan_from_state_dict(
    layer: Mapping[str, torch.Tensor], *, target: str = "hopper", quantize: bool = True
) -> LayerPlan:
    """Plan a layer from its tensors (names without the ``model.layers.{i}.`` prefix)."""
    inputs = {k: (tuple(t.shape), t.dtype) for k, t in layer.items()}
    return build_plan(infer_model_type(set(layer)), inputs, target=target, quantize=quantize)
