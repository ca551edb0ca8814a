"""Sharded engines: each receiver lands exactly its shard of every decoder layer under vLLM's
names, and every byte equals the reference conversion cut by the layout rule.

Invariant: for a receiver at ``EngineLayout`` L, after ``load_into(params)``, each parameter
``params[n]`` equals ``take_shard(reference entry, shard of n at L)`` bit for bit, in vLLM's
dtype; a misnamed parameter is refused before anything is written, on every rank. One sender
and 2 or 4 engine ranks over gloo, on the CPU (a tiny GLM-5: two dense and two sparse layers,
every sharded width a multiple of 128).
"""

import pytest
import torch

from glm_fp8.models import TINY_GLM5
from glm_fp8.testing import launch, synthetic_layer

FILL = 0x5A  # every parameter starts as this byte: an unwritten one shows


def _layouts(case: str, world: int):
    from glm_fp8.engine import EngineLayout

    n = world - 1
    if case == "tp2":
        return [EngineLayout(tp_size=2, tp_rank=r) for r in range(n)]
    if case == "ep2":
        return [EngineLayout(dp_size=2, dp_rank=r, ep_size=2, ep_rank=r) for r in range(n)]
    return [EngineLayout(tp_size=2, tp_rank=r % 2, dp_size=2, dp_rank=r // 2) for r in range(n)]  # tp2 x dp2


def _decoder_params(layout, misname: bool = False) -> dict[str, torch.Tensor]:
    """The engine parameters of the decoder layers at ``layout`` (vLLM names), poisoned."""
    from glm_fp8.engine import engine_params

    params = {}
    for name, p in engine_params(TINY_GLM5, layout).items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) < TINY_GLM5["num_hidden_layers"]:
            params[name] = torch.empty(p.shape, dtype=p.dtype)
            params[name].view(torch.uint8).fill_(FILL)
    if misname:
        name = "model.layers.2.mlp.experts.routed_experts.w13_weight"
        params[name.replace("routed_experts.", "")] = params.pop(name)  # the flat name vLLM does not use
    return params


def _rank(rank, world, case, misname):
    from glm_fp8.engine import engine_params, take_shard
    from glm_fp8.plan import plan_from_config, strip_layer
    from glm_fp8.reference import convert_layer_ref
    from glm_fp8.transfer import Broadcaster, Receiver

    layers = TINY_GLM5["num_hidden_layers"]
    if rank == 0:
        Broadcaster(None, 0, config=TINY_GLM5, device="cpu").broadcast_model(
            (i, synthetic_layer(TINY_GLM5, i)) for i in range(layers)
        )
        return None
    layout = _layouts(case, world)[rank - 1]
    params = _decoder_params(layout, misname=misname and rank == 1)
    try:
        Receiver(None, 0, config=TINY_GLM5, layout=layout, device="cpu").load_into(params)
    except BaseException:
        assert all(bool((p.view(torch.uint8) == FILL).all()) for p in params.values())  # nothing written
        raise
    targets = {p.kernel_name: p for p in engine_params(TINY_GLM5, layout).values()}
    checked = 0
    for i in range(layers):
        layer = strip_layer(synthetic_layer(TINY_GLM5, i), i)
        ref = convert_layer_ref(layer, i, plan_from_config(TINY_GLM5, i))
        for kernel_name, full in ref.items():
            t = targets[kernel_name]
            want = take_shard(full, t.shard).to(t.dtype)
            got = params[t.name]
            assert got.shape == want.shape and got.dtype == want.dtype, t.name
            as_bytes = (lambda x: x.contiguous().view(torch.uint8))  # noqa: E731
            assert torch.equal(as_bytes(got), as_bytes(want)), f"{t.name}: bytes differ"
            checked += got.numel()
    return checked


@pytest.mark.parametrize("case, world", [("tp2", 3), ("ep2", 3), ("tp2xdp2", 5)])
def test_every_rank_lands_exactly_its_shard(case, world):
    results = launch(world, _rank, (case, False), timeout_s=120)
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    assert all(results[r][1] > 0 for r in range(1, world))


def test_a_misnamed_parameter_is_refused_on_every_rank_before_anything_is_written():
    results = launch(3, _rank, ("tp2", True), timeout_s=60)
    assert results[0][0] == "ManifestMismatch" and "rank 1 refused its parameters" in results[0][1]
    assert results[1][0] == "KeyError" and "routed_experts.w13_weight" in results[1][1]
    assert results[2][0] == "UpdateAborted" and "rank 1 refused its parameters" in results[2][1]


def test_a_layout_needs_the_config_and_fp8():
    from glm_fp8.engine import EngineLayout
    from glm_fp8.transfer import Receiver

    with pytest.raises(ValueError, match="layout: a sharded engine receives mode='fp8' only"):
        Receiver(None, 0, config=TINY_GLM5, layout=EngineLayout(), mode="bf16", device="cpu")
    with pytest.raises(TypeError, match="layout: expected an EngineLayout"):
        Receiver(None, 0, config=TINY_GLM5, layout=(2, 0), device="cpu")
