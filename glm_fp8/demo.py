"""``glm-fp8 demo``: one sender and several receivers as local processes broadcast a synthetic,
scaled-down GLM-5 model; every received byte is checked against the reference.

gloo on the CPU (the kernels then run in Triton's interpreter), NCCL when there are two GPUs
or more (one process per GPU). ``launch`` is also what the multi-process tests use.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch

from glm_fp8.bench import SMALL_GLM5


def synthetic_layer(config: Mapping, layer_idx: int, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Deterministic trainer tensors of one layer (prefixed names), the same in every process."""
    from glm_fp8.plan import plan_from_config

    gen = torch.Generator().manual_seed(1000 + layer_idx)
    plan = plan_from_config(config, layer_idx, dtype=dtype)
    prefix = f"model.layers.{layer_idx}."
    return {
        prefix + k: (torch.randn(shape, generator=gen) * 0.02).to(dtype)
        for k, (shape, _) in plan.inputs.items()
    }


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


def demo_rank(rank: int, world: int, config: Mapping, layers: int, ring: int, mode: str) -> dict:
    """Rank 0 broadcasts ``layers`` synthetic layers; the others receive and verify them."""
    from glm_fp8.broadcast import Broadcaster, Receiver
    from glm_fp8.plan import plan_from_config
    from glm_fp8.reference import convert_layer_ref

    config = {**config, "num_hidden_layers": layers}
    # On a GPU machine every rank uses a GPU (gloo carries CUDA tensors too), else the CPU.
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", rank % gpus) if gpus else torch.device("cpu")
    if rank == 0:
        from tqdm import tqdm

        sender = Broadcaster(None, 0, config=config, ring=ring, mode=mode, device=device)
        stream = ((i, synthetic_layer(config, i)) for i in range(layers))
        stats = sender.broadcast_model(tqdm(stream, total=layers, desc="sender", unit="layer"))
        return {"layers": [(s.layer, s.nbytes, s.seconds) for s in stats.layers], "seconds": stats.seconds,
                "peak_bytes": stats.peak_bytes}  # fmt: skip
    receiver = Receiver(None, 0, config=config, ring=ring, mode=mode, device=device)
    mismatched = 0
    checked = 0
    for pos, views in receiver.receive_layers():
        layer = {k.removeprefix(f"model.layers.{pos}."): t for k, t in synthetic_layer(config, pos).items()}
        want = convert_layer_ref(layer, pos, plan_from_config(config, pos, quantize=mode == "fp8"))
        for name, view in views:
            got = view.cpu().contiguous().view(torch.uint8)
            ref = want[name].contiguous().view(torch.uint8)
            checked += got.numel()
            mismatched += int((got != ref).sum())
    return {"bytes_checked": checked, "bytes_mismatched": mismatched}


def run_demo(world: int | None = None, layers: int = 4, ring: int = 2, mode: str = "fp8") -> int:
    """The README's main command: prints a per-layer table; exit code 0 iff every byte matched."""
    from tabulate import tabulate

    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    world = world or (min(gpus, 4) if backend == "nccl" else 3)
    if backend == "gloo":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # inherited by the spawned ranks
    print(f"glm-fp8 demo: {world} processes over {backend} (rank 0 sends), {layers} layers of a "
          f"GLM-5 scaled down 24x, mode {mode}, ring {ring}")  # fmt: skip
    results = launch(world, demo_rank, (SMALL_GLM5, layers, ring, mode), backend=backend, timeout_s=300)
    failed = {r: v for r, v in results.items() if v[0] != "ok"}
    for r, (status, detail) in sorted(failed.items()):
        print(f"rank {r}: {status}: {detail}")
    if failed:
        return 1
    sent = results[0][1]
    rows = [
        [layer, f"{nbytes / 2**20:.2f}", f"{seconds * 1e3:.1f}"] for layer, nbytes, seconds in sent["layers"]
    ]
    print(tabulate(rows, ["layer", "MiB", "convert + send ms"]))
    peak = "n/a (CPU)" if sent["peak_bytes"] is None else f"{sent['peak_bytes'] / 2**20:.1f} MiB"
    print(f"total {sent['seconds'] * 1e3:.0f} ms; sender peak transient memory {peak}")
    bad = 0
    for r in range(1, world):
        res = results[r][1]
        bad += res["bytes_mismatched"]
        print(f"receiver {r}: {res['bytes_checked']} bytes checked against the reference, "
              f"{res['bytes_mismatched']} differ")  # fmt: skip
    return 0 if bad == 0 else 1
