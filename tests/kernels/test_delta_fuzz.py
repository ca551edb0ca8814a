"""Seeded differential fuzz of the delta kernels (glm_fp8.delta), on test_fuzz.py's case generator:
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

``test_delta_fuzz_gpu`` runs ``GLM_FP8_FUZZ_CASES`` (default 200) cases on CUDA within
``GLM_FP8_FUZZ_BUDGET_S`` seconds (default 120); ``test_delta_fuzz_cpu`` a few small ones in CI.
Replay one case: ``GLM_FP8_FUZZ_SEED=<seed> GLM_FP8_FUZZ_CASES=1 pytest tests/kernels/test_delta_fuzz.py``.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
from conftest import ON_GPU
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

from glm_fp8.delta import apply_delta, quantize_compare
from glm_fp8.delta_cut import cut_delta
from glm_fp8.numerics import BLOCK
from glm_fp8.reference import delta_encode_ref, quantize_concat_ref

FIELDS = ("counts", "positions", "values", "scale_index", "scale_values")
MOVED = [0.0, 1e-4, 1e-3, 1e-2, 0.3, 1.0]  # fraction of the elements that moved since the last step
CPU_CASES = 6
GPU_CASES = 200


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


def _same(name: str, got, want) -> str | None:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{name}: got {got.dtype} {list(got.shape)}, expected {want.dtype} {list(want.shape)}"
    a, b = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    return None if torch.equal(a, b) else f"{name}: {int((a != b).sum())} bytes differ"


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
        errors += [_same(f"{job.name} delta.{f}", getattr(d, f), w) for f, w in zip(FIELDS, want)]
        errors += [_outside_changed(n, buf, before, view) for n, buf, before, view in b.out_bufs]
        errors += [f"{job.name} source {k} changed" for k, (a, c) in enumerate(zip(b.src_bufs, src_before))
                   if not torch.equal(a.view(torch.uint8), c.view(torch.uint8))]  # fmt: skip
        apply_delta(d, engine_q, engine_s, backend=backend)
        errors += [_diff(f"{job.name} applied fp8", engine_q, new_q),
                   _diff(f"{job.name} applied scales", engine_s, new_s)]  # fmt: skip
        cut = _block_cut(tuple(new_q.shape), rng)
        got = cut_delta(d, **cut)
        part = delta_encode_ref(_view(old_q, cut, False), _view(old_s, cut, True),
                                _view(new_q, cut, False), _view(new_s, cut, True))  # fmt: skip
        errors += [_same(f"{job.name} cut {cut} .{f}", getattr(got, f), w) for f, w in zip(FIELDS, part)]
    return [f"seed={seed}: {e}" for e in errors if e]


def _run_seeds(
    seeds: list[int], profile: str, backend: str, device: str, deadline: float
) -> tuple[int, list]:
    """Run cases (in this process or a worker) started before ``deadline`` (time.time(), 0: none):
    (cases run, failure lines)."""
    done, failures = 0, []
    for seed in seeds:
        if deadline and time.time() > deadline:
            break
        try:
            failures += run_case(seed, PROFILES[profile], backend, torch.device(device))
        except Exception as exc:  # noqa: BLE001 - a raising case is a failing case, reported with it
            failures.append(f"seed={seed}: {type(exc).__name__}: {exc}")
        done += 1
    return done, failures


def _fuzz(backend: str, device: str, profile, default_cases: int, budget_s: float, workers: int = 1) -> None:
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
        results = [_run_seeds(c, profile.name, backend, device, deadline) for c in chunks]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_run_seeds, c, profile.name, backend, device, deadline) for c in chunks]
            results = []
            for chunk, fut in zip(chunks, futures):
                try:
                    results.append(fut.result())
                except Exception as exc:  # noqa: BLE001 - a crashed worker fails its seeds
                    results.append((len(chunk), [f"seeds {chunk}: worker died: {type(exc).__name__}: {exc}"]))
    for n, errs in results:
        done, failures = done + n, failures + errs
    print(f"\ndelta fuzz: backend={backend} device={device} cases={done}/{cases} failures={len(failures)} "
          f"seconds={time.perf_counter() - t0:.1f} workers={workers} seeds={base}..{base + cases - 1}",
          flush=True)  # fmt: skip
    assert not failures, "\n".join(failures[:20])


@pytest.mark.skipif(not ON_GPU, reason="the GPU delta fuzz needs CUDA; test_delta_fuzz_cpu runs small cases")
def test_delta_fuzz_gpu(capsys):
    budget = float(os.environ.get("GLM_FP8_FUZZ_BUDGET_S", "") or 120)
    workers = _env_int("GLM_FP8_FUZZ_WORKERS", min(8, max(1, (os.cpu_count() or 2) // 2)))
    with capsys.disabled():
        _fuzz("triton", "cuda", GPU_PROFILE, GPU_CASES, budget, workers)


@pytest.mark.skipif(ON_GPU, reason="on a GPU, test_delta_fuzz_gpu runs the full-size generator")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_delta_fuzz_cpu(backend, capsys):
    with capsys.disabled():
        _fuzz(backend, "cpu", CPU_PROFILE, CPU_CASES, 0.0)


def test_the_harness_reports_a_wrong_byte(monkeypatch):
    """A kernel that gets one changed byte wrong fails its case (the fuzz would catch it)."""
    import sys

    real = quantize_compare

    def off_by_one(*args, **kw):
        d = real(*args, **kw)
        if d.values.numel():
            d.values[0] ^= 1
        return d

    monkeypatch.setattr(sys.modules[__name__], "quantize_compare", off_by_one)
    seed = next(s for s in range(DEFAULT_SEED, DEFAULT_SEED + 50) if _changes(s))
    errors = run_case(seed, CPU_PROFILE, "torch", torch.device("cpu"))
    assert any("delta.values" in e for e in errors) and any("applied fp8" in e for e in errors), errors


def _changes(seed: int) -> bool:
    """Whether the case of ``seed`` changes any byte (its first job's previous step differs)."""
    case = make_case(seed, CPU_PROFILE)
    rng, gen = random.Random(seed ^ 0x5EED), torch.Generator().manual_seed(seed)
    b = _build(case.jobs[0], case, gen, "cpu")
    old = _previous(b.views, rng, gen)
    return not torch.equal(quantize_concat_ref(old, case.scale_fmt)[0].view(torch.uint8),
                           quantize_concat_ref(b.views, case.scale_fmt)[0].view(torch.uint8))  # fmt: skip
