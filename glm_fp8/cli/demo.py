"""``glm-fp8 demo``: one sender and several receivers as local processes broadcast a synthetic,
scaled-down GLM-5 model; every received byte is checked against the reference.

gloo on the CPU (the kernels then run in Triton's interpreter), NCCL when there are two GPUs
or more (one process per GPU), started by ``glm_fp8.testing.launch`` as in the tests.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from glm_fp8.kernels.reference import convert_layer_ref
from glm_fp8.model.plans import plan_from_config
from glm_fp8.model.presets import SMALL_GLM5
from glm_fp8.model.trainer_layouts import strip_layer
from glm_fp8.testing import launch, synthetic_layer
from glm_fp8.transfer.receiver import Receiver
from glm_fp8.transfer.sender import Sender


def demo_rank(rank: int, world: int, config: Mapping, layers: int, ring: int, wire: str) -> dict:
    """Rank 0 broadcasts ``layers`` synthetic layers; the others receive and verify them."""
    config = {**config, "num_hidden_layers": layers}
    # On a GPU machine every rank uses a GPU (gloo carries CUDA tensors too), else the CPU.
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", rank % gpus) if gpus else torch.device("cpu")
    if rank == 0:
        from tqdm import tqdm

        sender = Sender(None, 0, config=config, ring=ring, wire=wire, device=device)
        stream = ((i, synthetic_layer(config, i)) for i in range(layers))
        stats = sender.send_model(tqdm(stream, total=layers, desc="sender", unit="layer"))
        return {
            "layers": [(s.layer, s.nbytes, s.seconds) for s in stats.layers],
            "seconds": stats.seconds,
            "peak_bytes": stats.peak_bytes,
        }
    # A receiver keeps at least 2 buffers: a layer waits for its vote while the next one arrives.
    receiver = Receiver(None, 0, config=config, ring=max(ring, 2), wire=wire, device=device)
    mismatched = 0
    checked = 0
    for pos, views in receiver.receive_layers():
        layer = strip_layer(synthetic_layer(config, pos), pos)
        want = convert_layer_ref(layer, pos, plan_from_config(config, pos, quantize=wire == "fp8"))
        for name, view in views:
            got = view.cpu().contiguous().view(torch.uint8)
            ref = want[name].contiguous().view(torch.uint8)
            checked += got.numel()
            mismatched += int((got != ref).sum())
    return {"bytes_checked": checked, "bytes_mismatched": mismatched}


def run_demo(world: int | None = None, layers: int = 4, ring: int = 2, wire: str = "fp8") -> int:
    """The README's main command: prints a per-layer table; exit code 0 iff every byte matched."""
    from tabulate import tabulate

    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    world = world or (min(gpus, 4) if backend == "nccl" else 3)
    if backend == "gloo":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # inherited by the spawned ranks
    print(
        f"glm-fp8 demo: {world} processes over {backend} (rank 0 sends), {layers} layers of a "
        f"GLM-5 scaled down 24x, wire {wire}, ring {ring}"
    )
    results = launch(world, demo_rank, (SMALL_GLM5, layers, ring, wire), backend=backend, timeout_s=300)
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
        print(
            f"receiver {r}: {res['bytes_checked']} bytes checked against the reference, "
            f"{res['bytes_mismatched']} differ"
        )
    return 0 if bad == 0 else 1
