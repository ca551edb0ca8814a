"""Scatter mode's sender-side cost on one GPU: cutting every engine rank's region out of a
converted GLM-5 layer (``ShardPack.pack_into`` plus the region checksums), against converting
the layer and against a device-to-device copy of the layer buffer; and the wire bytes per engine
rank against the full broadcast, for the whole model.

    python3 bench/scripts/scatter.py [--tp 8] [--ep] [--dp 1]

One GLM-5 sparse layer from bf16 (inputs Gaussian x 0.02). Times are the median of 5 runs.
"""

from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

from glm_fp8.bench import wall_seconds
from glm_fp8.convert import convert_layer
from glm_fp8.engine import EngineLayout
from glm_fp8.engine.pack import layer_scatter, update_bytes
from glm_fp8.models import PRESETS
from glm_fp8.plan import plan_from_config
from glm_fp8.transfer.scatter import pack_regions
from glm_fp8.transfer.wire import checksum_scratch


def _median_s(fn, runs: int = 5) -> float:
    fn()  # warm-up
    return wall_seconds(fn, runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--ep", action="store_true")
    args = p.parse_args()
    config = PRESETS["glm-5"]
    layouts = EngineLayout.all_ranks(args.tp, args.dp, args.ep)
    idx = config["first_k_dense_replace"]
    plan = plan_from_config(config, idx)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = {
        k: torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        for k, (shape, _) in plan.inputs.items()
    }
    buf = torch.empty(plan.nbytes, dtype=torch.uint8, device="cuda")
    layer_sc = layer_scatter(plan, idx, config, layouts)
    regions_nbytes = layer_sc.nbytes  # the regions side by side, each 256-aligned
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    packed = torch.empty(regions_nbytes, dtype=torch.uint8, device="cuda")
    scratch = checksum_scratch(max(pk.nbytes for pk in layer_sc.packs), buf.device)

    def convert():
        convert_layer(layer, idx, out=buf, plan=plan)

    def pack():
        full = {f"model.layers.{idx}.{name}": view for name, view in plan.views(buf)}
        pack_regions(layer_sc.packs, layer_sc.offsets, full, packed, scratch)

    convert()
    t_convert = _median_s(convert)
    t_pack = _median_s(pack)
    peak = torch.cuda.max_memory_allocated() - base
    half = plan.nbytes // 2
    t_copy = _median_s(lambda: buf[half : 2 * half].copy_(buf[:half])) * 2  # the whole buffer's bytes
    gib = 2**30
    print(f"GLM-5 sparse layer {idx}: {plan.nbytes / gib:.2f} GiB kernel format; {len(layouts)} engine "
          f"ranks, {len(layer_sc.classes)} classes, regions {regions_nbytes / gib:.2f} GiB")  # fmt: skip
    print(tabulate([
        ["convert (bf16 -> layer buffer)", f"{t_convert * 1e3:.2f}", ""],
        ["pack every region + checksums", f"{t_pack * 1e3:.2f}", f"{t_pack / t_convert:.3f} x convert"],
        ["device copy of the layer buffer", f"{t_copy * 1e3:.2f}", f"pack / copy {t_pack / t_copy:.2f}"],
    ], ["step", "ms", ""]))  # fmt: skip
    extra = max(0, peak - regions_nbytes) / 2**20
    print(f"pack: peak transient above the region ring and inputs: {extra:.1f} MiB")
    full, per_rank = update_bytes(config, layouts)
    lo, hi = min(per_rank) / gib, max(per_rank) / gib
    print(f"whole model: full broadcast {full / gib:.2f} GiB per engine rank; scatter {lo:.2f}..{hi:.2f} GiB "
          f"({max(per_rank) / full:.3f} of it)")  # fmt: skip


if __name__ == "__main__":
    main()
