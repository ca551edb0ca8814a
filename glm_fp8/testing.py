"""What tests, the demo and the benchmarks share: a multi-process launcher (gloo or NCCL, one
process per rank, bounded in time), deterministic synthetic trainer layers (plain or as
FSDP2-style DTensors) and the reference of what an engine rank must hold after an update. The
small model configs live in ``glm_fp8.models`` (``SMALL_GLM5``, ``SMALL_CONFIGS``)."""

from __future__ import annotations

import socket
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch

from glm_fp8.engine.layout import EngineLayout, take_shard
from glm_fp8.engine.specs import engine_params
from glm_fp8.plan import layer_prefix, plan_from_config, strip_layer
from glm_fp8.reference import convert_layer_ref


def synthetic_layer(config: Mapping, layer_idx: int, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Deterministic trainer tensors of one layer (prefixed names), the same in every process."""
    gen = torch.Generator().manual_seed(1000 + layer_idx)
    plan = plan_from_config(config, layer_idx, dtype=dtype)
    prefix = layer_prefix(layer_idx)
    return {
        prefix + k: (torch.randn(shape, generator=gen) * 0.02).to(dtype)
        for k, (shape, _) in plan.inputs.items()
    }


def sharded_layer(config: Mapping, layer_idx: int, mesh, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """``synthetic_layer`` as FSDP2 holds it on a 1-D ``mesh``: every tensor of two or more dims
    ``Shard(0)`` (an expert stack so holds whole experts), 1-D tensors replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {k: distribute_tensor(t, mesh, [Shard(0) if t.dim() >= 2 else Replicate()])
            for k, t in synthetic_layer(config, layer_idx, dtype).items()}  # fmt: skip


def reference_engine_params(
    config: Mapping, layout: EngineLayout, layer_ids, *, scale_fmt: str | None = None, dtype=torch.bfloat16
) -> dict[str, torch.Tensor]:
    """What an engine rank at ``layout`` must hold after an update of ``layer_ids`` (``REST``
    included when listed) from ``synthetic_layer`` tensors of ``dtype``: the reference
    conversion (``glm_fp8.reference``, from the tensors cast to bf16) cut by the rank's shard,
    in vLLM's dtype, by vLLM's name."""
    targets = {p.kernel_name: p for p in engine_params(config, layout).values()}
    out = {}
    for i in layer_ids:
        layer = strip_layer(synthetic_layer(config, i, dtype), i)
        layer = {k: t.to(torch.bfloat16) for k, t in layer.items()}
        plan = plan_from_config(config, i, scale_fmt=scale_fmt)
        for kernel_name, full in convert_layer_ref(layer, i, plan).items():
            t = targets[kernel_name]
            out[t.name] = take_shard(full, t.shard).to(t.dtype)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, timeout_s, fn, args, queue):
    import torch.distributed as dist

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        queue.put((rank, type(exc).__name__, f"{exc}\n{traceback.format_exc(limit=3)}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a dead peer can make this fail too
                pass


def launch(
    world: int, fn: Callable, args: tuple = (), *, backend: str = "gloo", timeout_s: float = 30.0
) -> dict[int, tuple[str, object]]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; ``{rank: (status, result)}``.

    status is "ok" or the exception's class name. A rank that reports nothing within
    ``timeout_s`` plus a margin is killed and reported as "killed": nothing waits forever.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, backend, timeout_s, fn, args, queue), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout_s + 60
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, status, result = queue.get(timeout=1.0)
            results[rank] = (status, result)
        except Exception:  # noqa: BLE001 - queue.Empty: check for dead processes
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
            if dead and all(not p.is_alive() for p in procs):
                break
    for r, p in enumerate(procs):
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
        results.setdefault(r, ("killed" if p.exitcode is None else f"exit {p.exitcode}", None))
    return results
