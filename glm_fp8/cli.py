"""``glm-fp8``: command-line entry point."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict


def _bench(args: argparse.Namespace) -> int:
    import torch

    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu:
        # The kernels run on the CPU only in Triton's interpreter; set before glm_fp8 loads.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from glm_fp8 import bench

    device = torch.device("cuda" if on_gpu else "cpu")
    shapes = args.shapes if args.shapes != "auto" else ("glm5" if on_gpu else "small")
    cases = bench.glm5_cases() if shapes == "glm5" else bench.small_cases()
    if args.case:
        cases = [c for c in cases if any(k in c.name for k in args.case)]
    with_compile = on_gpu and not args.no_compile
    print(f"device: {_device_name(device)}; torch {torch.__version__}; "
          f"triton {_triton_version()}; shapes: {shapes}", file=sys.stderr)  # fmt: skip
    rows = []
    for case in cases:
        print(f"  {case.name}: {case.note}", file=sys.stderr)
        rows.extend(bench.run_case(case, device, with_compile, args.budget_ms))
    print(bench.format_rows(rows, markdown=args.markdown))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


def _device_name(device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}), Triton interpreter"


def _triton_version() -> str:
    import triton

    return triton.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="glm-fp8", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "bench",
        help="time the fused quantizer against a copy of the same bytes and the reference",
        description="GB/s over the ideal bytes, share of a device-to-device copy's bandwidth "
        "measured in the same run, and peak transient memory. GLM-5 shapes on a GPU, small "
        "shapes on the CPU (Triton interpreter: the figures then show only that it runs).",
    )
    b.add_argument("--shapes", choices=["auto", "glm5", "small"], default="auto")
    b.add_argument("--case", action="append", help="run only cases whose name contains this")
    b.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    b.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    b.add_argument("--budget-ms", type=float, default=1000.0, help="timing budget per method")
    b.add_argument("--markdown", action="store_true", help="print a Markdown table")
    b.add_argument("--json", help="also write the rows to this JSON file")
    b.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
