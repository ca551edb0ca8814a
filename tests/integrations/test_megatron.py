"""``MegatronSource``'s refusals at construction, before anything is gathered or sent: each names
the Megatron-Core option glm_fp8 does not map (the model stood in by modules with Megatron's
attribute names; Megatron-Core's own models: test_megatron_real.py)."""

from types import SimpleNamespace

import pytest
import torch

from glm_fp8.integrations.megatron import MEGATRON_NAMES, MegatronParallel, MegatronSource
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.testing import free_port, launch


@pytest.fixture
def one_rank():
    """The trainer's default group, of one rank: construction exchanges every rank's place."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _parallel(**kw):
    base = dict(
        tp_group=None,
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        ep_rank=0,
        ep_size=1,
        etp_size=1,
        edp_rank=0,
    )
    return MegatronParallel(**{**base, **kw})


def _layer(number: int, sparse: bool) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.layer_number = number
    layer.mlp = torch.nn.Module()
    if sparse:
        layer.mlp.router = torch.nn.Linear(4, 4, bias=False)
    else:
        layer.mlp.linear_fc2 = torch.nn.Linear(4, 4, bias=False)
    return layer


def _model(config=None, layers=((1, False),), **attrs) -> torch.nn.Module:
    model = torch.nn.Module()
    base = {"moe_shared_expert_gate": False, "experimental_attention_variant": None}
    model.config = SimpleNamespace(**{**base, **(config or {})})
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList(_layer(n, s) for n, s in layers)
    for k, v in attrs.items():
        setattr(model, k, v)
    return model


@pytest.mark.parametrize(
    "model, parallel, match",
    [
        (_model(), dict(ep_size=3), "expert_model_parallel_size: 3 does not divide the 4 routed experts"),
        (_model({"moe_shared_expert_gate": True}), {}, "moe_shared_expert_gate"),
        (_model(share_embeddings_and_output_weights=True), {}, "share_embeddings_and_output_weights"),
        (
            _model({"experimental_attention_variant": "dsa", "dsa_indexer_rope_interleaved": False}),
            {},
            "dsa_indexer_rope_interleaved",
        ),
        (_model(layers=((9, False),)), {}, "decoder layer 9: beyond the config's 4 layers"),
        (_model(layers=((1, True),)), {}, "moe_layer_freq: Megatron's layer 0 is an MoE layer"),
        (_model(layers=((3, False),)), {}, "moe_layer_freq: Megatron's layer 2 is a dense layer"),
    ],
)
def test_options_glm_fp8_does_not_map_are_refused_naming_them(model, parallel, match, one_rank):
    with pytest.raises(ValueError, match=match):
        MegatronSource(model, TINY_GLM5, _parallel(**parallel))


def test_the_name_table_maps_every_checkpoint_tensor_of_a_glm5_layer():
    """Every tensor a GLM-5 decoder layer holds besides its MLP's (which depends on its kind) is
    the target of one of Megatron's names, the fused (Transformer Engine) ones and the plain ones
    alike."""
    from glm_fp8.model.families import layer_shapes

    wanted = {k for k in layer_shapes(TINY_GLM5, 0) if not k.startswith("mlp.")}
    assert wanted <= set(MEGATRON_NAMES.values()), sorted(wanted - set(MEGATRON_NAMES.values()))
    fused = [k for k in MEGATRON_NAMES if k.endswith("layer_norm_weight")]
    assert {MEGATRON_NAMES[k] for k in fused} == {
        "input_layernorm.weight",
        "self_attn.q_a_layernorm.weight",
        "self_attn.kv_a_layernorm.weight",
        "post_attention_layernorm.weight",
    }


def _refusing_rank(rank, world):
    """Rank 1's layer is of the other kind than the config's (a stage whose ``moe_layer_freq``
    differs); rank 0's model is fine (no layer: another stage's)."""
    model = _model(layers=((3, False),)) if rank == 1 else _model(layers=())
    try:
        MegatronSource(model, TINY_GLM5, _parallel(pp_rank=rank, pp_size=2))
    except ValueError as exc:
        return str(exc)
    return "built"


def test_one_ranks_refusal_is_raised_on_every_rank():
    """A refusal of one stage's layers reaches every trainer rank at construction: none waits in a
    collective for a rank that stopped."""
    results = launch(2, _refusing_rank, timeout_s=30)
    assert results[1] == ("ok", results[1][1]) and "moe_layer_freq" in results[1][1], results
    assert results[0][0] == "ok" and "trainer rank 1 refused its Megatron model" in results[0][1], results
