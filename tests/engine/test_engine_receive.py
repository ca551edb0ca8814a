"""Sharded engines and the whole model: each receiver lands exactly its shard of every tensor of
the update (embeddings, decoder layers, final norm, lm_head, the MTP layer) under vLLM's names.

Invariant: for a receiver at ``EngineLayout`` L, after ``load_into(params)`` with ``params`` as
``engine_params(config, L)`` lists them, each ``params[n]`` equals ``take_shard(reference entry,
shard of n at L)`` bit for bit, in vLLM's dtype; padded vocabulary rows are zero. A misnamed
parameter, parameters of another layout or a layout vLLM refuses are refused before anything
is written, on every rank. One sender and 2 or 4 engine ranks over gloo, on the CPU (a tiny
GLM-5: two dense and two sparse layers, an MTP layer, vocab 1000, padded to 1024).
"""

import pytest
import torch

from glm_fp8.model.families import REST, model_layer_ids
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.testing import launch, synthetic_layer

FILL = 0x5A  # every parameter starts as this byte: an unwritten one shows
WHOLE = model_layer_ids(TINY_GLM5)  # layers 0-3, then the MTP layer 4


def _layouts(case: str, world: int):
    from glm_fp8.engine import EngineLayout

    n = world - 1
    if case == "tp2":
        return [EngineLayout(tp_size=2, tp_rank=r) for r in range(n)]
    if case == "ep2":
        return [EngineLayout(dp_size=2, dp_rank=r, ep_size=2, ep_rank=r) for r in range(n)]
    if case == "tp4":  # o_proj's 256 columns over 4 ranks: 64 each, which vLLM refuses
        return [EngineLayout(tp_size=4, tp_rank=r) for r in range(n)]
    return [EngineLayout(tp_size=2, tp_rank=r % 2, dp_size=2, dp_rank=r // 2) for r in range(n)]  # tp2 x dp2


def _params(layout, fault: str | None = None) -> dict[str, torch.Tensor]:
    """Every engine parameter at ``layout`` (vLLM names), poisoned; ``fault`` breaks one."""
    from glm_fp8.engine import EngineLayout, engine_params

    specs = engine_params(TINY_GLM5, EngineLayout() if fault == "other_layout" else layout)
    params = {}
    for name, p in specs.items():
        params[name] = torch.empty(p.shape, dtype=p.dtype)
        params[name].view(torch.uint8).fill_(FILL)
    if fault == "misname":
        name = "model.layers.2.mlp.experts.routed_experts.w13_weight"
        params[name.replace("routed_experts.", "")] = params.pop(name)  # the flat name vLLM does not use
    return params


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def _rank(rank, world, case, fault, scale_fmt, scatter=False):
    from glm_fp8.engine import EngineLayout, engine_params, take_shard
    from glm_fp8.kernels.reference import convert_layer_ref
    from glm_fp8.model.plans import plan_from_config
    from glm_fp8.model.trainer_layouts import strip_layer
    from glm_fp8.transfer import Receiver, Sender

    kw = dict(config=TINY_GLM5, layer_ids=WHOLE, rest=True, scale_fmt=scale_fmt, device="cpu")
    if scatter:
        kw["engines"] = [None, *_layouts(case, world)]
    if rank == 0:
        sender = Sender(None, 0, **kw)
        stats = sender.send_model(
            ((i, synthetic_layer(TINY_GLM5, i)) for i in WHOLE), rest=synthetic_layer(TINY_GLM5, REST)
        )
        return (stats.nbytes, sender.routes.received_bytes()) if scatter else stats.nbytes
    layout = _layouts(case, world)[rank - 1]
    params = _params(EngineLayout() if case == "tp4" else layout, fault if rank == 1 else None)
    try:
        receiver = Receiver(None, 0, layout=layout, **kw)
        if scatter:  # its ring holds its own largest share of a layer (its classes' packs), not a layer
            mine = [lay.rank_nbytes(rank) for lay in receiver.routes.layers]
            assert receiver.ring.nbytes == max(mine) < max(p.nbytes for p in receiver.plans)
        receiver.load_into(params)
    except BaseException:
        assert all(bool((_as_bytes(p) == FILL).all()) for p in params.values())  # nothing written
        raise
    targets = {p.kernel_name: p for p in engine_params(TINY_GLM5, layout).values()}
    assert len(targets) == len(params)
    checked, padded = set(), 0
    for i in [*WHOLE, REST]:
        layer = strip_layer(synthetic_layer(TINY_GLM5, i), i)
        plan = plan_from_config(TINY_GLM5, i, scale_fmt=scale_fmt)
        for kernel_name, full in convert_layer_ref(layer, i, plan).items():
            t = targets[kernel_name]
            want = take_shard(full, t.shard).to(t.dtype)
            got = params[t.name]
            assert got.shape == want.shape and got.dtype == want.dtype, t.name
            assert torch.equal(_as_bytes(got), _as_bytes(want)), f"{t.name}: bytes differ"
            if t.shard.kind == "vocab" and t.shard.pad:
                assert not _as_bytes(got[-t.shard.pad :]).any(), f"{t.name}: padded rows not zero"
                padded += t.shard.pad
            checked.add(t.name)
    assert checked == set(params), set(params) - checked  # every parameter is part of the update
    return padded


@pytest.mark.parametrize("case, world", [("tp2", 3), ("ep2", 3), ("tp2xdp2", 5)])
def test_every_rank_lands_exactly_its_shard_of_the_whole_model(case, world):
    results = launch(world, _rank, (case, None, None), timeout_s=120)
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    # vocab 1000 padded to 1024: at TP=2 the second rank's half holds 24 zero rows of
    # embed_tokens, lm_head and the MTP head; EP=2 (attention TP 1) holds all 1024 rows.
    pads = {r: results[r][1] for r in range(1, world)}
    assert all(p == 3 * 24 for p in pads.values()) if case == "ep2" else sorted(set(pads.values())) == [0, 72]


def test_power_of_two_scales_land_as_sent():
    """scale_fmt='ue8m0' (DeepGEMM's power-of-two scales) end to end, against the ue8m0 reference."""
    results = launch(3, _rank, ("tp2", None, "ue8m0"), timeout_s=120)
    assert all(v[0] == "ok" for v in results.values()), results


@pytest.mark.parametrize(
    "fault, match",
    [
        ("misname", "KeyError: .*routed_experts.w13_weight"),
        (
            "other_layout",
            r"ValueError: params\['model.layers.0.self_attn.q_b_proj.weight'\]: "
            r"expected .* \(256, 256\), got .* \(512, 256\)",
        ),
    ],
)
def test_bad_params_are_refused_on_every_rank_before_anything_is_written(fault, match):
    import re

    results = launch(3, _rank, ("tp2", fault, None), timeout_s=60)
    assert results[0][0] == "ManifestMismatch" and "rank 1 refused its parameters" in results[0][1]
    assert re.search(match, f"{results[1][0]}: {results[1][1]}"), results[1]
    assert results[2][0] == "UpdateAborted" and "rank 1 refused its parameters" in results[2][1]


def test_a_layout_vllm_refuses_stops_every_rank_at_the_first_vote():
    results = launch(3, _rank, ("tp4", None, None), timeout_s=60)
    assert results[0][0] == "ManifestMismatch" and "refused its parameters" in results[0][1]
    for r in (1, 2):
        assert results[r][0] in ("ValueError", "UpdateAborted"), results[r]
    assert any(results[r][0] == "ValueError" and "o_proj" in results[r][1] for r in (1, 2)), results


def test_rest_must_be_given_when_announced_and_announced_when_given():
    for flag, give, why in [(True, False, "none were given"), (False, True, "built without rest=True")]:
        results = launch(2, _send_rest_case, (flag, give), timeout_s=60)
        assert results[0][0] == "LayerOrderError" and why in results[0][1], results
        assert results[1][0] == "UpdateAborted" and "rank 0 (a sender) failed" in results[1][1]


def _send_rest_case(rank, world, flag, give):
    from glm_fp8.transfer import Receiver, Sender

    kw = dict(config=TINY_GLM5, rest=flag, device="cpu")
    if rank == 0:
        layers = ((i, synthetic_layer(TINY_GLM5, i)) for i in range(4))
        rest = synthetic_layer(TINY_GLM5, REST) if give else None
        return Sender(None, 0, **kw).send_model(layers, rest=rest)
    return len(list(Receiver(None, 0, **kw).receive()))


def test_a_layout_needs_the_config_and_fp8():
    from glm_fp8.engine import EngineLayout
    from glm_fp8.transfer import Receiver

    with pytest.raises(ValueError, match="layout: a sharded engine needs config= .* and wire='fp8'"):
        Receiver(None, 0, config=TINY_GLM5, layout=EngineLayout(), wire="bf16", device="cpu")
    with pytest.raises(TypeError, match="layout: expected an EngineLayout"):
        Receiver(None, 0, config=TINY_GLM5, layout=(2, 0), device="cpu")
    with pytest.raises(ValueError, match="layer_ids: layer 5 is not a layer of the model"):
        Receiver(None, 0, config=TINY_GLM5, layer_ids=[0, 5], device="cpu")
    with pytest.raises(ValueError, match="scale_fmt: expected one of"):
        Receiver(None, 0, config=TINY_GLM5, scale_fmt="e8m0", device="cpu")


@pytest.mark.parametrize("case, world", [("tp2", 3), ("ep2", 3), ("tp2xdp2", 5)])
def test_scatter_sends_each_rank_only_its_shard(case, world):
    """Scatter mode: the same bytes land as with the full broadcast (every byte checked against
    the reference cut), while each engine rank receives only its shard's bytes; ranks with the
    same shard (TP=2 x DP=2: the two replicas of each TP rank) share one broadcast."""
    from glm_fp8.engine import engine_params

    results = launch(world, _rank, (case, None, None, True), timeout_s=120)
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    full_bytes, per_rank = results[0][1]
    layouts = _layouts(case, world)
    for r, lay in enumerate(layouts, start=1):
        held = sum(
            p.dtype.itemsize * torch.Size(p.shape).numel() for p in engine_params(TINY_GLM5, lay).values()
        )
        # What a rank receives: its shard in wire dtypes (bf16 where vLLM widens to float32),
        # without the zero vocabulary rows, plus alignment and one checksum word per layer.
        assert per_rank[r] < full_bytes * (0.6 if case.startswith("tp2") else 0.8), (
            r,
            per_rank[r],
            full_bytes,
        )
        assert per_rank[r] <= held + len(WHOLE + [REST]) * 64 * 256, (r, per_rank[r], held)
    if case == "tp2xdp2":
        assert per_rank[1] == per_rank[3] and per_rank[2] == per_rank[4]
