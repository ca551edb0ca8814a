"""An SGLang 0.5.23 rank's layout and parameters (glm_fp8.engine.sglang, docs/sglang.md#layouts).

Invariant: ``SGLangLayout.from_sglang`` places a TP rank as SGLang's ``derive_attention_ranks``
does (attention TP rank ``tp_rank % attn_tp``, attention DP rank ``tp_rank // attn_tp``) and refuses,
naming the argument, what SGLang refuses or glm_fp8 does not model; ``engine_param_specs`` of an
SGLang layout splits attention and the embedding over the attention TP group, the dense MLP, the
shared experts and ``lm_head`` over the whole TP group (unless told they are unsplit), pads the
vocabulary as SGLang does, and names the entries as SGLang does. The same tables, checked against
SGLang's own model classes, are in tests/integrations/test_sglang_real.py.
"""

import pytest
import torch

from glm_fp8.engine import EngineLayout, SGLangLayout, engine_param_specs
from glm_fp8.engine.sglang import check_sglang_config, sglang_indexer_form, sglang_name, update_indexer_form
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.transfer.pack import layout_words

CONFIG = {**TINY_GLM5, "indexer_rope_interleave": True}
FP8 = torch.float8_e4m3fn


def test_ranks_are_placed_as_sglang_derives_them():
    lays = SGLangLayout.all_sglang_ranks(8, attn_dp_size=4, ep_size=8)
    assert [(x.tp_rank, x.dp_rank) for x in lays] == [(r % 2, r // 2) for r in range(8)]
    assert all(x.tp_size == 2 and x.dp_size == 4 and x.ep_size == 8 for x in lays)
    assert [x.moe_group_rank for x in lays] == list(range(8))  # the whole TP group
    assert [x.ep_rank for x in lays] == list(range(8))
    plain = SGLangLayout.from_sglang(4, 3)
    assert (plain.tp_size, plain.tp_rank, plain.dp_size, plain.ep_size) == (4, 3, 1, 1)
    assert plain.engine == "sglang" and EngineLayout().engine == "vllm"


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(tp_size=8, tp_rank=0, ep_size=4), "ep_size 4 with tp_size 8"),
        (dict(tp_size=8, tp_rank=0, attn_dp_size=3), "attn_dp_size 3 does not divide tp_size 8"),
        (dict(tp_size=2, tp_rank=2), "tp_rank 2 is not below tp_size 2"),
        (dict(tp_size=8, tp_rank=0, moe_dense_tp_size=2), "moe_dense_tp_size 2"),
        (dict(tp_size=8, tp_rank=0, moe_a2a_backend="deep_ep"), "moe_a2a_backend 'deep_ep'"),
        (dict(tp_size=8, tp_rank=0, enable_dp_lm_head=1), "enable_dp_lm_head: expected a bool"),
        (dict(tp_size=2.0, tp_rank=0), "tp_size"),
    ],
)
def test_layouts_sglang_refuses_or_glm_fp8_does_not_model_are_refused_naming_the_argument(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SGLangLayout.from_sglang(**kwargs)


def test_a_vllm_setting_on_an_sglang_layout_is_refused():
    with pytest.raises(ValueError, match="sequence_parallel_moe"):
        SGLangLayout(tp_size=2, dp_size=2, ep_size=4, sequence_parallel_moe=True)


def test_tp_rank_splits_every_group_like_vllms_tp_and_names_follow_sglang():
    specs = engine_param_specs(CONFIG, SGLangLayout.from_sglang(2, 1))
    vllm = engine_param_specs(CONFIG, EngineLayout(tp_size=2, tp_rank=1))
    assert "model.layers.2.self_attn.fused_qkv_a_proj_with_mqa.weight" in specs
    assert "model.layers.2.mlp.experts.w13_weight" in specs  # no routed_experts level
    assert not any("fused_qkv_a_proj." in n or "routed_experts" in n or "mtp_block" in n for n in specs)
    renamed = {
        sglang_name(n.replace("routed_experts.", "")): v for n, v in vllm.items() if "mtp_block" not in n
    }
    mtp = f"model.layers.{CONFIG['num_hidden_layers']}."
    renamed = {n: v for n, v in renamed.items() if not n.startswith(mtp)}
    assert specs == renamed  # at plain TP, SGLang's shards are vLLM's


def test_attention_dp_splits_attention_over_its_tp_group_and_the_mlp_over_the_whole_group():
    h, heads = CONFIG["hidden_size"], CONFIG["num_attention_heads"]
    q_rows = heads * (CONFIG["qk_nope_head_dim"] + CONFIG["qk_rope_head_dim"])
    lay = SGLangLayout.from_sglang(4, 3, attn_dp_size=2, ep_size=4)  # attention TP 2, rank 1
    specs = engine_param_specs(CONFIG, lay)
    assert specs["model.layers.2.self_attn.q_b_proj.weight"] == ((q_rows // 2, CONFIG["q_lora_rank"]), FP8)
    dense = CONFIG["intermediate_size"]
    assert specs["model.layers.0.mlp.gate_up_proj.weight"] == ((2 * dense // 4, h), FP8)
    assert specs["model.layers.0.mlp.down_proj.weight"] == ((h, dense // 4), FP8)
    e = CONFIG["n_routed_experts"]
    assert specs["model.layers.2.mlp.experts.w13_weight"][0][0] == e // 4
    vp = 1024  # V 1000 padded to 64: split 2 ways (the embedding) and 4 ways (lm_head)
    assert specs["model.embed_tokens.weight"][0] == (vp // 2, h)
    assert specs["lm_head.weight"][0] == (vp // 4, h)
    head = engine_param_specs(CONFIG, SGLangLayout.from_sglang(4, 3, attn_dp_size=2, enable_dp_lm_head=True))
    assert head["lm_head.weight"][0] == (vp // 2, h)


def test_unsplit_dense_mlp_and_shared_experts():
    lay = SGLangLayout.from_sglang(2, 1, ep_size=2, moe_dense_tp_size=1, moe_a2a_backend="deepep")
    specs = engine_param_specs(CONFIG, lay)
    h, dense, inter = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["moe_intermediate_size"]
    assert specs["model.layers.0.mlp.gate_up_proj.weight"][0] == (2 * dense, h)
    assert specs["model.layers.2.mlp.shared_experts.gate_up_proj.weight"][0] == (2 * inter, h)
    assert not SGLangLayout.from_sglang(2, 0, shared_expert_tp1=True).shared_experts_split


def test_the_vocabulary_pads_to_64_times_the_group_where_64_does_not_split_evenly():
    lay = SGLangLayout.from_sglang(3, 2)
    assert lay.padded_vocab(1000, 3) == 1152  # 1024 % 3 != 0: padded to a multiple of 192
    assert EngineLayout().padded_vocab(1000, 3) == 1024
    config = {**CONFIG, "num_attention_heads": 3, "hidden_size": 384}
    with pytest.raises(ValueError):  # vLLM asserts that its padded vocabulary splits evenly
        engine_param_specs(config, EngineLayout(tp_size=3, tp_rank=0))


def test_models_sglang_holds_otherwise_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="model_type"):
        check_sglang_config({"model_type": "glm4_moe"})


def test_glm5s_indexer_is_split_for_sglang_and_fused_for_vllm():
    """GLM-5's config does not interleave the indexer's rotary: SGLang then holds wk block-FP8 and
    weights_proj bf16, vLLM the fused bf16 wk_weights_proj; one update sends one form."""
    lay = SGLangLayout.from_sglang(2, 0)
    split = engine_param_specs(TINY_GLM5, lay)
    h, d, heads = TINY_GLM5["hidden_size"], TINY_GLM5["index_head_dim"], TINY_GLM5["index_n_heads"]
    assert split["model.layers.2.self_attn.indexer.wk.weight"] == ((d, h), FP8)
    assert split["model.layers.2.self_attn.indexer.wk.weight_scale_inv"] == ((1, 2), torch.float32)
    assert split["model.layers.2.self_attn.indexer.weights_proj.weight"] == ((heads, h), torch.bfloat16)
    assert not any("wk_weights_proj" in n for n in split)
    fused = engine_param_specs(CONFIG, lay)
    assert fused["model.layers.2.self_attn.indexer.wk_weights_proj.weight"] == (
        (d + heads, h),
        torch.bfloat16,
    )
    assert sglang_indexer_form(TINY_GLM5) == "split" and sglang_indexer_form(CONFIG) == "fused"
    vllm = EngineLayout(tp_size=2, tp_rank=0)
    assert update_indexer_form(TINY_GLM5, [None, lay]) == "split"
    assert update_indexer_form(TINY_GLM5, [None, vllm]) == "fused"
    assert update_indexer_form(CONFIG, [None, lay, vllm]) == "fused"  # GLM-5.2: both fused
    assert update_indexer_form(TINY_GLM5, [None, lay, vllm]) == "both"  # GLM-5: each its own
    wk, fused = (
        "model.layers.2.self_attn.indexer.wk.weight_scale_inv",
        "self_attn.indexer.wk_weights_proj.weight",
    )
    assert lay.holds(TINY_GLM5, wk) and not lay.holds(TINY_GLM5, fused)
    assert vllm.holds(TINY_GLM5, fused) and not vllm.holds(TINY_GLM5, wk)
    assert lay.holds(CONFIG, fused) and not lay.holds(CONFIG, wk)
    assert all(x.holds(TINY_GLM5, "self_attn.indexer.wq_b.weight") for x in (lay, vllm))


def test_manifest_words_tell_the_engines_apart():
    assert layout_words(SGLangLayout.from_sglang(2, 1))[0] == "sglang"
    assert layout_words(EngineLayout(tp_size=2, tp_rank=1))[0] == "vllm"
    assert SGLangLayout.from_sglang(2, 1) != EngineLayout(tp_size=2, tp_rank=1)


def test_an_update_plans_the_indexer_as_its_ranks_hold_it():
    from glm_fp8.transfer import Sender
    from glm_fp8.transfer.link import HostSinkComm

    sglang = SGLangLayout.all_sglang_ranks(2)
    sender = Sender(HostSinkComm(size=3), 0, config=TINY_GLM5, device="cpu", engines=[None, *sglang])
    names = {e.name for e in sender.plans[2].entries}
    assert {"self_attn.indexer.wk.weight", "self_attn.indexer.weights_proj.weight"} <= names
    assert "self_attn.indexer.wk_weights_proj.weight" not in names
    both = Sender(
        HostSinkComm(size=5),
        0,
        config=TINY_GLM5,
        device="cpu",
        engines=[None, *sglang, *EngineLayout.all_ranks(2)],
    )
    assert {e.name for e in both.plans[2].entries} >= names | {"self_attn.indexer.wk_weights_proj.weight"}
