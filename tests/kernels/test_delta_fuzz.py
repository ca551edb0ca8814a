"""Seeded differential fuzz of the delta kernels (glm_fp8.kernels.delta), on test_fuzz.py's case generator:
random shapes (E = 0 and 1 included, partial 128-blocks), dtypes, magnitudes, rounding ties,
zero blocks, strided sources and strided kept copies (the generator's output layouts, poisoned
around the view).

Invariant, per job of a case: with the kept copy holding the quantization of the previous weights
(a random fraction of the elements moved, from none to all), ``quantize_compare`` leaves the
kept copy bit-equal to ``quantize_concat_ref`` of the new weights, returns exactly
``delta_encode_ref`` of the two quantizations (every tensor, bit for bit: the encoding is
unique), writes nothing outside the kept views and reads the sources only; ``apply_delta`` of
it on an engine copy of the previous bytes gives the new quantization; ``cut_delta`` of a random
block-aligned cut equals the reference delta of the cut. Expected bytes come from the reference on
the weights themselves, never from the kernels.

``compare_bytes`` (the Triton ``delta_bytes_kernel`` and the torch path), per seed's bytes case
(``make_bytes_case``): random uint8 bytes ``old`` and ``new`` (a random fraction of the bytes
changed: 0, 1e-4, 1e-3, 1e-2, 0.3 or 1.0, and in half the cases one block with exactly v // 3 or
v // 3 + 1 changes, either side of the dense threshold 3 n > v) of a transfer segment's pieces
(``segment_rows``: [n // 128, 128] and the tail [1, n % 128], contiguous views of one buffer at
any offset), an entry's rows [R, C] of any dtype (R = 0, 1, whole and partial 128-row blocks; row
bytes not a multiple of 128), a flat tensor (one row) or an experts tensor (rows = experts), with
``new`` and ``kept`` contiguous or strided views (rows padded, transposed, every other element)
in buffers poisoned around them: per piece ``compare_bytes(new, kept)`` returns exactly
``delta_encode_ref`` of the old and new bytes seen as fp8 [rows, row bytes] with zero scales
(computed from the generator's bytes, never from the kernel's), every field bit-equal, and
``apply_delta(delta, old_copy.view(torch.float8_e4m3fn), None)`` on a copy of the old bytes gives
the new ones; afterwards the kept view holds the new bytes, nothing outside it was written and
``new``'s buffer is unchanged. A segment case is also packed as the sender packs it
(``pack_bytes_delta``, offsets and length on the device) into poisoned outputs: its counts and
payload unpack to exactly the reference deltas, its length is what the counts call for, and its
checksum (of whole words) is the torch checksum's of the new bytes.

``test_delta_fuzz_gpu`` runs ``GLM_FP8_FUZZ_CASES`` (default 200) seeds on CUDA within
``GLM_FP8_FUZZ_BUDGET_S`` seconds (default 120), each seed's quantize case with the triton backend
and its bytes case with both; ``test_delta_fuzz_cpu`` and ``test_compare_bytes_fuzz_cpu`` a few
small ones in CI. A failure's message starts with its replay line; by hand:
``GLM_FP8_FUZZ_SEED=<seed> GLM_FP8_FUZZ_CASES=1 pytest tests/kernels/test_delta_fuzz.py -k <test>``.
"""

from __future__ import annotations

import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass

import pytest
import torch
from conftest import ON_GPU, backend_id
from test_fuzz import (
    CHUNK,
    CPU_PROFILE,
    DEFAULT_SEED,
    GPU_PROFILE,
    PROFILES,
    _build,
    _diff,
    _env_int,
    _outside_changed,
    make_case,
)

from glm_fp8.core.numerics import BLOCK, blocks_shape
from glm_fp8.kernels.checksum import checksum_torch
from glm_fp8.kernels.delta import apply_delta, compare_bytes, quantize_compare
from glm_fp8.kernels.delta_cut import cut_delta
from glm_fp8.kernels.reference import delta_encode_ref, quantize_concat_ref
from glm_fp8.transfer.delta.segments import SegmentDelta, segment_rows
from glm_fp8.transfer.delta.wire import (
    counts_numel,
    pack_bytes_delta,
    payload_layout,
    unpack_delta,
)

FIELDS = ("counts", "positions", "values", "scale_index", "scale_values")
MOVED = [0.0, 1e-4, 1e-3, 1e-2, 0.3, 1.0]  # fraction of the elements that moved since the last step
CPU_CASES = 6
GPU_CASES = 200
# Every GPU seed also runs its compare_bytes case with both backends (milliseconds on a GPU).
GPU_JOBS = ("quantize", "bytes:triton", "bytes:torch")


def _previous(views: list[torch.Tensor], rng: random.Random, gen: torch.Generator) -> list[torch.Tensor]:
    """The previous step's weights: a random fraction of the new ones moved by a relative step
    (so the new ones differ from them there), in the sources' dtype."""
    frac, rel = rng.choice(MOVED), rng.choice([1e-3, 3e-2, 0.5])
    out = []
    for v in views:
        x = v.float()
        moved = torch.rand(x.shape, generator=gen, device=x.device) < frac
        step = 1 + rel * torch.randn(x.shape, generator=gen, device=x.device)
        big = torch.finfo(v.dtype).max
        out.append(torch.where(moved, x * step, x).clamp(-big, big).to(v.dtype))
    return out


def _block_cut(shape: tuple[int, ...], rng: random.Random) -> dict:
    """A random block-aligned cut of a [(E,) R, C] entry: element ranges, stops at a block edge or
    the entry's end."""

    def span(n: int) -> tuple[int, int]:
        nb = -(-n // BLOCK)
        if nb == 0:
            return 0, 0
        a = rng.randrange(nb)
        b = rng.randint(a + 1, nb)
        return a * BLOCK, min(b * BLOCK, n)

    *e, r, c = shape
    cut = {"rows": span(r), "cols": span(c)}
    if e:
        a = rng.randrange(e[0] + 1)
        cut["experts"] = (a, rng.randint(a, e[0]))
    return cut


def _view(t: torch.Tensor, cut: dict, blocks: bool) -> torch.Tensor:
    (r0, r1), (c0, c1) = cut["rows"], cut["cols"]
    if blocks:
        r0, r1, c0, c1 = r0 // BLOCK, -(-r1 // BLOCK), c0 // BLOCK, -(-c1 // BLOCK)
    out = t[..., r0:r1, c0:c1]
    return out[cut["experts"][0] : cut["experts"][1]] if "experts" in cut else out


def run_case(seed: int, profile, backend: str, device: torch.device) -> list[str]:
    case = make_case(seed, profile)
    case.alloc = False  # the kept copy is always given: the generator's output views are its layouts
    rng, gen = random.Random(seed ^ 0x5EED), torch.Generator(device=device).manual_seed(seed)
    errors: list[str] = []
    for job in case.jobs:
        job.given = True
        b = _build(job, case, gen, device)
        old = _previous(b.views, rng, gen)
        old_q, old_s = quantize_concat_ref(old, case.scale_fmt)
        new_q, new_s = quantize_concat_ref(b.views, case.scale_fmt)
        b.q.copy_(old_q)
        b.s.copy_(old_s)
        src_before = [buf.clone() for buf in b.src_bufs]
        engine_q, engine_s = old_q.clone(), old_s.clone()
        sources = b.views[0] if case.bare else b.views
        d = quantize_compare(sources, b.q, b.s, scale_fmt=case.scale_fmt, backend=backend)
        want = delta_encode_ref(old_q, old_s, new_q, new_s)
        errors += [_diff(f"{job.name} kept fp8", b.q, new_q), _diff(f"{job.name} kept scales", b.s, new_s)]
        errors += [_diff(f"{job.name} delta.{f}", getattr(d, f), w) for f, w in zip(FIELDS, want)]
        errors += [_outside_changed(n, buf, before, view) for n, buf, before, view in b.out_bufs]
        errors += [
            f"{job.name} source {k} changed"
            for k, (a, c) in enumerate(zip(b.src_bufs, src_before))
            if not torch.equal(a.view(torch.uint8), c.view(torch.uint8))
        ]
        apply_delta(d, engine_q, engine_s, backend=backend)
        errors += [
            _diff(f"{job.name} applied fp8", engine_q, new_q),
            _diff(f"{job.name} applied scales", engine_s, new_s),
        ]
        cut = _block_cut(tuple(new_q.shape), rng)
        got = cut_delta(d, **cut)
        part = delta_encode_ref(
            _view(old_q, cut, False),
            _view(old_s, cut, True),
            _view(new_q, cut, False),
            _view(new_s, cut, True),
        )
        errors += [_diff(f"{job.name} cut {cut} .{f}", getattr(got, f), w) for f, w in zip(FIELDS, part)]
    return [f"seed={seed}: {e}" for e in errors if e]


# ------------------------------------------------------------------------------ compare_bytes


BYTE_DTYPES = (torch.uint8, torch.bfloat16, torch.float32, torch.float8_e4m3fn)  # it takes any dtype
BYTES_CPU_CASES = 8
BYTES_TOP = {"cpu": 300, "gpu": 1500}  # the largest rows / row bytes a case draws, per profile
NEW_POISON, KEPT_POISON = 0x5A, 0xA5


@dataclass
class BytesCase:
    """Two states of one buffer of bytes: ``new`` and ``kept`` (holding the old bytes) placed in
    poisoned buffers, and the pieces compare_bytes is called on, each ``(new view, kept view, old
    bytes, new bytes)`` with the bytes as contiguous uint8 [rows, row bytes] made by the generator."""

    desc: str
    tags: set[str]
    new_buf: torch.Tensor  # flat, the view's dtype
    kept_buf: torch.Tensor
    kept_at: torch.Tensor  # the kept view's element indices into its buffer, row-major
    old_bytes: torch.Tensor  # uint8 [all bytes], row-major
    new_bytes: torch.Tensor
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def _extent(rng: random.Random, top: int) -> int:
    """A row or byte count: 0, 1, inside one block, whole blocks, a partial last block, any."""
    k = rng.randint(1, max(1, top // BLOCK))
    part = BLOCK * k + rng.randint(1, BLOCK - 1)
    picks = [0, 1, rng.randint(2, BLOCK - 1), BLOCK * k, part, rng.randint(1, top)]
    return rng.choices(picks, weights=[1, 2, 2, 2, 4, 3])[0]


def _place(t: torch.Tensor, how: str, poison: int, rng: random.Random) -> tuple[torch.Tensor, ...]:
    """``t``'s bytes written (as bytes, never as values: random bytes hold NaNs) into a view of
    layout ``how`` in a flat buffer of ``poison`` bytes: (the buffer, the view, the view's element
    indices into the buffer, row-major)."""
    shape, es = tuple(t.shape), t.element_size()
    order = list(range(t.dim()))[::-1]  # innermost first
    if how == "transposed" and t.dim() >= 2:
        order[0], order[1] = order[1], order[0]
    strides, acc = [0] * t.dim(), 2 if how == "step2" else 1
    for d in order:
        strides[d] = acc
        acc = acc * max(shape[d], 1) + (rng.randint(1, 5) if how == "padded" else 0)
    size = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if t.numel() else 0
    offset = rng.randint(0, 19)  # unaligned starts too (the transfer's views sit at any byte)
    total = offset + size + rng.randint(0, 9)
    buf = torch.full((total * es,), poison, dtype=torch.uint8, device=t.device)
    at = torch.arange(total, device=t.device).as_strided(shape, strides, offset).reshape(-1)
    buf.view(-1, es)[at] = t.contiguous().view(torch.uint8).reshape(-1, es)
    typed = buf.view(t.dtype)
    return typed, typed.as_strided(shape, strides, offset), at


def make_bytes_case(seed: int, profile, device: torch.device) -> BytesCase:
    """The case of ``seed``: a transfer segment's pieces (segment_rows: [n // 128, 128] and a tail
    [1, n % 128], contiguous at any offset), rows of an entry of any dtype ([R, C]), a flat tensor
    (one row) or an experts tensor (rows = experts); the views contiguous, row-padded, transposed or
    every other element; a random fraction of the bytes changed, and in half the cases one block
    changed at exactly the dense threshold's edge (3 n > v: n = v // 3 stays sparse, one more is
    dense)."""
    rng = random.Random(seed ^ 0xB17E5)
    gen = torch.Generator(device=device).manual_seed(seed ^ 0xB17E5)
    top = BYTES_TOP[profile.name]
    mode = rng.choice(["segment", "segment", "rows", "rows", "rows", "flat", "experts"])
    dtype = torch.uint8 if mode == "segment" else rng.choice(BYTE_DTYPES)
    es = dtype.itemsize
    if mode == "segment":
        nbytes = BLOCK * _extent(rng, 4 * top) + rng.choice([0, rng.randint(1, BLOCK - 1)])
        shape: tuple[int, ...] = (nbytes,)
        rows_cols = [(rows, o) for o, rows in segment_rows(nbytes)]
    else:
        if mode == "rows":
            shape = (_extent(rng, top), -(-_extent(rng, top) // es))
        elif mode == "flat":
            shape = (-(-_extent(rng, 16 * top) // es),)
        else:
            shape = (rng.randint(0, 4), rng.randint(1, 40), -(-rng.randint(1, 200) // es))
        rows = (shape[0], math.prod(shape[1:]) * es) if len(shape) > 1 else (1, shape[0] * es)
        rows_cols = [(rows, 0)]
    nbytes = math.prod(shape) * es
    frac = rng.choice(MOVED)
    old = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
    moved = torch.rand(nbytes, device=device, generator=gen) < frac
    tags = {mode, str(dtype).removeprefix("torch."), f"moved={frac}"}
    if rows_cols and rng.random() < 0.5:
        (r, c), o = rng.choice(rows_cols)
        if r * c:
            rb, cb = rng.randrange(-(-r // BLOCK)), rng.randrange(-(-c // BLOCK))
            rows_of = moved[o : o + r * c].view(r, c)[rb * BLOCK : (rb + 1) * BLOCK]
            block = rows_of[:, cb * BLOCK : (cb + 1) * BLOCK]
            v = block.numel()
            edge = rng.choice(["sparse_edge", "dense_edge"])
            pick = torch.zeros(v, dtype=torch.bool, device=device)
            pick[torch.randperm(v, generator=gen, device=device)[: v // 3 + (edge == "dense_edge")]] = True
            block.copy_(pick.view(block.shape))
            tags.add(edge)
    xor = torch.randint(1, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
    new = torch.where(moved, old ^ xor, old)
    typed = lambda b: b.view(dtype).view(shape)  # noqa: E731 - row-major bytes as the entry
    layouts = ["contiguous"] * 4 + ([] if mode == "segment" else ["padded", "transposed", "step2"])
    how_new, how_kept = rng.choice(layouts), rng.choice(layouts)
    new_buf, new_v, _ = _place(typed(new), how_new, NEW_POISON, rng)
    kept_buf, kept_v, kept_at = _place(typed(old), how_kept, KEPT_POISON, rng)
    tags |= {f"new_{how_new}", f"kept_{how_kept}"}
    pieces = []
    for (r, c), o in rows_cols:
        tags |= {"rows=0"} if r == 0 else {"one_row"} if r == 1 else set()
        tags |= {"partial_row_block"} if r % BLOCK else set()
        tags |= {"partial_col_block"} if c % BLOCK else set()
        if mode == "segment":
            pn, pk = new_v[o : o + r * c].view(r, c), kept_v[o : o + r * c].view(r, c)
        else:
            pn, pk = new_v, kept_v
        pieces.append((pn, pk, old[o : o + r * c].view(r, c), new[o : o + r * c].view(r, c)))
    desc = f"{mode} {dtype} shape={list(shape)} new={how_new} kept={how_kept} moved={frac} {sorted(tags)}"
    return BytesCase(desc, tags, new_buf, kept_buf, kept_at, old, new, pieces)


def _bytes_at(buf: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The bytes of ``buf``'s elements ``at``, flat uint8 in that order."""
    return buf.view(torch.uint8).view(-1, buf.element_size())[at].reshape(-1)


def _outside(name: str, buf: torch.Tensor, before: torch.Tensor, at: torch.Tensor) -> str | None:
    """Bytes of ``buf`` outside its elements ``at`` that differ from ``before`` (its bytes)."""
    inside = torch.zeros(buf.numel(), dtype=torch.bool, device=buf.device)
    inside[at] = True
    bad = (buf.view(torch.uint8) != before) & ~inside.repeat_interleave(buf.element_size())
    if not bool(bad.any()):
        return None
    return (
        f"{name}: {int(bad.sum())} bytes outside the view were written, first at byte {int(bad.nonzero()[0])}"
    )


def run_bytes_case(seed: int, profile, backend: str, device: torch.device) -> list[str]:
    """compare_bytes' invariant on the case of ``seed`` (make_bytes_case) with ``backend``: per
    piece, every field of the delta bit-equal to delta_encode_ref of the generator's old and new
    bytes of the piece (as fp8 [rows, row bytes], zero scales on both sides: no scale changes),
    and apply_delta of it on a copy of the old bytes gives the new ones; after all pieces the kept
    view holds the new bytes, nothing outside it was written and nothing of ``new``'s buffer."""
    case = make_bytes_case(seed, profile, device)
    new_before = case.new_buf.view(torch.uint8).clone()
    kept_before = case.kept_buf.view(torch.uint8).clone()
    fp8 = lambda b: b.view(torch.float8_e4m3fn)  # noqa: E731 - bytes as the delta functions take them
    errors: list[str | None] = []
    wants = []
    for k, (new, kept, old_b, new_b) in enumerate(case.pieces):
        name = f"piece {k} {list(old_b.shape)}"
        no_scale = torch.zeros(blocks_shape(*old_b.shape), device=device)
        want = delta_encode_ref(fp8(old_b), no_scale, fp8(new_b), no_scale)
        wants.append(want)
        d = compare_bytes(new, kept, backend=backend)
        if d.shape != tuple(old_b.shape):
            errors.append(f"{name} delta.shape: got {d.shape}, expected {tuple(old_b.shape)}")
        errors += [_diff(f"{name} delta.{f}", getattr(d, f), w) for f, w in zip(FIELDS, want)]
        engine = old_b.clone()
        apply_delta(d, fp8(engine), None, backend=backend)
        errors.append(_diff(f"{name} applied", engine, new_b))
    errors.append(_diff("kept view", _bytes_at(case.kept_buf, case.kept_at), case.new_bytes))
    errors.append(_outside("kept buffer", case.kept_buf, kept_before, case.kept_at))
    errors.append(_diff("new buffer (read only)", case.new_buf.view(torch.uint8), new_before))
    if "segment" in case.tags:
        errors += _segment_packed(case, wants, backend, device)
    return [f"seed={seed}: compare_bytes {backend} {case.desc}: {e}" for e in errors if e]


def _segment_packed(case: BytesCase, wants: list, backend: str, device: torch.device) -> list[str | None]:
    """A segment case packed as the sender packs it (``pack_bytes_delta``: with Triton, the offsets
    and the length on the device) into poisoned outputs: the kept bytes move to the new ones, the
    counts message and the payload's fields unpack to exactly the reference delta of each piece,
    and the length is what the counts call for."""
    sd = SegmentDelta.of_nbytes(case.old_bytes.numel())
    pieces, kept = sd.pieces, case.old_bytes.clone()
    counts = torch.full((counts_numel(pieces),), -7, dtype=torch.int32, device=device)
    length = torch.full((1,), -1, dtype=torch.int64, device=device)
    payload = torch.full((max(sd.bound, 2),), 0xFF, dtype=torch.uint8, device=device)
    new = sd.views(case.new_bytes)
    # The segment's checksum, taken by the comparison: of whole 8-byte words only.
    checksum = torch.full((1,), -3, dtype=torch.int64, device=device) if kept.numel() % 8 == 0 else None
    pack_bytes_delta(new, sd.views(kept), pieces, counts, length, payload, backend=backend, checksum=checksum)
    errors = [_diff("packed: kept", kept, case.new_bytes)]
    if checksum is not None:
        want = int(checksum_torch(case.new_bytes.cpu().view(torch.int64)))
        errors.append(None if int(checksum) == want else f"packed: checksum {int(checksum)}, expected {want}")
    try:
        layout = payload_layout(counts, pieces)
    except ValueError as exc:
        return [*errors, f"packed: counts refused: {exc}"]
    if int(length) != layout[1]:
        errors.append(f"packed: length {int(length)}, the counts call for {layout[1]}")
    for k, (d, want) in enumerate(zip(unpack_delta(counts, payload, pieces, layout), wants)):
        errors += [_diff(f"packed piece {k}.{f}", getattr(d, f), w) for f, w in zip(FIELDS, want)]
    return errors


def _run_seeds(
    seeds: list[int],
    profile: str,
    backend: str,
    device: str,
    deadline: float,
    jobs: tuple[str, ...] = ("quantize",),
) -> tuple[int, list]:
    """Run cases (in this process or a worker) started before ``deadline`` (time.time(), 0: none):
    (cases run, failure lines). ``jobs`` per seed: "quantize" (run_case with ``backend``),
    "bytes" (run_bytes_case with ``backend``) or "bytes:<backend>"."""
    done, failures = 0, []
    for seed in seeds:
        if deadline and time.time() > deadline:
            break
        for job in jobs:
            kind, _, job_backend = job.partition(":")
            run = run_case if kind == "quantize" else run_bytes_case
            try:
                failures += run(seed, PROFILES[profile], job_backend or backend, torch.device(device))
            except Exception as exc:  # noqa: BLE001 - a raising case is a failing case, reported with it
                failures.append(f"seed={seed}: {job}: {type(exc).__name__}: {exc}")
        done += 1
    return done, failures


def _fuzz(
    backend: str,
    device: str,
    profile,
    default_cases: int,
    budget_s: float,
    workers: int = 1,
    jobs: tuple[str, ...] = ("quantize",),
) -> None:
    """With ``workers`` > 1 the seeds go to spawned processes in chunks (test_fuzz.py's reason: a
    cold Triton compiles the delta kernels' specializations of each case, seconds per case, and
    the processes compile in parallel)."""
    base = _env_int("GLM_FP8_FUZZ_SEED", DEFAULT_SEED)
    cases = _env_int("GLM_FP8_FUZZ_CASES", default_cases)
    deadline = time.time() + budget_s if budget_s else 0.0
    seeds = list(range(base, base + cases))
    chunks = [seeds[i : i + CHUNK] for i in range(0, len(seeds), CHUNK)]
    failures, done, t0 = [], 0, time.perf_counter()
    if workers <= 1:
        results = [_run_seeds(c, profile.name, backend, device, deadline, jobs) for c in chunks]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [
                pool.submit(_run_seeds, c, profile.name, backend, device, deadline, jobs) for c in chunks
            ]
            results = []
            for chunk, fut in zip(chunks, futures):
                try:
                    results.append(fut.result())
                except Exception as exc:  # noqa: BLE001 - a crashed worker fails its seeds
                    results.append((len(chunk), [f"seeds {chunk}: worker died: {type(exc).__name__}: {exc}"]))
    for n, errs in results:
        done, failures = done + n, failures + errs
    print(
        f"\ndelta fuzz: backend={backend} device={device} jobs={'+'.join(jobs)} cases={done}/{cases} "
        f"failures={len(failures)} seconds={time.perf_counter() - t0:.1f} workers={workers} "
        f"seeds={base}..{base + cases - 1}",
        flush=True,
    )
    if failures:
        test = os.environ.get("PYTEST_CURRENT_TEST", "tests/kernels/test_delta_fuzz.py").split(" ")[0]
        seed = re.search(r"\d+", failures[0]).group()  # a line starts with its seed (or its chunk's)
        replay = f"replay: GLM_FP8_FUZZ_SEED={seed} GLM_FP8_FUZZ_CASES=1 pytest '{test}'"
        raise AssertionError("\n".join([replay, *failures[:20]]))


@pytest.mark.skipif(not ON_GPU, reason="the GPU delta fuzz needs CUDA; test_delta_fuzz_cpu runs small cases")
def test_delta_fuzz_gpu(capsys):
    budget = float(os.environ.get("GLM_FP8_FUZZ_BUDGET_S", "") or 120)
    workers = _env_int("GLM_FP8_FUZZ_WORKERS", min(8, max(1, (os.cpu_count() or 2) // 2)))
    with capsys.disabled():
        _fuzz("triton", "cuda", GPU_PROFILE, GPU_CASES, budget, workers, GPU_JOBS)


@pytest.mark.skipif(ON_GPU, reason="on a GPU, test_delta_fuzz_gpu runs the full-size generator")
@pytest.mark.parametrize("backend", ["triton", "torch"], ids=backend_id)
def test_delta_fuzz_cpu(backend, capsys):
    with capsys.disabled():
        _fuzz(backend, "cpu", CPU_PROFILE, CPU_CASES, 0.0)


@pytest.mark.skipif(ON_GPU, reason="on a GPU, test_delta_fuzz_gpu runs every seed's compare_bytes case")
@pytest.mark.parametrize("backend", ["triton", "torch"], ids=backend_id)
def test_compare_bytes_fuzz_cpu(backend, capsys, monkeypatch):
    """A few compare_bytes cases in CI; with the triton backend the kernel ran for some of them."""
    from glm_fp8.kernels import triton_delta

    launches, real = [], triton_delta.launch_compare_bytes
    monkeypatch.setattr(triton_delta, "launch_compare_bytes", lambda *a: launches.append(1) or real(*a))
    with capsys.disabled():
        _fuzz(backend, "cpu", CPU_PROFILE, BYTES_CPU_CASES, 0.0, jobs=("bytes",))
    if not os.environ.get("GLM_FP8_FUZZ_CASES") and not os.environ.get("GLM_FP8_FUZZ_SEED"):
        assert (len(launches) > 0) == (backend == "triton"), f"{len(launches)} kernel launches with {backend}"


@pytest.mark.parametrize("backend", ["triton", "torch"], ids=backend_id)
@pytest.mark.parametrize("shape", [(256, 1), (0, 33), (1, 1)])
def test_compare_bytes_takes_a_contiguous_nonunit_last_stride(shape, backend, device):
    """bf16 kept copies torch calls contiguous with a last stride of 256 ([256, 1] seen through a
    transposed [1, 256]) or 2 ([0, 33], every other column of [0, 66]; [1, 1], every other element
    of both dims of [2, 2], whose strides survive flattening: GPU delta fuzz seed 20261239):
    compare_bytes moves them to ``new`` as any other layout (each raised before: a byte view of
    such a tensor fails)."""
    rows, cols = shape
    new = torch.arange(rows * cols, device=device).to(torch.bfloat16).view(shape)
    zeros = lambda *s: torch.zeros(*s, dtype=torch.bfloat16, device=device)  # noqa: E731
    kept = {
        (256, 1): lambda: zeros(1, 256).t(),
        (0, 33): lambda: zeros(0, 66)[:, ::2],
        (1, 1): lambda: zeros(2, 2)[::2, ::2],
    }[shape]()
    assert kept.is_contiguous() and kept.stride(-1) != 1
    d = compare_bytes(new, kept, backend=backend)
    assert d.shape == (rows, 2 * cols) and torch.equal(kept, new)


def test_compare_bytes_cases_cover_the_layouts():
    """The first 60 seeds (of the 200 the GPU run takes; generated here at the CPU profile's sizes,
    no kernel run) hold every kind of compare_bytes case the invariant names, and cases of the
    layouts the Triton kernel takes (2-D or less, both contiguous)."""
    tags: set[str] = set()
    for seed in range(DEFAULT_SEED, DEFAULT_SEED + 60):
        case = make_bytes_case(seed, CPU_PROFILE, torch.device("cpu"))
        kernel = all(n.dim() <= 2 and n.is_contiguous() and k.is_contiguous() for n, k, _, _ in case.pieces)
        tags |= case.tags | ({"kernel_path"} if kernel else set())
    want = set(
        "segment rows flat experts rows=0 one_row partial_row_block partial_col_block sparse_edge dense_edge "
        "kept_padded kept_transposed kept_step2 new_step2 kernel_path".split()
    )
    want |= {f"moved={m}" for m in MOVED} | {str(d).removeprefix("torch.") for d in BYTE_DTYPES}
    assert want <= tags, f"missing: {sorted(want - tags)}"


def _off_by_one(real):
    """``real`` (a delta maker) with the first value byte of every delta it returns flipped."""

    def wrong(*args, **kw):
        d = real(*args, **kw)
        if d.values.numel():
            d.values[0] ^= 1
        return d

    return wrong


def test_the_bytes_harness_reports_a_wrong_byte(monkeypatch):
    """A compare_bytes that gets one byte of its delta wrong fails its case."""
    monkeypatch.setattr(sys.modules[__name__], "compare_bytes", _off_by_one(compare_bytes))
    cpu = torch.device("cpu")
    changes = lambda c: not torch.equal(c.old_bytes, c.new_bytes)  # noqa: E731
    seed = next(
        s for s in range(DEFAULT_SEED, DEFAULT_SEED + 50) if changes(make_bytes_case(s, CPU_PROFILE, cpu))
    )
    errors = run_bytes_case(seed, CPU_PROFILE, "torch", cpu)
    assert any("delta.values" in e for e in errors) and any("applied" in e for e in errors), errors


def test_the_harness_reports_a_wrong_byte(monkeypatch):
    """A kernel that gets one changed byte wrong fails its case (the fuzz would catch it)."""
    monkeypatch.setattr(sys.modules[__name__], "quantize_compare", _off_by_one(quantize_compare))
    seed = next(s for s in range(DEFAULT_SEED, DEFAULT_SEED + 50) if _changes(s))
    errors = run_case(seed, CPU_PROFILE, "torch", torch.device("cpu"))
    assert any("delta.values" in e for e in errors) and any("applied fp8" in e for e in errors), errors


def _changes(seed: int) -> bool:
    """Whether the case of ``seed`` changes any byte (its first job's previous step differs)."""
    case = make_case(seed, CPU_PROFILE)
    rng, gen = random.Random(seed ^ 0x5EED), torch.Generator().manual_seed(seed)
    b = _build(case.jobs[0], case, gen, "cpu")
    old = _previous(b.views, rng, gen)
    return not torch.equal(
        quantize_concat_ref(old, case.scale_fmt)[0].view(torch.uint8),
        quantize_concat_ref(b.views, case.scale_fmt)[0].view(torch.uint8),
    )
