"""Sender memory and time per DTensor gather strategy (the sender's memory bound: a ring of layer buffers).

    python3 bench/scripts/gather.py [--world 1] [--model glm-5|small] [--layers 2]

``--world`` processes (one per GPU with NCCL; gloo on the CPU) hold a GLM-5 sparse layer as
bf16 DTensors sharded on dim 0 (expert parallel / FSDP2). Rank 0 runs ``Sender`` into a
stand-in link (``HostSinkComm``), the others ``contribute_shards``. The sender's peak is
measured above what it held before (its shards), ring slots included: the figure the targets
name. With one GPU the world is 1: every gather is then local, but what the sender allocates
(ring, chunk buffers, the non-expert tensors gathered whole) does not depend on the world size.
"""

from __future__ import annotations

import argparse
import time

import torch
from tabulate import tabulate

from glm_fp8.model.plans import plan_from_config
from glm_fp8.model.presets import PRESETS, SMALL_GLM5
from glm_fp8.testing import launch

STRATEGIES = [("full", 2), ("full", 1), ("chunked", 1), ("quantize_then_gather", 1)]


def _sharded_layer(plan, mesh, rank: int, world: int, device: torch.device) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    gen = torch.Generator(device).manual_seed(1234 + rank)
    layer = {}
    for k, (shape, _) in plan.inputs.items():
        size = -(-shape[0] // world)  # torch.chunk's pieces: ceil-sized, trailing ranks may hold less
        rows = max(0, min(shape[0], (rank + 1) * size) - rank * size)
        # Gaussian weights at a realistic scale (never zeros).
        local = torch.randn((rows, *shape[1:]), device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        full = torch.empty(shape, device="meta")
        layer[k] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
    return layer


def gather_rank(rank: int, world: int, config: dict, layers: int, strategy: str, ring: int) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh

    from glm_fp8.transfer import HostSinkComm, Sender, contribute_shards

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    plan = plan_from_config(config, 0)
    layer = _sharded_layer(plan, mesh, rank, world, device)
    stream = ((i, layer) for i in range(layers))
    kw = dict(config=config, gather=strategy, chunk_experts=8, device=device)
    if rank != 0:
        contribute_shards(stream, **kw)
        return None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    sender = Sender(HostSinkComm(), 0, ring=ring, **kw)
    sender.send_model(stream)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    return dict(seconds=seconds, peak=peak, ring_bytes=ring * plan.nbytes, layer_bytes=plan.nbytes)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--model", choices=["glm-5", "small"], default="glm-5")
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    base = PRESETS["glm-5"] if args.model == "glm-5" else SMALL_GLM5
    config = {**base, "num_hidden_layers": args.layers, "first_k_dense_replace": 0}
    nccl = torch.cuda.device_count() >= args.world
    rows = []
    for strategy, ring in STRATEGIES:
        res = launch(
            args.world,
            gather_rank,
            (config, args.layers, strategy, ring),
            backend="nccl" if nccl else "gloo",
            timeout_s=600,
        )
        status, out = res[0]
        if status != "ok":
            raise SystemExit(f"{strategy} ring {ring}: rank 0 {status}: {out}")
        gib = 2**30
        peak, ring_b = out["peak"] / gib, out["ring_bytes"] / gib
        rows.append(
            [
                strategy,
                ring,
                f"{out['seconds'] / args.layers:.3f}",
                f"{ring_b:.2f}",
                f"{peak:.2f}",
                f"{peak - ring_b:.2f}",
            ]
        )
    link = "nccl" if nccl else "gloo"
    print(
        f"{args.model} sparse layer of {out['layer_bytes'] / 2**30:.2f} GiB (fp8 kernel format), "
        f"bf16 DTensor shards, world {args.world} ({link}), {args.layers} layers"
    )
    print(tabulate(rows, ["gather", "ring", "s / layer", "ring GiB", "sender peak GiB", "peak - ring GiB"]))


if __name__ == "__main__":
    main()
