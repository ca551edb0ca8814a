"""Sharded trainer layers (DTensors on a CPU mesh over gloo): every gather strategy delivers
the same bytes as the reference to the receiver. Everything runs on the CPU, also on a GPU
machine (bench/scripts/gather.py runs the strategies on a GPU).

Ranks 0..T-1 are trainers holding DTensor shards (rank 0 also sends); the last rank receives.
"""

import pytest
import torch

from glm_fp8.model.presets import SMALL_GLM5
from glm_fp8.testing import launch, synthetic_layer

CONFIG = {**SMALL_GLM5, "num_hidden_layers": 3}  # one dense layer, two sparse; 11 experts


def _sharded(config, layer_idx, mesh, expert_dim, dtype):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    for k, t in synthetic_layer(config, layer_idx, dtype).items():
        if ".mlp.experts." in k:
            placement = Shard(expert_dim)
        elif t.dim() >= 2:
            placement = Shard(0)  # FSDP2 shards every weight on dim 0
        else:
            placement = Replicate()
        out[k] = distribute_tensor(t, mesh, [placement])
    return out


def _rank(rank, world, gather, expert_dim, dtype=torch.bfloat16):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from glm_fp8.kernels.reference import convert_layer_ref
    from glm_fp8.model.plans import plan_from_config
    from glm_fp8.transfer import Receiver, Sender, contribute_shards

    trainers = world - 1
    mesh = DeviceMesh("cpu", torch.arange(trainers))  # every rank creates the groups
    link = dist.new_group([0, world - 1])  # trainer rank 0 -> the inference rank
    layers = lambda: ((i, _sharded(CONFIG, i, mesh, expert_dim, dtype)) for i in range(3))  # noqa: E731
    if rank == 0:
        sender = Sender(link, 0, config=CONFIG, gather=gather, chunk_experts=4, device="cpu")
        sender.send_model(layers())
        return None
    if rank < trainers:
        contribute_shards(layers(), config=CONFIG, sender=0, gather=gather, chunk_experts=4, device="cpu")
        return None
    mismatched = checked = 0
    for pos, views in Receiver(link, 0, config=CONFIG, device="cpu").receive_layers():
        # The trainer's own tensors, nothing cast: fp32 masters travel and are quantized in fp32.
        held = synthetic_layer(CONFIG, pos, dtype)
        layer = {k.removeprefix(f"model.layers.{pos}."): t for k, t in held.items()}
        want = convert_layer_ref(layer, pos, plan_from_config(CONFIG, pos))
        for name, view in views:
            got, ref = view.contiguous().view(torch.uint8), want[name].contiguous().view(torch.uint8)
            checked += got.numel()
            mismatched += int((got != ref).sum())
    return checked, mismatched


@pytest.mark.parametrize(
    "world, gather, expert_dim, dtype",
    [
        (3, "full", 0, torch.bfloat16),
        # fp32 masters: every tensor gathered (full_tensor() and fp32 chunk buffers) and quantized
        # as held, nothing cast
        (3, "chunked", 0, torch.float32),
        (3, "quantize_then_gather", 0, torch.bfloat16),
        (4, "auto", 0, torch.bfloat16),  # picks quantize_then_gather: 11 experts over 3 ranks, 4 + 4 + 3
        (4, "chunked", 1, torch.bfloat16),  # experts split along I (tensor-parallel style)
        (3, "auto", 2, torch.bfloat16),  # picks chunked
    ],
    ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None,
)
def test_gather_strategies_deliver_reference_bytes(world, gather, expert_dim, dtype):
    results = launch(world, _rank, (gather, expert_dim, dtype), timeout_s=120)
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    checked, mismatched = results[world - 1][1]
    assert checked > 0 and mismatched == 0


def test_quantize_then_gather_needs_whole_experts():
    results = launch(3, _rank, ("quantize_then_gather", 1), timeout_s=60)
    assert results[0][0] == "ValueError" and "whole experts" in results[0][1]
