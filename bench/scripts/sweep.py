"""Launch-config sweep of the Triton kernel on GLM-5 routed experts (GPU only), timed steadily.

python bench/scripts/sweep.py [--dtype bf16 fp32] [--experts 256 8] [--rounds 5] [--calls N]
                              [--timer do_bench] [--config NAME ...]

Each round times a device-to-device copy of the input bytes and then every config (and the
CUDA backend, when built) in turn: CUDA events around back-to-back calls, no cache flush (the
inputs are far larger than L2). Share of copy = (ideal bytes / kernel time) / (2 * input
bytes / copy time) with that round's copy; the table gives the median over rounds and the
min-max range. Without the finite check. Before it is timed, every config writes poisoned
outputs that must come out bit-identical to the first config's on three experts.
``--timer do_bench`` times each method with triton's do_bench instead (one call between two
events after a 256 MB cache flush, median), the method of ``glm-fp8 bench``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from glm_fp8 import ExpertsFP8, LaunchConfig, quantize_experts
from glm_fp8.cli.bench import GLM5_HIDDEN, GLM5_MOE_INTERMEDIATE, experts_out_bytes
from glm_fp8.kernels.backends import cuda_backend_available

CONFIGS = {
    "4w-abs": LaunchConfig(cb_per_prog=1, num_warps=4, maxnreg=None, signed_quotient=False),
    "4w-cb2-abs": LaunchConfig(cb_per_prog=2, num_warps=4, maxnreg=None, signed_quotient=False),
    "4w": LaunchConfig(cb_per_prog=1, num_warps=4, maxnreg=None),
    "4w-cb2": LaunchConfig(cb_per_prog=2, num_warps=4, maxnreg=None),
    "8w-r80-abs": LaunchConfig(cb_per_prog=1, num_warps=8, maxnreg=80, signed_quotient=False),
    "8w-r80": LaunchConfig(cb_per_prog=1, num_warps=8, maxnreg=80),  # the default
    "8w-r64": LaunchConfig(cb_per_prog=1, num_warps=8, maxnreg=64),
    "16w-r64": LaunchConfig(cb_per_prog=1, num_warps=16, maxnreg=64),
    "16w-r40": LaunchConfig(cb_per_prog=1, num_warps=16, maxnreg=40),
}
assert CONFIGS["8w-r80"] == LaunchConfig()


def events_ms(fn: Callable[[], object], calls: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def do_bench_ms(fn: Callable[[], object], calls: int) -> float:
    """``glm-fp8 bench``'s timer; ``calls`` is unused (do_bench picks its own count)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def sweep(
    dtype: torch.dtype, e: int, names: list[str], rounds: int, calls: int | None = None, timer: str = "events"
) -> list[list]:
    h, i = GLM5_HIDDEN, GLM5_MOE_INTERMEDIATE
    w1, w3 = (torch.randn(e, i, h, device="cuda", dtype=dtype) * 0.02 for _ in range(2))
    w2 = torch.randn(e, h, i, device="cuda", dtype=dtype) * 0.02
    out = ExpertsFP8.empty(e, h, i)
    dst = torch.empty_like(w1)  # one buffer: the copy reads and writes every input byte once
    in_bytes = 3 * w1.nbytes
    ideal = in_bytes + experts_out_bytes(e, h, i)
    calls = calls or max(3, round(40 * 8 / e))  # back-to-back calls per timing

    def copy() -> None:
        for src in (w1, w3, w2):
            dst.view(-1)[: src.numel()].copy_(src.view(-1))

    methods: dict[str, Callable[[], object]] = {}
    for name in names:
        cfg = CONFIGS[name]
        methods[name] = lambda cfg=cfg: quantize_experts(w1, w3, w2, out=out, config=cfg, check_finite=False)
    if cuda_backend_available():
        methods["cuda backend"] = lambda: quantize_experts(
            w1, w3, w2, out=out, check_finite=False, backend="cuda"
        )

    picks = sorted({0, e // 2, e - 1})
    reference = None
    for name, fn in methods.items():
        for t in (out.w13, out.w2):
            t.view(torch.uint8).fill_(0xFF)
        for t in (out.w13_scale_inv, out.w2_scale_inv):
            t.fill_(float("nan"))
        fn()
        got = [
            t[picks].view(torch.uint8) if t.dtype != torch.float32 else t[picks].view(torch.int32)
            for _, t in out.items()
        ]
        if reference is None:
            reference = [g.clone() for g in got]
        elif not all(torch.equal(a, b) for a, b in zip(got, reference)):
            raise AssertionError(f"{name}: output bits differ from {names[0]}'s")

    ms: dict[str, list[float]] = {m: [] for m in methods}
    shares: dict[str, list[float]] = {m: [] for m in methods}
    copy_ms: list[float] = []
    time_fn = do_bench_ms if timer == "do_bench" else events_ms
    for _ in range(rounds):
        c = time_fn(copy, calls)
        copy_ms.append(c)
        for name, fn in methods.items():
            t = time_fn(fn, calls)
            ms[name].append(t)
            shares[name].append((ideal / t) / (2 * in_bytes / c))
    label = f"{str(dtype).removeprefix('torch.')} E={e}"
    rows = [[label, "copy", "", f"{statistics.median(copy_ms):.3f}", "1", ""]]
    for name in methods:
        cfg = CONFIGS.get(name)
        what = (
            ""
            if cfg is None
            else (
                f"cb={cfg.cb_per_prog} warps={cfg.num_warps} maxnreg={cfg.maxnreg} "
                f"signed={int(cfg.signed_quotient)}"
            )
        )
        sh = shares[name]
        rows.append(
            [
                label,
                name,
                what,
                f"{statistics.median(ms[name]):.3f}",
                f"{statistics.median(sh):.3f}",
                f"{min(sh):.3f}-{max(sh):.3f}",
            ]
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    p.add_argument("--experts", nargs="+", type=int, default=[256, 8])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, help="back-to-back calls per timing (default: ~20 ms of work)")
    p.add_argument("--timer", choices=["events", "do_bench"], default="events")
    p.add_argument("--config", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = p.parse_args()
    from tabulate import tabulate

    headers = ["case", "method", "config", "ms", "share of copy", "range"]
    rows = []
    for name in args.dtype:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
        for e in args.experts:
            rows += sweep(dtype, e, args.config, args.rounds, args.calls, args.timer)
            torch.cuda.empty_cache()
            print(f"done: {name} E={e}", flush=True)
    print(tabulate(rows, headers, "github"))


if __name__ == "__main__":
    main()
