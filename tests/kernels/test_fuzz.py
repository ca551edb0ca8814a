"""Seeded differential fuzz test: random shapes, dtypes, strided source layouts and output
views, every result compared bit for bit against ``glm_fp8.kernels.reference``.

Why: a layout-specific Triton bug (float32 sources stored column-major within each expert gave
wrong fp8 bytes on the H200, Triton 3.6) passed every CPU test, because Triton's interpreter
does not compile what the GPU runs. ``test_fuzz_gpu`` runs several hundred random cases per GPU
backend; ``test_fuzz_cpu`` runs a few small ones through the same generator and harness in CI
(the Triton interpreter and the torch backend).

Reproducible: case i uses seed ``GLM_FP8_FUZZ_SEED + i`` (Python ``random`` for the case's
structure, a torch Generator on the test device for the values). ``GLM_FP8_FUZZ_CASES`` sets the
count (GPU default 400; the CPU test runs at most ``CPU_MAX_CASES`` small cases);
``GLM_FP8_FUZZ_BUDGET_S`` stops a GPU backend's loop after that many seconds (default 120, 0:
never), and fails the test if it stopped before ``GLM_FP8_FUZZ_MIN_CASES`` cases (default 100):
a run cut short by its budget never passes on a handful of cases; ``GLM_FP8_FUZZ_WORKERS``
spreads the cases over spawned processes (Triton on a GPU: 8 by
default, since a cold Triton compiles about one kernel per case, ~1 s each). A failure prints
each failing seed with its full case description; replay one case with ``GLM_FP8_FUZZ_SEED=<seed>
GLM_FP8_FUZZ_CASES=1 python3 -m pytest -q -rA tests/kernels/test_fuzz.py -k <test id>``.

Each backend's loop writes one summary line to the terminal (through pytest's capture, so it
shows with plain ``pytest -q``), e.g. ``fuzz: backend=triton device=cuda profile=gpu cases=400/400
failures=0 ...`` followed by per-category case counts.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from conftest import BACKENDS, GPU_BACKENDS, ON_GPU, assert_same_bits, poisoned_f32, poisoned_fp8

from glm_fp8 import ExpertsFP8, quantize_blockwise, quantize_experts
from glm_fp8.core.numerics import BLOCK, ceil_blocks
from glm_fp8.kernels.reference import quantize_concat_ref, quantize_experts_ref

DEFAULT_SEED = 20261203
GPU_DEFAULT_CASES = 400
CPU_MAX_CASES = 24
GPU_DEFAULT_BUDGET_S = 120.0  # per backend; the summary line says when it cut a run short
# The fewest cases a GPU backend's run may end with when its budget cuts it short: a budget spent
# before (a slow machine, compiles) fails the test instead of passing on a handful of cases, or none.
GPU_MIN_CASES = 100
MAX_REPORTED = 5  # failing cases described in full in the assertion message

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
# Per-element magnitudes, finite in the dtype (values are clamped to its largest finite too).
MAGNITUDES = {
    torch.float32: [1e-38, 1e-30, 1e-8, 1e-3, 1.0, 1e3, 1e30, 1e37],
    torch.bfloat16: [1e-38, 1e-30, 1e-8, 1e-3, 1.0, 1e3, 1e30, 1e37],
    torch.float16: [1e-7, 1e-4, 1e-2, 1.0, 1e2, 1e4],
}
# Exponent range j of a rounding-ties block (amax 448 * 2**j, so s = 2**j in both scale
# formats): every element stays exact in the dtype and s stays above the 1e-12 floor.
TIE_EXPONENTS = {torch.float32: (-39, 100), torch.bfloat16: (-39, 100), torch.float16: (-14, 7)}


def _e4m3_ties() -> list[float]:
    """Midpoints between neighbouring e4m3fn values, in units of the scale (RNE decides each)."""
    ties = [(m + 0.5) * 2.0**-9 for m in range(8)]  # subnormal grid, step 2**-9
    for e in range(-6, 9):  # normal binades [2**e, 2**(e+1)), step 2**(e-3); 448 is the top
        ties += [2.0**e * (1 + (m + 0.5) / 8) for m in range(8 if e < 8 else 6)]
    return ties


TIES = _e4m3_ties()


@dataclass(frozen=True)
class Profile:
    name: str
    max_dim: int  # rows per source and columns
    max_experts: int


GPU_PROFILE = Profile("gpu", 1100, 5)
CPU_PROFILE = Profile("cpu", 300, 3)


# ------------------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """Storage of one [(E,) R, C] tensor as a strided view into a flat buffer.

    Each expert is a 2-D matrix of storage lines: rows (row-major) or columns (``col_major``,
    i.e. allocated [E, C, R] and viewed through ``.transpose(-1, -2)``). The view takes every
    ``step``-th element of a line starting ``lead`` elements in, lines ``[skip, skip + n)`` of
    ``skip + n + extra``, every ``expert_step``-th expert, from ``offset`` elements into the buffer.
    """

    col_major: bool = False
    step: int = 1  # element stride along a storage line (column stride 2 when row-major)
    pad: int = 0  # extra elements per line: the view is a slice of wider lines
    lead: int = 0  # first element of a line in the view, <= pad
    skip: int = 0  # storage lines before the view in each expert (a row/column slice)
    extra: int = 0  # storage lines after the view in each expert
    expert_step: int = 1  # 2: every other expert of a larger stack
    offset: int = 0  # storage offset (elements; bytes for fp8 outputs)

    def geometry(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, int]:
        """(strides, storage offset, buffer elements) of the view of ``shape``."""
        *e, r, c = shape
        n_lines, n_in = (c, r) if self.col_major else (r, c)
        ld = max(1, n_in * self.step + self.pad)
        slab = (n_lines + self.skip + self.extra) * ld
        s_r, s_c = (self.step, ld) if self.col_major else (ld, self.step)
        start = self.offset + self.skip * ld + self.lead
        if e:
            n_alloc = (e[0] - 1) * self.expert_step + 1 if e[0] else 0
            return (slab * self.expert_step, s_r, s_c), start, self.offset + n_alloc * slab
        return (s_r, s_c), start, self.offset + slab

    @property
    def sliced(self) -> bool:
        return bool(self.pad or self.skip or self.extra)

    def __str__(self) -> str:
        if self == Layout():
            return "contig"
        parts = ["transposed" if self.col_major else "rowmajor"]
        if self.step != 1:
            parts.append(f"step{self.step}")
        if self.sliced:
            parts.append(f"slice(pad={self.pad},lead={self.lead},skip={self.skip},extra={self.extra})")
        if self.expert_step != 1:
            parts.append(f"estep{self.expert_step}")
        if self.offset:
            parts.append(f"off{self.offset}")
        return "+".join(parts)


def _strided(layout: Layout, shape: tuple[int, ...], dtype: torch.dtype, device, fill):
    """A flat buffer filled with ``fill`` and the view of ``shape`` that ``layout`` describes."""
    strides, start, numel = layout.geometry(shape)
    buf = torch.full((max(numel, 1),), fill, dtype=dtype, device=device)
    return buf, buf.as_strided(shape, strides, start)


def _source_layout(rng: random.Random, stacked: bool) -> Layout:
    u = rng.random()
    if u < 0.3:
        return Layout()
    col_major = u < 0.62  # transposed storage: the H200 bug's layout
    while True:
        step = 2 if rng.random() < 0.2 else 1
        sliced = rng.random() < 0.35
        expert_step = 2 if stacked and rng.random() < 0.3 else 1
        offset = rng.random() < 0.35
        if col_major or step > 1 or sliced or expert_step > 1 or offset:
            break
    pad = rng.choice([1, 2, 3, 7, 16, 64, 128]) if sliced else 0
    return Layout(
        col_major=col_major,
        step=step,
        pad=pad,
        lead=rng.randint(0, pad),
        skip=rng.choice([0, 1, 3, 5]) if sliced else 0,
        extra=rng.choice([0, 2, 4]) if sliced else 0,
        expert_step=expert_step,
        offset=(rng.choice([1, 3, 5, 7, 9, 13]) if rng.random() < 0.5 else rng.choice([2, 4, 8, 16]))
        if offset
        else 0,
    )


def _out_layout(rng: random.Random, stacked: bool, cols: int, byte_offsets: bool) -> Layout | None:
    """None: a poisoned buffer of exactly the output's shape; else a view into a larger one."""
    if rng.random() < 0.3:
        return None
    if byte_offsets and cols % 16 == 0 and rng.random() < 0.6:
        # Every fp8 row 16-byte aligned: the vectorized-store kernel, as ExpertsFP8.empty gets.
        pad = rng.choice([0, 16, 48, 128])
        return Layout(
            pad=pad,
            lead=16 * rng.randint(0, pad // 16),
            skip=rng.choice([0, 1, 3]),
            extra=rng.choice([0, 2]),
            expert_step=2 if stacked and rng.random() < 0.2 else 1,
            offset=rng.choice([0, 16, 256]),
        )
    pad = rng.choice([0, 0, 1, 3, 5, 11, 16, 100])
    if byte_offsets:  # fp8 rows 1..15 bytes past 16-byte alignment half of the time
        offset = rng.randint(1, 15) if rng.random() < 0.5 else rng.choice([0, 16, 256])
    else:
        offset = rng.choice([0, 1, 2, 3, 5])
    return Layout(
        col_major=rng.random() < 0.1,
        step=2 if rng.random() < 0.05 else 1,
        pad=pad,
        lead=rng.randint(0, pad),
        skip=rng.choice([0, 0, 1, 3]),
        extra=rng.choice([0, 0, 2]),
        expert_step=2 if stacked and rng.random() < 0.2 else 1,
        offset=offset,
    )


# --------------------------------------------------------------------------------------- cases


@dataclass
class Source:
    name: str
    rows: int
    layout: Layout
    factor: float  # this source's values are multiplied by it


@dataclass
class Job:
    """One concatenation and its outputs: quantize_blockwise's call, or w13 / w2 of experts."""

    name: str
    dtype: torch.dtype
    experts: int | None  # None: 2-D sources
    cols: int
    sources: list[Source]
    magnitude: float
    colscale: tuple[float, float] | None  # columns scaled by 10**linspace(lo, hi)
    specials: list[tuple] = field(default_factory=list)
    out: Layout | None = None  # fp8 output view (None: exact poisoned buffer)
    scale_out: Layout | None = None
    given: bool = True  # outputs passed to the call (False: the call allocates them)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.sources)

    def shape(self, rows: int) -> tuple[int, ...]:
        return (rows, self.cols) if self.experts is None else (self.experts, rows, self.cols)

    def __str__(self) -> str:
        srcs = ", ".join(
            f"{s.name}[{s.rows} rows {s.layout}{'' if s.factor == 1 else f' x{s.factor:g}'}]"
            for s in self.sources
        )
        e = "2-D" if self.experts is None else f"E={self.experts}"
        outs = (
            f"out={self.out or 'exact'} scale_out={self.scale_out or 'exact'}"
            if self.given
            else "out=allocated"
        )
        return (
            f"{self.name}: {DTYPE_NAMES[self.dtype]} {e} rows={self.rows} cols={self.cols} "
            f"mag={self.magnitude:g} colscale={self.colscale} sources=[{srcs}] "
            f"specials={self.specials or '[]'} " + outs
        )


@dataclass
class Case:
    seed: int
    profile: str
    kind: str  # "blockwise" or "experts"
    scale_fmt: str
    check_finite: bool
    alloc: bool  # outputs allocated by the call (no out=)
    bare: bool  # blockwise: the single source passed as a tensor, not in a list
    jobs: list[Job]

    def __str__(self) -> str:
        head = (
            f"seed={self.seed} profile={self.profile} {self.kind} scale_fmt={self.scale_fmt} "
            f"check_finite={self.check_finite} outputs={'allocated' if self.alloc else 'given'}"
            f"{' bare-tensor' if self.bare else ''}"
        )
        return "\n    ".join([head, *map(str, self.jobs)])


def _dim(rng: random.Random, hi: int, zero: float = 0.0) -> int:
    """A size, mostly not a multiple of 128: 1, multiples of 128 or 16, 128k +- 1 or 3, small, any."""
    u = rng.random()
    if u < zero:
        return 0
    if u < zero + 0.08:
        return 1
    if hi >= BLOCK and u < zero + 0.2:
        return BLOCK * rng.randint(1, hi // BLOCK)
    if hi >= 16 and u < zero + 0.34:  # 16-byte rows: the kernel's vectorized paths
        return 16 * rng.randint(1, hi // 16)
    if hi > BLOCK + 3 and u < zero + 0.44:
        return min(hi, BLOCK * rng.randint(1, hi // BLOCK) + rng.choice([-3, -1, 1, 3]))
    if u < zero + 0.52:
        return rng.randint(2, min(40, hi))
    return rng.randint(2, hi)


def _specials(rng: random.Random, rows: int, cols: int, dtype: torch.dtype) -> list[tuple]:
    """Block-level patterns in the concatenation's coordinates."""
    if rows == 0 or cols == 0:
        return []
    nrb, ncb = ceil_blocks(rows), ceil_blocks(cols)
    out: list[tuple] = []
    if rng.random() < 0.15:
        out.append(("zero_block", rng.randrange(nrb), rng.randrange(ncb)))
    if rng.random() < 0.2:
        out.append(("neg_zero_rows", sorted(rng.sample(range(rows), min(rows, rng.randint(1, 3))))))
    if rng.random() < 0.08:
        out.append(("neg_zero_block", rng.randrange(nrb), rng.randrange(ncb)))
    if rng.random() < 0.2:
        out.append(("ties", rng.randrange(nrb), rng.randrange(ncb), rng.randint(*TIE_EXPONENTS[dtype])))
    return out


def _dtype(rng: random.Random) -> torch.dtype:
    return rng.choices([torch.bfloat16, torch.float16, torch.float32], weights=[35, 20, 45])[0]


def _job(rng, name, dtype, experts, cols, sources, stacked) -> Job:
    return Job(
        name=name,
        dtype=dtype,
        experts=experts,
        cols=cols,
        sources=sources,
        magnitude=rng.choice(MAGNITUDES[dtype]),
        colscale=(round(rng.uniform(-4, 0), 2), round(rng.uniform(0, 4), 2)) if rng.random() < 0.2 else None,
        specials=_specials(rng, sum(s.rows for s in sources), cols, dtype),
        out=_out_layout(rng, stacked, cols, byte_offsets=True),
        scale_out=_out_layout(rng, stacked, cols, byte_offsets=False),
    )


def make_case(seed: int, profile: Profile) -> Case:
    """The case of ``seed``: a pure description, no tensors (``_run_case`` builds them)."""
    rng = random.Random(seed)
    hi = profile.max_dim
    kind = "experts" if rng.random() < 0.3 else "blockwise"
    scale_fmt = rng.choice(["fp32", "ue8m0"])
    check_finite = rng.random() < 0.85
    alloc = rng.random() < 0.3

    def factor() -> float:
        return rng.choice([1.0, 1.0, 1.0, 4.0, 0.25, 1e-3])

    if kind == "experts":
        u = rng.random()
        experts = 0 if u < 0.05 else 1 if u < 0.25 else rng.randint(2, profile.max_experts)
        inter, hidden = _dim(rng, hi), _dim(rng, hi)
        d13 = _dtype(rng)
        d2 = _dtype(rng) if rng.random() < 0.15 else d13  # w2 may differ from w1/w3
        w13 = [Source(n, inter, _source_layout(rng, True), factor()) for n in ("w1", "w3")]
        w2 = [Source("w2", hidden, _source_layout(rng, True), factor())]
        jobs = [
            _job(rng, "w13", d13, experts, hidden, w13, True),
            _job(rng, "w2", d2, experts, inter, w2, True),
        ]
        return _case(seed, profile, kind, scale_fmt, check_finite, alloc, False, jobs)

    u = rng.random()
    if u < 0.25:
        experts = None
    elif u < 0.3:
        experts = 0
    elif u < 0.45:
        experts = 1
    else:
        experts = rng.randint(2, profile.max_experts)
    n = rng.choices([1, 2, 3, 4], weights=[35, 30, 15, 20])[0]
    src_hi = max(BLOCK + 2, 2 * hi // (n + 1))
    cols = _dim(rng, hi, zero=0.02)
    stacked = experts is not None
    sources = [
        Source(f"sources[{k}]", _dim(rng, src_hi, zero=0.04), _source_layout(rng, stacked), factor())
        for k in range(n)
    ]
    bare = n == 1 and rng.random() < 0.5
    job = _job(rng, "sources", _dtype(rng), experts, cols, sources, stacked)
    return _case(seed, profile, kind, scale_fmt, check_finite, alloc, bare, [job])


def _case(seed, profile, kind, scale_fmt, check_finite, alloc, bare, jobs) -> Case:
    for job in jobs:
        job.given = not alloc  # the output layouts were drawn anyway: the seed's sequence is fixed
    return Case(seed, profile.name, kind, scale_fmt, check_finite, alloc, bare, jobs)


# ------------------------------------------------------------------------------------- tensors


def _values(job: Job, gen: torch.Generator, device) -> torch.Tensor:
    """The float32 concatenation [E', R, C] (E' = 1 for 2-D), finite in the job's dtype."""
    e = 1 if job.experts is None else job.experts
    rows, cols = job.rows, job.cols
    v = torch.randn((e, rows, cols), generator=gen, device=device) * job.magnitude
    if job.colscale is not None:
        v *= torch.logspace(*job.colscale, cols, device=device)
    r0 = 0
    for s in job.sources:
        v[:, r0 : r0 + s.rows] *= s.factor
        r0 += s.rows
    big = torch.finfo(job.dtype).max
    v.clamp_(-big, big)
    for sp in job.specials:
        kind = sp[0]
        if kind in ("zero_block", "neg_zero_block"):
            _, rb, cb = sp
            v[:, rb * BLOCK : (rb + 1) * BLOCK, cb * BLOCK : (cb + 1) * BLOCK] = (
                0.0 if kind == "zero_block" else -0.0
            )
        elif kind == "neg_zero_rows":
            v[:, sp[1], :] = -0.0
        elif kind == "ties":
            _, rb, cb, j = sp
            ties = torch.tensor(TIES, device=device)
            idx = torch.randint(len(TIES), (BLOCK, BLOCK), generator=gen, device=device)
            sign = torch.randint(2, (BLOCK, BLOCK), generator=gen, device=device) * 2.0 - 1.0
            tile = ties[idx] * sign
            tile[0, 0] = 448.0  # the block's amax: s = fl32(448 * 2**j * fl32(1/448)) = 2**j
            tile *= 2.0**j
            blk = v[:, rb * BLOCK : (rb + 1) * BLOCK, cb * BLOCK : (cb + 1) * BLOCK]
            blk.copy_(tile[: blk.shape[1], : blk.shape[2]].expand_as(blk))
    return v


@dataclass
class Built:
    """One job's tensors: source views (with their buffers) and given outputs (or None)."""

    views: list[torch.Tensor]
    src_bufs: list[torch.Tensor]
    q: torch.Tensor | None
    s: torch.Tensor | None
    out_bufs: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]  # name, buffer, copy, view


def _build(job: Job, case: Case, gen: torch.Generator, device) -> Built:
    v = _values(job, gen, device)
    views, bufs = [], []
    r0 = 0
    for s in job.sources:
        part = v[:, r0 : r0 + s.rows]
        part = part if job.experts is not None else part[0]
        # Storage outside the view is NaN: a read past the view trips the finite check or the bits.
        buf, view = _strided(s.layout, job.shape(s.rows), job.dtype, device, float("nan"))
        view.copy_(part)
        views.append(view)
        bufs.append(buf)
        r0 += s.rows
    if case.alloc:
        return Built(views, bufs, None, None, [])
    q_shape = job.shape(job.rows)
    s_shape = q_shape[:-2] + (ceil_blocks(job.rows), ceil_blocks(job.cols))
    out_bufs = []
    if job.out is None:
        q = poisoned_fp8(q_shape, device)
    else:
        buf, view = _strided(job.out, q_shape, torch.uint8, device, 0xFF)
        q = view.view(torch.float8_e4m3fn)
        out_bufs.append((f"{job.name} out", buf, buf.clone(), q))
    if job.scale_out is None:
        s = poisoned_f32(s_shape, device)
    else:
        buf, s = _strided(job.scale_out, s_shape, torch.float32, device, float("nan"))
        out_bufs.append((f"{job.name} scale_out", buf, buf.clone(), s))
    return Built(views, bufs, q, s, out_bufs)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _fmt(t: torch.Tensor, bits: int) -> str:
    if t.dtype == torch.float8_e4m3fn:
        return f"0x{bits & 0xFF:02x}"
    value = torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()
    return f"0x{bits & 0xFFFFFFFF:08x}({value:.6g})"


def _diff(name: str, got: torch.Tensor, ref: torch.Tensor) -> str | None:
    """None when ``got`` holds ``ref``'s exact bits; else how many differ and where first."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return f"{name}: got {got.dtype} {tuple(got.shape)}, want {ref.dtype} {tuple(ref.shape)}"
    a, b = _bits(got), _bits(ref)
    bad = a != b
    n = int(bad.sum())
    if n == 0:
        return None
    first = []
    for idx in bad.nonzero()[:3].tolist():
        i = tuple(idx)
        first.append(f"{list(i)} got {_fmt(got, int(a[i]))} want {_fmt(ref, int(b[i]))}")
    return f"{name}: {n} of {bad.numel()} differ; first " + "; ".join(first)


def _outside_changed(name: str, buf: torch.Tensor, before: torch.Tensor, view: torch.Tensor) -> str | None:
    """Elements of ``buf`` outside ``view`` whose bits changed."""
    inside = torch.zeros(buf.numel(), dtype=torch.bool, device=buf.device)
    inside.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(True)
    changed = (_bits(buf) != _bits(before)) & ~inside
    n = int(changed.sum())
    if n == 0:
        return None
    return f"{name}: {n} elements outside the view were written, first at flat {changed.nonzero()[0].item()}"


def _vector_storable(q: torch.Tensor) -> bool:
    """Whether every fp8 output row starts 16-byte aligned with unit column stride."""
    q3 = q if q.dim() == 3 else q.unsqueeze(0)
    return q3.stride(2) == 1 and q3.data_ptr() % 16 == 0 and q3.stride(1) % 16 == 0 and q3.stride(0) % 16 == 0


def _categories(case: Case, results: list[tuple[torch.Tensor, torch.Tensor]] | None) -> set[str]:
    """The case's tags for the summary counts; output alignment only when the call returned."""
    tags = {case.kind, f"fmt_{case.scale_fmt}", "outputs_allocated" if case.alloc else "outputs_given"}
    if not case.check_finite:
        tags.add("unchecked")
    for job, (q, _) in zip(case.jobs, results or [(None, None)] * len(case.jobs)):
        tags.add(DTYPE_NAMES[job.dtype])
        e = job.experts
        tags.add("2d" if e is None else "e0" if e == 0 else "e1" if e == 1 else "e2+")
        layouts = [s.layout for s in job.sources]
        if any(lay.col_major for lay in layouts):
            tags.add("transposed")
            if job.dtype == torch.float32:
                tags.add("f32_transposed")
        if any(lay.offset for lay in layouts):
            tags.add("src_offset")
        if any(lay.offset % 2 for lay in layouts):
            tags.add("src_offset_odd")
        if any(lay.sliced for lay in layouts):
            tags.add("src_slice")
        if any(lay.expert_step > 1 for lay in layouts):
            tags.add("expert_step2")
        if any(lay.step > 1 for lay in layouts):
            tags.add("step2")
        if len(job.sources) > 1:
            tags.add("multi_source")
            r = 0
            for s in job.sources[:-1]:
                r += s.rows
                if r % BLOCK and 0 < r < job.rows:
                    tags.add("straddle")
        if job.rows % BLOCK or job.cols % BLOCK:
            tags.add("partial_block")
        if job.given and job.out is not None:
            tags.add("out_view")
        if q is not None and q.numel():
            tags.add("out_aligned" if _vector_storable(q) else "out_unaligned")
        tags.update(sp[0] for sp in job.specials)
    return tags


def _run_case(case: Case, backend: str, device: torch.device) -> tuple[list[str], set[str]]:
    """Build, run and check one case: (failure lines, categories). Harness errors fail too."""
    phase = "build"
    try:
        gen = torch.Generator(device=device).manual_seed(case.seed)
        built = [_build(job, case, gen, device) for job in case.jobs]
        src_before = [buf.clone() for b in built for buf in b.src_bufs]
        phase = "reference"
        if case.kind == "experts":
            (b13, b2), scale_fmt = built, case.scale_fmt
            w1, w3, w2 = *b13.views, b2.views[0]
            r = quantize_experts_ref(w1, w3, w2, scale_fmt)
            refs = [(r[0], r[1]), (r[2], r[3])]
            phase = "call"
            out = None if case.alloc else ExpertsFP8(b13.q, b13.s, b2.q, b2.s)
            got = quantize_experts(
                w1, w3, w2, out=out, scale_fmt=scale_fmt, check_finite=case.check_finite, backend=backend
            )
            results = [(got.w13, got.w13_scale_inv), (got.w2, got.w2_scale_inv)]
        else:
            (b,) = built
            refs = [quantize_concat_ref(b.views, case.scale_fmt)]
            phase = "call"
            results = [
                quantize_blockwise(
                    b.views[0] if case.bare else b.views,
                    out=b.q,
                    scale_out=b.s,
                    scale_fmt=case.scale_fmt,
                    check_finite=case.check_finite,
                    backend=backend,
                )
            ]
        phase = "check"
        errors = []
        for job, b, (q, s), (q_ref, s_ref) in zip(case.jobs, built, results, refs):
            if b.q is not None and (q is not b.q or s is not b.s):
                errors.append(f"{job.name}: the call did not return the given out/scale_out tensors")
            errors.append(_diff(f"{job.name} fp8", q, q_ref))
            errors.append(_diff(f"{job.name} scales", s, s_ref))
            errors += [_outside_changed(n, buf, before, view) for n, buf, before, view in b.out_bufs]
        bufs_after = [buf for b in built for buf in b.src_bufs]
        errors += [
            f"source buffer {k} changed"
            for k, (a, c) in enumerate(zip(bufs_after, src_before))
            if not torch.equal(_bits_raw(a), _bits_raw(c))
        ]
        return [e for e in errors if e], _categories(case, results)
    except Exception as exc:  # noqa: BLE001 - every exception is a failing case, reported with it
        where = "harness error (fix the test) " if phase in ("build", "reference") else ""
        return [f"{where}{phase}: {type(exc).__name__}: {exc}"], _categories(case, None)


def _bits_raw(t: torch.Tensor) -> torch.Tensor:
    """A flat buffer's bytes (NaN-safe comparison)."""
    return t.view(torch.uint8)


# -------------------------------------------------------------------------------------- driver


CATEGORY_ORDER = [
    "blockwise",
    "experts",
    "2d",
    "e0",
    "e1",
    "e2+",
    "bf16",
    "f16",
    "f32",
    "fmt_ue8m0",
    "unchecked",
    "multi_source",
    "straddle",
    "partial_block",
    "transposed",
    "f32_transposed",
    "src_slice",
    "src_offset",
    "src_offset_odd",
    "expert_step2",
    "step2",
    "outputs_allocated",
    "outputs_given",
    "out_view",
    "out_aligned",
    "out_unaligned",
    "zero_block",
    "neg_zero_rows",
    "neg_zero_block",
    "ties",
]
PROFILES = {p.name: p for p in (GPU_PROFILE, CPU_PROFILE)}
CHUNK = 4  # seeds per task handed to a worker process


def _triton_kernels() -> int | None:
    """Triton kernels compiled so far in this process (None under the interpreter / unknown)."""
    try:
        import importlib

        mod = importlib.import_module("glm_fp8.kernels.triton_quantize")
        kernels = (mod.quantize_blockwise_kernel, mod.quantize_blockwise_kernel_unaligned_out)
        return sum(len(c[0]) for k in kernels for c in k.device_caches.values())
    except Exception:  # noqa: BLE001 - only a statistic for the summary line
        return None


def _run_seeds(
    seeds: list[int], profile: str, backend: str, device: str, deadline: float
) -> tuple[list, int]:
    """Run cases (in this process or a worker): [(seed, failure lines, categories)] for the
    seeds started before ``deadline`` (time.time(), 0: none), and the Triton kernels compiled."""
    k0 = _triton_kernels()
    done = []
    for seed in seeds:
        if deadline and time.time() > deadline:
            break
        errors, tags = _run_case(make_case(seed, PROFILES[profile]), backend, torch.device(device))
        done.append((seed, errors, sorted(tags)))
    k1 = _triton_kernels()
    return done, 0 if k0 is None or k1 is None else k1 - k0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def _fuzz(
    backend: str,
    device: str,
    profile: Profile,
    cases: int,
    budget_s: float,
    workers: int,
    capsys,
    record_property,
    test_id: str,
    min_cases: int = 0,
) -> None:
    """Run ``cases`` seeds, print the summary line, fail with the first failing cases described.

    With ``workers`` > 1 the seeds go to that many spawned processes, in chunks: a cold Triton
    compiles a kernel per distinct specialization (about one per case, ~1 s each), and the
    processes compile in parallel."""
    base = _env_int("GLM_FP8_FUZZ_SEED", DEFAULT_SEED)
    seeds = list(range(base, base + cases))
    chunks = [seeds[i : i + CHUNK] for i in range(0, len(seeds), CHUNK)]
    deadline = time.time() + budget_s if budget_s else 0.0
    results: list[tuple[int, list[str], list[str]]] = []
    compiled = 0
    t0 = time.perf_counter()
    stop = ""
    try:
        if workers <= 1:
            for chunk in chunks:
                done, k = _run_seeds(chunk, profile.name, backend, device, deadline)
                results += done
                compiled += k
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
            with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
                futures = [
                    pool.submit(_run_seeds, c, profile.name, backend, device, deadline) for c in chunks
                ]
                for chunk, fut in zip(chunks, futures):
                    try:
                        done, k = fut.result()
                    except Exception as exc:  # noqa: BLE001 - a crashed worker fails its seeds
                        done = [(seed, [f"worker died: {type(exc).__name__}: {exc}"], []) for seed in chunk]
                        k = 0
                    results += done
                    compiled += k
        if len(results) < cases:
            stop = f" stopped=time_budget_{budget_s:g}s"
    except BaseException:
        stop = " stopped=interrupted"
        raise
    finally:
        counts: Counter[str] = Counter(tag for _, _, tags in results for tag in tags)
        failures = [(seed, errors) for seed, errors, _ in results if errors]
        kernels = f" triton_kernels_compiled={compiled}" if backend == "triton" and device == "cuda" else ""
        line = (
            f"fuzz: backend={backend} device={device} profile={profile.name} cases={len(results)}/{cases} "
            f"failures={len(failures)} seconds={time.perf_counter() - t0:.1f} workers={workers} "
            f"seeds={base}..{base + cases - 1}{kernels}{stop} | "
            + " ".join(f"{k}={counts[k]}" for k in CATEGORY_ORDER)
        )
        record_property("fuzz_summary", line)
        with capsys.disabled():
            print("\n" + line, flush=True)
    floor = min(cases, min_cases)
    if not failures and len(results) < floor:
        pytest.fail(
            f"fuzz: backend={backend} ran {len(results)} cases before its time budget ({budget_s:g} s) "
            "ended it; "
            f"at least {floor} must run (GLM_FP8_FUZZ_BUDGET_S raises the budget, GLM_FP8_FUZZ_MIN_CASES "
            "lowers the floor)",
            pytrace=False,
        )
    if failures:
        lines = [
            f"{len(failures)} of {len(results)} fuzz cases failed on backend={backend}; seeds: "
            + " ".join(str(seed) for seed, _ in failures[:20])
        ]
        for seed, errors in failures[:MAX_REPORTED]:
            lines.append(f"- {make_case(seed, profile)}\n    => " + "\n    => ".join(errors))
            lines.append(
                f"    replay: GLM_FP8_FUZZ_SEED={seed} GLM_FP8_FUZZ_CASES=1 "
                f"python3 -m pytest -q -rA tests/kernels/test_fuzz.py -k '{test_id}'"
            )
        pytest.fail("\n".join(lines), pytrace=False)


# --------------------------------------------------------------------------------------- tests


@pytest.mark.skipif(not ON_GPU, reason="GPU fuzz needs CUDA; on the CPU test_fuzz_cpu runs the generator")
@pytest.mark.parametrize("gpu_backend", ["triton", "cuda"])
def test_fuzz_gpu(gpu_backend, capsys, record_property):
    """Several hundred random cases per GPU backend, bit for bit against the reference (on CUDA)."""
    if gpu_backend not in GPU_BACKENDS:
        pytest.skip(f"backend {gpu_backend!r} is not available here (available: {GPU_BACKENDS})")
    cases = _env_int("GLM_FP8_FUZZ_CASES", GPU_DEFAULT_CASES)
    budget = float(os.environ.get("GLM_FP8_FUZZ_BUDGET_S", "") or GPU_DEFAULT_BUDGET_S)
    # Triton compiles about one kernel per case: spread them over processes. CUDA compiles nothing.
    default_workers = min(8, max(1, (os.cpu_count() or 2) // 2)) if gpu_backend == "triton" else 1
    workers = min(_env_int("GLM_FP8_FUZZ_WORKERS", default_workers), -(-cases // CHUNK))
    floor = _env_int("GLM_FP8_FUZZ_MIN_CASES", GPU_MIN_CASES)
    test_id = f"test_fuzz_gpu and {gpu_backend}"
    _fuzz(gpu_backend, "cuda", GPU_PROFILE, cases, budget, workers, capsys, record_property, test_id, floor)


@pytest.mark.skipif(ON_GPU, reason="on a GPU, test_fuzz_gpu runs the full-size generator")
@pytest.mark.parametrize("cpu_backend", ["triton", "torch"])
def test_fuzz_cpu(cpu_backend, capsys, record_property):
    """A few small cases through the same generator and harness: Triton's interpreter and torch."""
    if cpu_backend not in BACKENDS:
        pytest.skip(f"backend {cpu_backend!r} does not run on this CPU (TRITON_INTERPRET=1 enables triton)")
    cases = min(_env_int("GLM_FP8_FUZZ_CASES", CPU_MAX_CASES), CPU_MAX_CASES)
    workers = min(_env_int("GLM_FP8_FUZZ_WORKERS", 1), -(-cases // CHUNK))
    test_id = f"test_fuzz_cpu and {cpu_backend}"
    _fuzz(cpu_backend, "cpu", CPU_PROFILE, cases, 0.0, workers, capsys, record_property, test_id, cases)


def test_case_generator_is_reproducible_and_covers_the_categories():
    """Same seed, same case; over the GPU default run every category the fuzz counts occurs."""
    assert str(make_case(DEFAULT_SEED + 7, GPU_PROFILE)) == str(make_case(DEFAULT_SEED + 7, GPU_PROFILE))
    seen: Counter[str] = Counter()
    for i in range(GPU_DEFAULT_CASES):
        case = make_case(DEFAULT_SEED + i, GPU_PROFILE)
        seen[case.kind] += 1
        for job in case.jobs:
            seen.update(sp[0] for sp in job.specials)
            if job.experts is None or job.experts == 0:
                seen["2d" if job.experts is None else "e0"] += 1
            if job.given and job.out is not None and job.out.offset % 16:
                seen["out_byte_offset"] += 1
            for s in job.sources:
                if s.layout.col_major:
                    seen["transposed"] += 1
                    seen["f32_transposed"] += job.dtype == torch.float32
                if s.layout.offset % 2:
                    seen["src_offset_odd"] += 1
    for tag in [
        "blockwise",
        "experts",
        "transposed",
        "f32_transposed",
        "src_offset_odd",
        "e0",
        "2d",
        "out_byte_offset",
        "zero_block",
        "neg_zero_rows",
        "neg_zero_block",
        "ties",
    ]:
        assert seen[tag] > 0, (tag, seen)


@pytest.mark.parametrize("seed", [DEFAULT_SEED, DEFAULT_SEED + 1, DEFAULT_SEED + 8])
def test_harness_reports_a_wrong_byte(monkeypatch, seed):
    """A backend that gets one fp8 byte wrong fails its case, with the byte's position."""
    from glm_fp8.kernels import backends

    right = backends.LAUNCHERS["torch"]

    def one_byte_off(work, *args):
        right(work, *args)
        for _, q, _ in work:
            if q is not None and q.numel():
                last = q.view(torch.uint8)[-1, -1, -1:]
                last.bitwise_xor_(1)

    monkeypatch.setitem(backends.LAUNCHERS, "torch", one_byte_off)
    case = make_case(seed, CPU_PROFILE)
    errors, _ = _run_case(case, "torch", torch.device("cpu"))
    assert any("fp8: 1 of" in e for e in errors), (str(case), errors)


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_float32_w2_stored_transposed(device, backend, scale_fmt):
    """The H200 failure (Triton 3.6) that motivated this file: float32 w2 [2, 256, 128] stored
    column-major within each expert (stride (32768, 1, 256)), contiguous w1/w3 [2, 128, 256];
    16359 of 65536 w2 bytes differed, the scales were right."""
    gen = torch.Generator(device=device).manual_seed(0)
    w1 = torch.randn(2, 128, 256, generator=gen, device=device)
    w3 = torch.randn(2, 128, 256, generator=gen, device=device)
    w2 = torch.randn(2, 128, 256, generator=gen, device=device).transpose(1, 2)
    assert w2.shape == (2, 256, 128) and w2.stride() == (32768, 1, 256)
    ref = quantize_experts_ref(w1, w3, w2, scale_fmt)
    got = quantize_experts(w1, w3, w2, scale_fmt=scale_fmt, backend=backend)
    assert_same_bits(got.w13, got.w13_scale_inv, ref[0], ref[1])
    assert_same_bits(got.w2, got.w2_scale_inv, ref[2], ref[3])


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_one_column_w2_from_row_major_rows(device, backend, scale_fmt):
    """H200 fuzz seed 20261558 (Triton 3.6): w2 of one column, 255 rows, each a slice of a row
    of 6 (row stride 6, column stride 1) into an exact [1, 255, 1] output, whose row stride is
    then 1 as well; bytes from row 66 on came back wrong."""
    gen = torch.Generator(device=device).manual_seed(1)
    w1 = torch.randn(1, 1, 255, generator=gen, device=device, dtype=torch.float16)
    w3 = torch.randn(1, 1, 255, generator=gen, device=device, dtype=torch.float16)
    w2 = (torch.randn(1, 255, 6, generator=gen, device=device, dtype=torch.float16) * 0.01)[:, :, 1:2]
    assert w2.stride() == (1530, 6, 1)
    ref = quantize_experts_ref(w1, w3, w2, scale_fmt)
    got = quantize_experts(w1, w3, w2, scale_fmt=scale_fmt, backend=backend)
    assert got.w2.stride(1) == 1
    assert_same_bits(got.w13, got.w13_scale_inv, ref[0], ref[1])
    assert_same_bits(got.w2, got.w2_scale_inv, ref[2], ref[3])
