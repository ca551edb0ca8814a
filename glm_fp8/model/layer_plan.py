"""What a layer plan is: ``PlanEntry`` (one named view of the layer's single broadcast buffer) and
``LayerPlan`` (every entry of one layer, with the trainer tensors they are made from), with their
offsets and the derived plans a sender cuts from one (``subset``, ``with_rows``). How a plan is
built is ``glm_fp8.model.plans``'s; how it reads another trainer layout is ``glm_fp8.model.trainer_layouts``'.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from glm_fp8.core.numerics import ceil_blocks
from glm_fp8.model.families import PRIME_RL

ALIGN = 256  # bytes: every view is aligned for any dtype, and NCCL likes 256-byte chunks
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
            {
                "name": e.name,
                "dtype": _DTYPE_NAMES[e.dtype],
                "shape": list(e.shape),
                "offset": e.offset,
                "nbytes": e.nbytes,
            }
            for e in self.entries
        ]

    def entry(self, name: str) -> PlanEntry:
        """The entry named ``name`` (short kernel-format name); ValueError naming it if none."""
        for e in self.entries:
            if e.name == name:
                return e
        raise ValueError(
            f"{name}: not an entry of this {self.kind} layer's plan (entries: "
            f"{', '.join(e.name for e in self.entries)})"
        )

    def subset(self, names: Iterable[str], last: Iterable[str] = ()) -> LayerPlan:
        """The plan of only the entries named in ``names`` (a quantized entry keeps its scale
        when both are named), laid out afresh one after another, those also named in ``last``
        after the others (each group in this plan's order); ``inputs`` keeps their sources. A
        sender that converts part of a layer (``glm_fp8.transfer.owners``) fills one: its largest
        segment's entries last, so that they lie in its buffer as they travel."""
        names, last = set(names), set(last)
        entries, offset = [], 0
        kept = [e for e in self.entries if e.name in names]
        for e in [e for e in kept if e.name not in last] + [e for e in kept if e.name in last]:
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
        memo = plan_memo(self)
        if key not in memo:
            memo[key] = self._with_rows(rows)
        return memo[key]

    def _with_rows(self, rows: Mapping[str, tuple[int, int]]) -> LayerPlan:
        rows = dict(rows)
        for name in [n for n in rows if self.entry(n).op == "scale"]:  # a scale goes with its weight
            weight = name.removesuffix("_scale_inv")
            if rows.setdefault(weight, rows[name]) != rows[name]:
                raise ValueError(
                    f"rows[{name!r}]: {rows[name]!r}, but its weight {weight!r} has "
                    f"{rows[weight]!r}; a scale follows its weight"
                )
            del rows[name]
        for name, bounds in rows.items():
            e = self.entry(name)
            # A 2-D concatenation's rows span its sources, a quantized matrix's rows its blocks.
            if e.squeeze or not (len(e.shape) == 3 or e.op == "copy"):
                raise ValueError(
                    f"rows[{name!r}]: only an expert stack (a 3-D entry) or a matrix copied "
                    f"from one source is cut by rows, got a {e.op} entry of shape "
                    f"{e.shape}"
                )
            check_rows(f"rows[{name!r}]", bounds, e.shape[0])
        entries: list[PlanEntry] = []
        inputs = dict(self.inputs)
        offset = 0
        for k, e in enumerate(self.entries):
            if e.op == "scale" and self.entries[k - 1].name in rows:
                e = scale_entry(e.name, entries[-1].shape, self.target, offset)
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


def plan_memo(plan: LayerPlan) -> dict:
    """Per-plan cache of derived plans (relayouts, row cuts): held by the plan itself, outside its
    fields, so that it neither changes its equality nor outlives it."""
    return plan.__dict__.setdefault("_derived", {})


def check_rows(what: str, bounds: object, n: int) -> tuple[int, int]:
    ok = isinstance(bounds, (tuple, list)) and len(bounds) == 2
    ok = ok and all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
    if not ok or not 0 <= bounds[0] <= bounds[1] <= n:
        raise ValueError(f"{what}: expected (lo, hi) with 0 <= lo <= hi <= {n}, got {bounds!r}")
    return bounds[0], bounds[1]


def align(n: int, a: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a`` (default: ``ALIGN``, where every buffer view starts)."""
    return -(-n // a) * a


def packed_ue8m0_shape(weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of DeepGEMM's SM100 packed UE8M0 scales of a weight [(E,) N, K]: one row per weight
    row, four K-blocks' exponents per int32 (docs/layouts.md#deepgemm-sm100-packed-ue8m0-scales)."""
    *g, n, k = weight_shape
    return (*g, n, -(-ceil_blocks(k) // 4))


def scale_entry(name: str, shape: tuple[int, ...], target: str, offset: int) -> PlanEntry:
    *g, n, k = shape
    if target == "hopper":
        return PlanEntry(name, "scale", torch.float32, (*g, ceil_blocks(n), ceil_blocks(k)), offset)
    packed = packed_ue8m0_shape(shape)
    storage = (*g, packed[-1], align(n, 4))  # MN-major
    return PlanEntry(name, "scale", torch.int32, packed, offset, storage_shape=storage)
