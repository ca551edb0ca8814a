"""Layers without an indexer (GLM-5.2's IndexShare) and the other block-FP8 MoE families.

Invariants: a config's indexer schedule decides, per layer, whether the plan (and so the
converter, the manifest, the engine's parameter list and the memory model) has the
``self_attn.indexer.*`` entries; prime-rl's and vLLM 0.34's readings of the schedule must agree
or the config is refused; a state dict that disagrees with the schedule is refused naming the
layer and key; every family's tiny config converts bit-identically to the reference.
"""

import math

import pytest
import torch

from glm_fp8.cli.demo import demo_rank
from glm_fp8.engine import EngineLayout, engine_param_specs
from glm_fp8.integrations.prime_rl import convert_tt_layer_to_vllm_kernel
from glm_fp8.kernels.convert import convert_layer
from glm_fp8.kernels.reference import convert_layer_ref
from glm_fp8.model.families import layer_kind, layer_shapes
from glm_fp8.model.indexer import has_indexer, skip_topk_layers
from glm_fp8.model.plans import plan_from_config, plan_from_state_dict, plans_for_model
from glm_fp8.model.presets import PRESETS, SMALL_CONFIGS, SMALL_GLM5, TINY_GLM5
from glm_fp8.model.trainer_layouts import strip_layer
from glm_fp8.planning.memory import master_bytes_per_gpu
from glm_fp8.testing import launch, synthetic_layer

N = 4
BASE = {**SMALL_GLM5, "num_hidden_layers": N, "index_topk": 16}
INDEXER_ENTRIES = [
    "self_attn.indexer.wq_b.weight",
    "self_attn.indexer.wq_b.weight_scale_inv",
    "self_attn.indexer.wk_weights_proj.weight",
    "self_attn.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias",
]
# Three ways to write a schedule, each with the full layers it gives (both readers agree on them).
SCHEDULES = {
    "all-full": ({}, [0, 1, 2, 3]),
    "every-other-types": ({"indexer_types": ["full", "shared", "full", "shared"]}, [0, 2]),
    "every-other-freq": (
        {"use_index_cache": True, "index_topk_freq": 2, "index_skip_topk_offset": 1},
        [0, 2],
    ),
    "pattern": ({"use_index_cache": True, "index_topk_pattern": "FFSF"}, [0, 1, 3]),
}


def _config(name: str) -> dict:
    return {**BASE, **SCHEDULES[name][0]}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_gives_the_full_layers(name):
    config, full = _config(name), SCHEDULES[name][1]
    assert [i for i in range(N) if has_indexer(config, i)] == full
    assert skip_topk_layers(config) == frozenset(set(range(N)) - set(full))
    assert has_indexer(config, N)  # the MTP layer always has its indexer
    for i in range(N):
        names = [e.name for e in plan_from_config(config, i).entries]
        assert all((n in names) == (i in full) for n in INDEXER_ENTRIES), (i, names)
        assert layer_kind(config, i).endswith("/no-indexer") == (i not in full)


def test_glm52_preset_schedule():
    """zai-org/GLM-5.2: a full indexer in layers 0-2 and every 4th layer from 6 (21 of 78); the
    same set as vLLM's rule with index_topk_freq 4, offset 3 without indexer_types."""
    config = PRESETS["glm-5.2"]
    full = [i for i in range(78) if has_indexer(config, i)]
    assert full == [0, 1, 2, *range(6, 78, 4)] and len(full) == 21
    from glm_fp8.model.indexer import vllm_skip_topk_layers

    no_types = {k: v for k, v in config.items() if k != "indexer_types"}
    assert vllm_skip_topk_layers(no_types) == set(range(78)) - set(full)
    # prime-rl reads the frequency without the offset (i % 4): only indexer_types makes both agree
    for use_index_cache, layer in ((True, 1), (False, 3)):
        with pytest.raises(ValueError, match=rf"layer {layer} has"):
            skip_topk_layers({**no_types, "use_index_cache": use_index_cache})


@pytest.mark.parametrize(
    "extra, match",
    [
        # prime-rl: i % 2 (layers 1, 3 shared); vLLM: max(i - 1, 0) % 2 with offset 2 (layer 2 shared)
        ({"use_index_cache": True, "index_topk_freq": 2}, r"layer 1 has no indexer \(shared\) for prime-rl"),
        # vLLM reads a frequency without use_index_cache; prime-rl does not
        (
            {"index_topk_freq": 2, "index_skip_topk_offset": 1},
            r"layer 1 has an indexer \(full\) for prime-rl",
        ),
        # precedence: prime-rl takes the pattern first, vLLM indexer_types first
        (
            {"use_index_cache": True, "index_topk_pattern": "FSFS", "indexer_types": ["full"] * 4},
            r"layer 1 has no indexer \(shared\) for prime-rl .* and an indexer \(full\) for vLLM",
        ),
        (
            {"indexer_types": ["full", "shared"]},
            r"config\.indexer_types: expected one entry per hidden layer",
        ),
        ({"indexer_types": ["full", "sparse", "full", "full"]}, r"config\.indexer_types: only 'full'"),
        (
            {"use_index_cache": True, "index_topk_freq": 0},
            r"config\.index_topk_freq: expected an integer in \[1, 4096\]",
        ),
    ],
)
def test_schedules_read_two_ways_or_invalid_are_refused(extra, match):
    config = {**BASE, **extra}
    for call in (
        lambda: skip_topk_layers(config),
        lambda: plans_for_model(config),
        lambda: engine_param_specs({**TINY_GLM5, **extra}, EngineLayout()),
    ):
        with pytest.raises(ValueError, match=match):
            call()


def test_plans_are_built_once_per_layer_kind():
    config = {**_config("every-other-types"), "first_k_dense_replace": 1}
    plans = plans_for_model(config)
    assert [p.kind for p in plans] == ["dense", "sparse/no-indexer", "sparse", "sparse/no-indexer"]
    assert plans[1] is plans[3] and plans[1] is not plans[2]
    # the manifest follows the schedule: a shared layer's lacks exactly the indexer entries
    full = {m["name"] for m in plans[2].manifest()}
    shared = {m["name"] for m in plans[1].manifest()}
    assert full - shared == set(INDEXER_ENTRIES) and shared < full


@pytest.mark.parametrize("name", ["every-other-types", "pattern"])
def test_converter_and_drop_in_follow_the_schedule(name, device):
    config = _config(name)
    for i in range(N):
        sd = {k: v.to(device) for k, v in synthetic_layer(config, i).items()}
        assert any(".indexer." in k for k in sd) == has_indexer(config, i)
        plan = plan_from_config(config, i)  # passthrough entries in the engine's dtypes
        want = convert_layer_ref(strip_layer(sd, i), i, plan)
        # a state dict's plan keeps the trainer's dtypes
        want_sd = convert_layer_ref(strip_layer(sd, i), i, plan_from_state_dict(strip_layer(sd, i)))
        got = convert_layer(sd, i, plan=plan)
        drop_in = convert_tt_layer_to_vllm_kernel(sd, i, config=config)
        inferred = convert_layer(sd, i)  # the plan inferred from the state dict alone
        for out, ref in ((got, want), (drop_in, want_sd), (inferred, want_sd)):
            assert list(out) == list(ref)
            for k, w in ref.items():
                assert out[k].dtype == w.dtype, (i, k)
                assert torch.equal(out[k].cpu().view(torch.uint8), w.cpu().view(torch.uint8)), (i, k)


def test_state_dict_disagreeing_with_the_schedule(monkeypatch):
    """Indexer tensors on a layer the schedule shares are not sent (the engine has no indexer
    there; a Hugging Face trainer holds one): left out with one warning per process, the rest
    converted as the shared layer's plan says. A full layer without its indexer, or a part of
    an indexer, is refused naming the key."""
    import glm_fp8.model.plans

    config = _config("every-other-types")  # layer 1 shared, layer 2 full
    shared_with = synthetic_layer(_config("all-full"), 1)  # layer 1 with an indexer
    full_without = synthetic_layer(config, 3)  # a shared layer's tensors, offered as layer 2
    full_without = {k.replace("layers.3.", "layers.2."): v for k, v in full_without.items()}
    plan = plan_from_config(config, 1)
    without = {k: v for k, v in shared_with.items() if ".indexer." not in k}
    want = convert_layer_ref(strip_layer(without, 1), 1, plan)
    want_sd = convert_layer_ref(strip_layer(without, 1), 1, plan_from_state_dict(strip_layer(without, 1)))
    monkeypatch.setattr(glm_fp8.model.plans, "_warned", set())
    with pytest.warns(UserWarning, match=r"model\.layers\.1\.self_attn\.indexer\..*not sent") as record:
        got = convert_layer(shared_with, 1, plan=plan)
        drop_in = convert_tt_layer_to_vllm_kernel(shared_with, 1, config=config)
    assert len(record) == 1  # once per process, not per layer or call
    for out, ref in ((got, want), (drop_in, want_sd)):
        assert list(out) == list(ref)
        for k, w in ref.items():
            assert torch.equal(out[k].view(torch.uint8), w.view(torch.uint8)), k
    key2 = r"model\.layers\.2\.self_attn\.indexer\.wq_b\.weight"
    with pytest.raises(KeyError, match=key2 + r": missing; the config's indexer schedule gives layer 2"):
        convert_tt_layer_to_vllm_kernel(full_without, 2, config=config)
    with pytest.raises(KeyError, match=r"model\.layers\.2\.self_attn\.indexer\..*: missing.*has an indexer"):
        convert_layer(full_without, 2, plan=plan_from_config(config, 2))
    # without a config, a layer holding only part of the indexer is refused too
    partial = {k: v for k, v in shared_with.items() if not k.endswith("k_norm.bias")}
    with pytest.raises(
        KeyError, match=r"self_attn\.indexer\.k_norm\.bias: missing.*every self_attn\.indexer"
    ):
        convert_tt_layer_to_vllm_kernel(partial, 1)


def test_engine_specs_and_memory_follow_the_schedule():
    config = {**TINY_GLM5, "index_topk": 8, "indexer_types": ["full", "shared", "shared", "full"]}
    specs = engine_param_specs(config, EngineLayout(tp_size=2, tp_rank=1))
    for i in range(5):  # layer 4 is the MTP layer: its indexer is always there
        p = f"model.layers.{i}.mtp_block." if i == 4 else f"model.layers.{i}."
        present = [n for n in INDEXER_ENTRIES if p + n in specs]
        assert present == (INDEXER_ENTRIES if i in (0, 3, 4) else []), i
    assert specs["model.layers.0.self_attn.indexer.k_norm.weight"][1] == torch.float32
    full = engine_param_specs({**TINY_GLM5, "index_topk": 8}, EngineLayout(tp_size=2, tp_rank=1))
    assert set(full) - set(specs) == {f"model.layers.{i}.{n}" for i in (1, 2) for n in INDEXER_ENTRIES}
    # resident master weights: the two shared layers hold no indexer
    c = TINY_GLM5
    ih, idim, h = c["index_n_heads"], c["index_head_dim"], c["hidden_size"]
    per_layer = ih * idim * c["q_lora_rank"] + idim * h + ih * h + 2 * idim
    saved = master_bytes_per_gpu({**TINY_GLM5, "index_topk": 8}, 1) - master_bytes_per_gpu(config, 1)
    assert saved == 2 * per_layer * 4
    assert sum(math.prod(s) for s in layer_shapes(config, 2).values()) + per_layer == sum(
        math.prod(s) for s in layer_shapes(config, 3).values()
    )


def test_broadcast_with_a_schedule_every_byte_checked():
    """gloo, 1 sender + 2 receivers, layers 0 full, 1 shared, 2 full, 3 shared (pattern)."""
    config = {**SMALL_GLM5, "index_topk": 16, "use_index_cache": True, "index_topk_pattern": "FSFS"}
    results = launch(3, demo_rank, (config, N, 2, "fp8"), timeout_s=120)
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    for r in (1, 2):
        assert results[r][1]["bytes_checked"] > 0 and results[r][1]["bytes_mismatched"] == 0


# --- families --------------------------------------------------------------------------------------

_NORMS = ["input_layernorm.weight", "post_attention_layernorm.weight"]
_S = "_scale_inv"
_MLA = [
    "self_attn.fused_qkv_a_proj.weight",
    "self_attn.fused_qkv_a_proj.weight" + _S,
    "self_attn.q_a_layernorm.weight",
    "self_attn.kv_a_layernorm.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.q_b_proj.weight" + _S,
    "self_attn.kv_b_proj.weight",
    "self_attn.kv_b_proj.weight" + _S,
    "self_attn.o_proj.weight",
    "self_attn.o_proj.weight" + _S,
]
_GQA = [
    "self_attn.qkv_proj.weight",
    "self_attn.qkv_proj.weight" + _S,
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "self_attn.o_proj.weight",
    "self_attn.o_proj.weight" + _S,
]
_EXPERTS = [
    "mlp.experts.w13_weight",
    "mlp.experts.w13_weight" + _S,
    "mlp.experts.w2_weight",
    "mlp.experts.w2_weight" + _S,
]
_DSV3_MOE = [
    "mlp.gate.weight",
    "mlp.gate.e_score_correction_bias",
    *_EXPERTS,
    "mlp.shared_experts.gate_up_proj.weight",
    "mlp.shared_experts.gate_up_proj.weight" + _S,
    "mlp.shared_experts.down_proj.weight",
    "mlp.shared_experts.down_proj.weight" + _S,
]
# Sparse-layer parameter names of vLLM 0.34 (deepseek_v2.py::DeepseekV2MLAAttention / DeepseekV2MoE,
# deepseek_v32/attention.py, qwen3_moe.py::Qwen3MoeAttention / Qwen3MoeSparseMoeBlock), without the
# routed_experts level (glm_fp8.engine.engine_name adds it).
SPARSE_NAMES = {
    "deepseek-v3": _NORMS + _MLA + _DSV3_MOE,
    "kimi-k2": _NORMS + _MLA + _DSV3_MOE,
    "deepseek-v3.2": _NORMS + _MLA + INDEXER_ENTRIES + _DSV3_MOE,
    "qwen3-moe": _NORMS + _GQA + ["mlp.gate.weight", *_EXPERTS],
}


@pytest.mark.parametrize("model", list(SPARSE_NAMES))
def test_family_layers_match_the_reference(model, device):
    config = SMALL_CONFIGS[model]
    for i in range(config["num_hidden_layers"]):
        sd = {k: v.to(device) for k, v in synthetic_layer(config, i).items()}
        layer = strip_layer(sd, i)
        plan = plan_from_config(config, i)
        want = convert_layer_ref(layer, i, plan)
        want_sd = convert_layer_ref(layer, i, plan_from_state_dict(layer))  # the trainer's dtypes
        for got, ref in (
            (convert_layer(sd, i, plan=plan), want),
            (convert_tt_layer_to_vllm_kernel(sd, i, config=config), want_sd),
        ):
            assert list(got) == list(ref)
            for k, w in ref.items():
                assert torch.equal(got[k].cpu().view(torch.uint8), w.cpu().view(torch.uint8)), (model, i, k)
    sparse = next(p for p in plans_for_model(config) if p.kind.startswith("sparse"))
    assert [e.name for e in sparse.entries] == SPARSE_NAMES[model]


def test_family_presets():
    kimi = plans_for_model(PRESETS["kimi-k2"])
    assert [p.kind for p in kimi].count("dense") == 1
    assert kimi[1].inputs["mlp.experts.w1"][0] == (384, 2048, 7168)
    qwen = plans_for_model(PRESETS["qwen3-moe"])
    assert len(qwen) == 94 and all(p.kind == "sparse" for p in qwen)
    assert qwen[0].inputs["self_attn.k_proj.weight"][0] == (4 * 128, 4096)
    v32 = plans_for_model(PRESETS["deepseek-v3.2"])
    assert v32[3].inputs["self_attn.indexer.wq_b.weight"][0] == (64 * 128, 1536)
    v3 = plans_for_model(PRESETS["deepseek-v3"])
    assert v32[3].nbytes > v3[3].nbytes and not any(".indexer." in k for k in v3[3].inputs)
    with pytest.raises(ValueError, match=r"config\.model_type: the engine's parameters are modelled for"):
        engine_param_specs(PRESETS["deepseek-v3"], EngineLayout())
