"""pytest-benchmark suite: the fused quantizer, a copy of the same bytes, and the references.

    pytest bench                          # GLM-5 shapes on a GPU, small shapes on a CPU
    pytest bench --benchmark-json out.json

Each row's extra_info carries GB/s over the ideal bytes, the share of a device-to-device
copy's bandwidth measured in this process, and the peak transient memory of one call.
"""

import functools

import pytest
import torch

from glm_fp8.cli import bench

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CASES = bench.glm5_cases() if DEVICE.type == "cuda" else bench.small_cases()
WITH_COMPILE = DEVICE.type == "cuda"
BACKENDS = bench.fused_backends(DEVICE)


@functools.lru_cache(maxsize=1)
def _prepared(name: str):
    case = next(c for c in CASES if c.name == name)
    prep = bench.prepare(case, DEVICE)
    fns = bench.method_fns(prep, WITH_COMPILE, BACKENDS)
    copy_ms = bench.time_ms(fns[("copy", "")], DEVICE)
    return case, fns, 2 * case.input_bytes / copy_ms / 1e6


def _synced(fn):
    def run():
        fn()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    return run


@pytest.mark.parametrize(
    "case_name, method, backend",
    [(c.name, m, b) for c in CASES for m, b in bench.method_names(c, WITH_COMPILE, BACKENDS)],
)
def test_quantize(benchmark, case_name, method, backend):
    case, fns, copy_gbps = _prepared(case_name)
    fn = fns[(method, backend)]
    fn()  # compile / warm up outside the timing
    slow = "reference" in method
    benchmark.pedantic(_synced(fn), rounds=3 if slow else 20, warmup_rounds=1)
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing to report
        return
    gbps = bench.moved_bytes(case, method) / benchmark.stats.stats.median / 1e9
    peak = bench.peak_transient_bytes(fn, DEVICE)
    benchmark.extra_info.update(
        {
            "GB/s": round(gbps, 1),
            "copy GB/s": round(copy_gbps, 1),
            "share_of_copy": round(gbps / copy_gbps, 4),
            "peak_transient_MiB": None if peak is None else round(peak / 2**20, 1),
            "device": str(DEVICE),
            "backend": backend,
        }
    )
