"""Pipelined broadcast on one GPU through a stand-in link (device-to-host copies into pinned
memory on the communication stream): total time against the sum and the maximum of
conversion alone and communication alone, and the sender's memory.

    python3 bench/scripts/broadcast.py [--layers 8]

GLM-5-shaped sparse layers from bf16; one layer's inputs are reused for every layer (the
conversion still runs per layer), so 8 layers fit beside the ring.
"""

from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

from glm_fp8.bench import wall_seconds
from glm_fp8.convert import convert_layer
from glm_fp8.models import PRESETS
from glm_fp8.plan import plan_from_config
from glm_fp8.transfer import Broadcaster, HostSinkComm
from glm_fp8.transfer.wire import checksum_scratch, layer_checksum


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    n = args.layers
    config = {**PRESETS["glm-5"], "num_hidden_layers": n, "first_k_dense_replace": 0}
    plan = plan_from_config(config, 0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = {
        f"model.layers.0.{k}": torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        for k, (shape, _) in plan.inputs.items()
    }
    stream = lambda: (
        (i, {k.replace("layers.0.", f"layers.{i}."): t for k, t in layer.items()}) for i in range(n)
    )  # noqa: E731
    sink = HostSinkComm()
    buf = torch.empty(plan.nbytes, dtype=torch.uint8, device="cuda")
    convert_layer(layer, 0, out=buf, plan=plan)  # compile, and size the pinned buffer below
    sink.broadcast(buf, 0)
    t_convert = wall_seconds(lambda: [convert_layer(layer, 0, out=buf, plan=plan) for _ in range(n)])
    t_comm = wall_seconds(lambda: [sink.broadcast(buf, 0) for _ in range(n)])
    scratch = checksum_scratch(plan.nbytes, buf.device)
    layer_checksum(buf, scratch)
    t_sum = wall_seconds(lambda: [layer_checksum(buf, scratch) for _ in range(n)])
    t_copy = wall_seconds(lambda: [buf[: plan.nbytes // 2].copy_(buf[plan.nbytes // 2 :]) for _ in range(n)])
    buf = None  # noqa: F841 - free it before the ring is allocated
    rows = []
    for ring, checksum in ((2, True), (2, False), (1, True)):
        torch.cuda.empty_cache()
        sender = Broadcaster(sink, 0, config=config, ring=ring, checksum=checksum, device="cuda")
        sender.broadcast_model(stream())  # warm-up
        stats = sender.broadcast_model(stream())
        total = stats.seconds
        ring_bytes = ring * plan.nbytes
        rows.append([ring, "on" if checksum else "off", f"{total:.3f}", f"{t_convert:.3f}", f"{t_comm:.3f}",
                     f"{t_convert + t_comm:.3f}", f"{total / max(t_convert, t_comm):.3f}",
                     f"{ring_bytes / 2**30:.2f}", f"{stats.peak_bytes / 2**20:.1f}"])  # fmt: skip
        del sender
    gbps = n * plan.nbytes / t_comm / 1e9
    size = plan.nbytes / 2**30
    print(f"{n} GLM-5 sparse layers of {size:.2f} GiB; stand-in link {gbps:.1f} GB/s (D2H pinned)")
    per_layer = t_sum / n
    print(f"layer checksum alone: {per_layer * 1e3:.2f} ms per layer, reading "
          f"{plan.nbytes / per_layer / 1e9:.0f} GB/s (a device copy of the same bytes: "
          f"{plan.nbytes / (t_copy / n) / 1e9:.0f} GB/s read+write); {t_sum / t_comm * 100:.2f} % of the "
          f"layer's link time, {t_sum / t_convert * 100:.1f} % of its conversion")  # fmt: skip
    print(tabulate(rows, ["ring", "checksum", "total s", "convert s", "comm s", "sum s", "total / max",
                          "ring GiB", "peak above ring+inputs MiB"]))  # fmt: skip


if __name__ == "__main__":
    main()
