"""Benchmark cases shared by ``glm-fp8 bench`` and ``bench/`` (pytest-benchmark).

Every case is timed beside a device-to-device copy of the same input bytes in the same
process, so the figure that matters is a ratio: ``share = quantize GB/s / copy GB/s`` where
quantize moves (inputs read once + fp8 and scales written once) and the copy moves its input
bytes read plus the same bytes written.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from glm_fp8.core.numerics import ceil_blocks
from glm_fp8.kernels.backends import available_backends
from glm_fp8.kernels.convert import convert_layer
from glm_fp8.kernels.quantize import ExpertsFP8, quantize_blockwise, quantize_experts
from glm_fp8.kernels.reference import convert_layer_ref, quantize_concat_ref, quantize_experts_ref
from glm_fp8.model.plans import plan_from_config
from glm_fp8.model.presets import PRESETS, SMALL_GLM5

_GLM5 = PRESETS["glm-5"]
GLM5_HIDDEN, GLM5_MOE_INTERMEDIATE, GLM5_EXPERTS = (
    _GLM5["hidden_size"],
    _GLM5["moe_intermediate_size"],
    _GLM5["n_routed_experts"],
)
L2_FLUSH_BYTES = 256 << 20  # rotate input sets until they exceed the H200's 60 MB L2 by far


@dataclass
class Case:
    """A benchmark shape. ``kind`` is "experts" (w1, w3, w2) or "blockwise" (row sources)."""

    name: str
    kind: str  # "experts", "blockwise" or "layer"
    dtype: torch.dtype
    shapes: list[tuple[int, ...]]
    note: str = ""
    names: list[str] = field(default_factory=list)  # layer: trainer names of ``shapes``
    plan: object = None  # layer: its LayerPlan

    @property
    def input_bytes(self) -> int:
        return sum(math.prod(s) for s in self.shapes) * self.dtype.itemsize

    @property
    def output_bytes(self) -> int:
        if self.kind == "experts":
            (e, i, h), _, _ = self.shapes
            return experts_out_bytes(e, h, i)
        if self.kind == "layer":
            return self.plan.nbytes
        rows = sum(s[-2] for s in self.shapes)
        cols = self.shapes[0][-1]
        return rows * cols + 4 * ceil_blocks(rows) * ceil_blocks(cols)


def experts_out_bytes(e: int, h: int, i: int) -> int:
    return e * (2 * i * h + h * i) + 4 * e * (
        ceil_blocks(2 * i) * ceil_blocks(h) + ceil_blocks(h) * ceil_blocks(i)
    )


def glm5_cases() -> list[Case]:
    e, h, i = GLM5_EXPERTS, GLM5_HIDDEN, GLM5_MOE_INTERMEDIATE
    experts = [(e, i, h), (e, i, h), (e, h, i)]
    e8 = [(8, i, h), (8, i, h), (8, h, i)]
    return [
        Case("glm5-experts-bf16", "experts", torch.bfloat16, experts, "one GLM-5 layer, E=256"),
        Case("glm5-experts-fp32", "experts", torch.float32, experts, "fp32 master weights"),
        Case("e8-experts-bf16", "experts", torch.bfloat16, e8, "E=8, same H and I"),
        Case("fused_qkv_a-bf16", "blockwise", torch.bfloat16, [(2048, h), (576, h)], "2-D, 2 sources"),
        layer_case(_GLM5, 3, "glm5-sparse-layer-bf16", "convert_layer, whole GLM-5 sparse layer"),
    ]


def layer_case(config: dict, layer_idx: int, name: str, note: str) -> Case:
    plan = plan_from_config(config, layer_idx)
    names = list(plan.inputs)
    return Case(name, "layer", torch.bfloat16, [plan.inputs[k][0] for k in names], note, names, plan)


def small_cases() -> list[Case]:
    """Shapes the CPU interpreter finishes in seconds; same structure as the GLM-5 cases."""
    experts = [(4, 192, 256), (4, 192, 256), (4, 256, 192)]
    return [
        Case("small-experts-bf16", "experts", torch.bfloat16, experts, "E=4, H=256, I=192"),
        Case("small-experts-fp32", "experts", torch.float32, experts, "E=4, H=256, I=192"),
        Case("small-qkv-bf16", "blockwise", torch.bfloat16, [(160, 256), (60, 256)], "2-D, 2 sources"),
        layer_case(SMALL_GLM5, 3, "small-sparse-layer-bf16", "convert_layer, GLM-5 layer / 24"),
    ]


@dataclass
class Prepared:
    """Input sets (rotated to defeat the L2 cache), preallocated outputs, copy destinations."""

    case: Case
    inputs: list[list[torch.Tensor]]
    outs: list[object] = field(default_factory=list)
    copy_dst: list[torch.Tensor] = field(default_factory=list)
    turn: int = 0

    def next_inputs(self) -> tuple[list[torch.Tensor], object]:
        k = self.turn % len(self.inputs)
        self.turn += 1
        return self.inputs[k], self.outs[k]


def prepare(case: Case, device: torch.device) -> Prepared:
    sets = max(1, -(-L2_FLUSH_BYTES // case.input_bytes)) if device.type == "cuda" else 1
    inputs = []
    for _ in range(sets):
        # Gaussian weights at a realistic scale; never zeros (they can time faster).
        inputs.append([torch.randn(s, device=device, dtype=case.dtype) * 0.02 for s in case.shapes])
    prep = Prepared(case, inputs)
    for srcs in inputs:
        if case.kind == "layer":
            prep.outs.append(torch.empty(case.plan.nbytes, dtype=torch.uint8, device=device))
        elif case.kind == "experts":
            e, i, h = srcs[0].shape
            prep.outs.append(ExpertsFP8.empty(e, h, i, device=device))
        else:
            rows, cols = sum(s.shape[-2] for s in srcs), srcs[0].shape[-1]
            prep.outs.append(
                (
                    torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device),
                    torch.empty(ceil_blocks(rows), ceil_blocks(cols), device=device),
                )
            )
    prep.copy_dst = [torch.empty_like(t) for t in inputs[0]]
    return prep


def fused_backends(device: torch.device) -> list[str]:
    """The fused backends to time on ``device`` (the eager reference is timed as its own method)."""
    return [b for b in available_backends(device) if b != "torch"]


Method = tuple[str, str]  # (method, backend); backend "" for copy and the references


def method_names(case: Case, with_compile: bool, backends: list[str]) -> list[Method]:
    """The methods ``method_fns`` times for a case, without preparing any tensor."""
    if case.kind == "layer":
        fused = ["glm_fp8", "glm_fp8 check_finite=True", "quantize_experts alone"]
        refs = ["copy", "eager reference"]
    else:
        fused = ["glm_fp8", "glm_fp8 check_finite=False"]
        refs = ["copy", "eager reference"] + (["torch.compile reference"] if with_compile else [])
    return [(m, b) for b in backends for m in fused] + [(m, "") for m in refs]


def method_fns(prep: Prepared, with_compile: bool, backends: list[str]) -> dict[Method, Callable[[], object]]:
    """The timed callables of one case: glm_fp8 into preallocated outputs on each backend, a
    copy of the same input bytes, and the references."""
    case = prep.case
    fns: dict[Method, Callable[[], object]] = {}

    def copy() -> None:
        for dst, src in zip(prep.copy_dst, prep.inputs[0]):
            dst.copy_(src)

    if case.kind == "layer":
        for b in backends:
            fns.update(_layer_fns(prep, b))
        fns[("copy", "")] = copy
        fns[("eager reference", "")] = _layer_eager(prep)
        return fns

    def fused(backend: str, check_finite: bool) -> Callable[[], object]:
        def run() -> object:
            srcs, out = prep.next_inputs()
            if case.kind == "experts":
                return quantize_experts(*srcs, out=out, check_finite=check_finite, backend=backend)
            return quantize_blockwise(
                srcs, out=out[0], scale_out=out[1], check_finite=check_finite, backend=backend
            )

        return run

    def reference(fn: Callable = quantize_concat_ref) -> object:
        srcs = prep.inputs[0]
        if case.kind == "experts":
            return quantize_experts_ref(*srcs) if fn is quantize_concat_ref else _per_expert(fn, srcs)
        return fn(srcs)

    for b in backends:
        fns[("glm_fp8", b)] = fused(b, True)
        fns[("glm_fp8 check_finite=False", b)] = fused(b, False)
    fns[("copy", "")] = copy
    fns[("eager reference", "")] = reference
    if with_compile:
        compiled = torch.compile(quantize_concat_ref, dynamic=False)
        fns[("torch.compile reference", "")] = lambda: reference(compiled)
    return fns


def _layer_views(prep: Prepared) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    plan = prep.case.plan
    layer = dict(zip(prep.case.names, prep.inputs[0]))
    buf = prep.outs[0]
    return layer, buf, dict(plan.views(buf))


def _layer_fns(prep: Prepared, backend: str) -> dict[Method, Callable[[], object]]:
    """convert_layer against quantize_experts alone on the same layer, on one backend."""
    plan = prep.case.plan
    layer, buf, views = _layer_views(prep)
    suffixes = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")
    experts_out = ExpertsFP8(*(views[f"mlp.experts.{n}"] for n in suffixes))
    w1, w3, w2 = (layer[f"mlp.experts.{n}"] for n in ("w1", "w3", "w2"))
    convert = lambda check: convert_layer(layer, 0, out=buf, plan=plan, check_finite=check, backend=backend)  # noqa: E731
    return {
        ("glm_fp8", backend): lambda: convert(False),
        ("glm_fp8 check_finite=True", backend): lambda: convert(True),
        ("quantize_experts alone", backend): lambda: quantize_experts(
            w1, w3, w2, out=experts_out, check_finite=False, backend=backend
        ),
    }


def _layer_eager(prep: Prepared) -> Callable[[], object]:
    """The eager composition prime-rl runs: torch.cat per entry, experts quantized one by
    one, stacked."""
    layer, _, _ = _layer_views(prep)
    return lambda: convert_layer_ref(layer, 0, prep.case.plan, per_expert=True)


def _per_expert(fn: Callable, srcs: list[torch.Tensor]) -> object:
    w1, w3, w2 = srcs
    outs = [(fn([w1[e], w3[e]]), fn([w2[e]])) for e in range(w1.shape[0])]
    return [torch.stack([o[k][j] for o in outs]) for k in range(2) for j in range(2)]


def time_ms(fn: Callable[[], object], device: torch.device, budget_ms: float = 1000.0) -> float:
    """Median milliseconds per call: CUDA events via triton's do_bench, wall clock on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=100, rep=budget_ms, return_mode="median"))
    fn()
    times = []
    t_end = time.perf_counter() + budget_ms / 1000
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 20):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def wall_seconds(fn: Callable[[], object], runs: int = 1) -> float:
    """Median wall-clock seconds of ``runs`` calls, the device synchronized before and after each
    (for work that spans streams, host waits and copies, which ``time_ms``' events do not see)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_transient_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Peak bytes allocated above what was live before the call (outputs it returns included)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del result
    return peak


@dataclass
class Row:
    case: str
    dtype: str
    method: str
    backend: str
    ms: float
    gbps: float | None  # None on the CPU: the interpreter's times say nothing about bandwidth
    share_of_copy: float | None
    peak_transient_mib: float | None


# Printed under the table on the CPU, where the rows only show that each path runs.
CPU_NOTE = (
    "note: on the CPU the kernels run in Triton's interpreter; the times only show that each path "
    "runs (GB/s and share of copy are n/a)"
)


def run_case(
    case: Case,
    device: torch.device,
    with_compile: bool,
    budget_ms: float,
    backends: list[str] | None = None,
    rounds: int = 1,
) -> list[Row]:
    """Time every method of ``case``. Each method's time is paired with a copy timed just before
    it, so clock and thermal drift hit the copy and the kernel alike; with ``rounds`` > 1 all
    methods are timed in turn, round after round, and each figure is the median over rounds of
    its time and of its ratio to its paired copy. On the CPU only the times are reported (no
    paired copies; ``gbps`` and ``share_of_copy`` are None): the interpreter measures no bandwidth."""
    backends = fused_backends(device) if backends is None else backends
    on_gpu = device.type == "cuda"
    prep = prepare(case, device)
    fns = method_fns(prep, with_compile, backends)
    times: dict[Method, list[float]] = {m: [] for m in fns}
    shares: dict[Method, list[float]] = {m: [] for m in fns}
    peaks: dict[Method, int | None] = {}
    for _ in range(rounds):
        for (method, backend), fn in fns.items():
            if not on_gpu:
                times[(method, backend)].append(time_ms(fn, device, budget_ms))
                peaks.setdefault((method, backend), None)
                continue
            copy_ms = time_ms(fns[("copy", "")], device, budget_ms)
            copy_gbps = moved_bytes(case, "copy") / copy_ms / 1e6
            ms = copy_ms if method == "copy" else time_ms(fn, device, budget_ms)
            times[(method, backend)].append(ms)
            shares[(method, backend)].append(moved_bytes(case, method) / ms / 1e6 / copy_gbps)
            if (method, backend) not in peaks:
                peaks[(method, backend)] = peak_transient_bytes(fn, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    rows = []
    for (method, backend), ms_list in times.items():
        ms = statistics.median(ms_list)
        peak = peaks[(method, backend)]
        gbps = moved_bytes(case, method) / ms / 1e6 if on_gpu else None
        share = statistics.median(shares[(method, backend)]) if on_gpu else None
        rows.append(
            Row(
                case.name,
                str(case.dtype).removeprefix("torch."),
                method,
                backend,
                ms,
                gbps,
                share,
                None if peak is None else peak / 2**20,
            )
        )
    del prep, fns
    return rows


def moved_bytes(case: Case, method: str) -> int:
    """Bytes a method moves: the copy reads and writes its input; the others read inputs and
    write outputs once; quantize_experts alone, on a layer case, moves the experts' bytes only."""
    if method == "copy":
        return 2 * case.input_bytes
    if method == "quantize_experts alone":
        e, i, h = case.shapes[case.names.index("mlp.experts.w1")]
        return 3 * e * i * h * case.dtype.itemsize + experts_out_bytes(e, h, i)
    return case.input_bytes + case.output_bytes


def format_rows(rows: list[Row], markdown: bool = False) -> str:
    from tabulate import tabulate

    na = "n/a (CPU)"  # None: measured on the CPU (Row)
    table = [
        [
            r.case,
            r.dtype,
            r.method,
            r.backend,
            f"{r.ms:.3f}",
            na if r.gbps is None else f"{r.gbps:.0f}",
            na if r.share_of_copy is None else f"{r.share_of_copy:.3f}",
            "n/a" if r.peak_transient_mib is None else f"{r.peak_transient_mib:.1f}",
        ]
        for r in rows
    ]
    headers = ["case", "dtype", "method", "backend", "ms", "GB/s", "share of copy", "peak transient MiB"]
    return tabulate(table, headers, tablefmt="github" if markdown else "simple")
