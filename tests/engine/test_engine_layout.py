"""Engine-side sharding (glm_fp8.engine): shapes a vLLM 0.34 rank holds, checked against the
tables of docs/layouts.md ("Engine side (vLLM 0.34)"), the cut and re-assembly of every
parameter over all ranks, and the layouts vLLM refuses. CPU only, no processes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from glm_fp8.engine import (
    EngineLayout,
    Shard,
    copy_shard_into,
    engine_dtype,
    engine_name,
    engine_param_specs,
    engine_params,
    shard_for,
    take_shard,
)
from glm_fp8.model.presets import PRESETS, TINY_GLM5

GLM5 = PRESETS["glm-5"]

# GLM-4.5 shrunk: 8 query heads, 2 KV heads of 128, so TP=4 replicates each KV head twice.
TINY_GLM45 = {
    **PRESETS["glm-4.5"],
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "n_routed_experts": 4,
    "moe_intermediate_size": 512,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 1000,
}

FP8, F32, BF16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16
P3, P0, MTP = "model.layers.3.", "model.layers.0.", "model.layers.78."
E = "mlp.experts.routed_experts."

# docs/layouts.md#names-dtypes-shards-glm-5 and #mtp-layer-glm-5-layer-78: (shape, dtype) per rank.
COMMON = {
    P3 + "input_layernorm.weight": ((6144,), BF16),
    P3 + "self_attn.fused_qkv_a_proj.weight": ((2624, 6144), FP8),
    P3 + "self_attn.fused_qkv_a_proj.weight_scale_inv": ((21, 48), F32),
    P3 + "self_attn.q_a_layernorm.weight": ((2048,), BF16),
    P3 + "self_attn.kv_a_layernorm.weight": ((512,), BF16),
    P3 + "self_attn.indexer.wq_b.weight": ((4096, 2048), FP8),
    P3 + "self_attn.indexer.wq_b.weight_scale_inv": ((32, 16), F32),
    P3 + "self_attn.indexer.wk_weights_proj.weight": ((160, 6144), BF16),
    P3 + "self_attn.indexer.k_norm.weight": ((128,), F32),
    P3 + "self_attn.indexer.k_norm.bias": ((128,), F32),
    P3 + "mlp.gate.weight": ((256, 6144), BF16),
    P3 + "mlp.gate.e_score_correction_bias": ((256,), F32),
    "model.norm.weight": ((6144,), BF16),
    MTP + "enorm.weight": ((6144,), BF16),
    MTP + "hnorm.weight": ((6144,), BF16),
    MTP + "eh_proj.weight": ((6144, 12288), BF16),
    MTP + "shared_head.norm.weight": ((6144,), BF16),
}
TP8 = {
    **COMMON,
    "model.embed_tokens.weight": ((19360, 6144), BF16),
    "lm_head.weight": ((19360, 6144), BF16),
    MTP + "shared_head.head.weight": ((19360, 6144), BF16),
    P3 + "self_attn.q_b_proj.weight": ((2048, 2048), FP8),
    P3 + "self_attn.q_b_proj.weight_scale_inv": ((16, 16), F32),
    P3 + "self_attn.kv_b_proj.weight": ((3584, 512), FP8),
    P3 + "self_attn.kv_b_proj.weight_scale_inv": ((28, 4), F32),
    P3 + "self_attn.o_proj.weight": ((6144, 2048), FP8),
    P3 + "self_attn.o_proj.weight_scale_inv": ((48, 16), F32),
    P0 + "mlp.gate_up_proj.weight": ((3072, 6144), FP8),
    P0 + "mlp.gate_up_proj.weight_scale_inv": ((24, 48), F32),
    P0 + "mlp.down_proj.weight": ((6144, 1536), FP8),
    P0 + "mlp.down_proj.weight_scale_inv": ((48, 12), F32),
    P3 + "mlp.shared_experts.gate_up_proj.weight": ((512, 6144), FP8),
    P3 + "mlp.shared_experts.gate_up_proj.weight_scale_inv": ((4, 48), F32),
    P3 + "mlp.shared_experts.down_proj.weight": ((6144, 256), FP8),
    P3 + "mlp.shared_experts.down_proj.weight_scale_inv": ((48, 2), F32),
    P3 + E + "w13_weight": ((256, 512, 6144), FP8),
    P3 + E + "w13_weight_scale_inv": ((256, 4, 48), F32),
    P3 + E + "w2_weight": ((256, 6144, 256), FP8),
    P3 + E + "w2_weight_scale_inv": ((256, 48, 2), F32),
    MTP + "mtp_block." + E + "w13_weight": ((256, 512, 6144), FP8),
    MTP + "mtp_block.self_attn.o_proj.weight": ((6144, 2048), FP8),
}
EP8 = {  # tp=1, dp=8, expert parallel: everything full but the routed experts
    **COMMON,
    "model.embed_tokens.weight": ((154880, 6144), BF16),
    "lm_head.weight": ((154880, 6144), BF16),
    MTP + "shared_head.head.weight": ((154880, 6144), BF16),
    P3 + "self_attn.q_b_proj.weight": ((16384, 2048), FP8),
    P3 + "self_attn.kv_b_proj.weight_scale_inv": ((224, 4), F32),
    P3 + "self_attn.o_proj.weight": ((6144, 16384), FP8),
    P0 + "mlp.gate_up_proj.weight": ((24576, 6144), FP8),
    P0 + "mlp.down_proj.weight_scale_inv": ((48, 96), F32),
    P3 + "mlp.shared_experts.gate_up_proj.weight": ((4096, 6144), FP8),
    P3 + E + "w13_weight": ((32, 4096, 6144), FP8),
    P3 + E + "w13_weight_scale_inv": ((32, 32, 48), F32),
    P3 + E + "w2_weight": ((32, 6144, 2048), FP8),
    P3 + E + "w2_weight_scale_inv": ((32, 48, 16), F32),
    MTP + "mtp_block." + E + "w2_weight": ((32, 6144, 2048), FP8),
}


@pytest.mark.parametrize(
    "ranks, expected",
    [(EngineLayout.all_ranks(8), TP8), (EngineLayout.all_ranks(1, 8, enable_expert_parallel=True), EP8)],
    ids=["tp8", "ep8"],
)
def test_glm5_shapes_match_docs(ranks: list[EngineLayout], expected: dict) -> None:
    for layout in ranks:
        specs = engine_param_specs(GLM5, layout)
        for name, spec in expected.items():
            assert specs[name] == spec, (layout, name)
    names = set(specs)
    # 3 dense layers of 21 entries, 75 sparse of 27, MTP (5 own + a sparse layer), embed/norm/lm_head.
    assert len(names) == 3 * 21 + 75 * 27 + 5 + 27 + 3
    assert not any(".mlp.experts.w13" in n or "W_UK_T" in n for n in names)
    assert "model.layers.78.self_attn.q_b_proj.weight" not in names


def test_glm5_sequence_parallel_moe_replicates_mlp() -> None:
    """EP on with tp > 1 and dp > 1: the dense MLP and shared experts are built with disable_tp."""
    sp = EngineLayout.from_vllm(2, 1, 4, 3, enable_expert_parallel=True)
    assert (sp.ep_size, sp.ep_rank, sp.sp_moe) == (8, 7, True)
    specs = engine_param_specs(GLM5, sp)
    assert specs[P0 + "mlp.gate_up_proj.weight"] == ((24576, 6144), FP8)
    assert specs[P3 + "mlp.shared_experts.down_proj.weight_scale_inv"] == ((48, 16), F32)
    assert specs[P3 + "self_attn.o_proj.weight"] == ((6144, 8192), FP8)
    assert specs[P3 + E + "w13_weight"] == ((32, 4096, 6144), FP8)
    no_sp = EngineLayout.from_vllm(2, 1, 4, 3, enable_expert_parallel=True, all2all_backend="moonep")
    assert not no_sp.sp_moe
    assert engine_param_specs(GLM5, no_sp)[P0 + "mlp.gate_up_proj.weight"] == ((12288, 6144), FP8)


@pytest.mark.parametrize(
    "ranks",
    [EngineLayout.all_ranks(8), EngineLayout.all_ranks(1, 8, True), EngineLayout.all_ranks(2, 4, True)],
    ids=["tp8", "ep8", "tp2dp4ep"],
)
def test_glm5_rank_elements_sum_to_full(ranks: list[EngineLayout]) -> None:
    per_rank = [engine_params(GLM5, layout) for layout in ranks]
    for name, p0 in per_rank[0].items():
        total = sum(math.prod(params[name].shape) for params in per_rank)
        full = math.prod(p0.full_shape)
        if p0.shard.kind == "replicated":
            assert all(params[name].shape == p0.full_shape for params in per_rank), name
            continue
        # A TP-sharded entry is held once per DP replica; MoE-group shards once in all.
        copies = len(per_rank) // p0.shard.group_size
        pad = sum(params[name].shard.pad for params in per_rank) * math.prod(p0.full_shape[-1:])
        assert total == full * copies + pad, name


def test_expert_placement_linear() -> None:
    assert [lay.expert_range(256) for lay in EngineLayout.all_ranks(1, 8, True)][3] == (96, 128)
    assert [lay.expert_range(5) for lay in EngineLayout.all_ranks(2, 1, True)] == [(0, 3), (3, 5)]
    assert [lay.expert_range(7) for lay in EngineLayout.all_ranks(1, 4, True)] == [
        (0, 2),
        (2, 4),
        (4, 6),
        (6, 7),
    ]
    assert EngineLayout(tp_size=2, tp_rank=1).expert_range(5) == (0, 5)


# --- cut and re-assemble every parameter of a tiny model over all ranks --------------------------------


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _check_scale_follows_weight(weight: Shard, scale: Shard, n: int) -> None:
    """The rank's local block j covers the rank's weight rows [128 j, 128 j + 128)."""
    rows = take_shard(torch.arange(n), dataclasses.replace(weight, dim=-1))
    blocks = take_shard(torch.arange(-(-n // 128)), dataclasses.replace(scale, dim=-1))
    assert torch.equal(rows // 128, blocks.repeat_interleave(128)[: len(rows)])


LAYOUTS = {
    "tp2": EngineLayout.all_ranks(2),
    "ep2": EngineLayout.all_ranks(1, 2, enable_expert_parallel=True),
    "tp2dp2": EngineLayout.all_ranks(2, 2),
    "tp2dp2ep": EngineLayout.all_ranks(2, 2, enable_expert_parallel=True),
}


_TP = {"replicated", "cols", "merged_rows", "vocab"}
KINDS = {  # the shard kinds each case must exercise
    ("tp2", "glm5"): _TP | {"rows"},
    ("tp2", "glm45"): _TP | {"qkv_rows"},
    ("ep2", "glm5"): {"replicated", "experts", "vocab"},
    ("ep2", "glm45"): {"replicated", "experts", "vocab"},
    ("tp2dp2", "glm5"): _TP | {"rows"},
    ("tp2dp2", "glm45"): _TP | {"qkv_rows"},
    # GLM-5 under sequence-parallel MoE: dense and shared MLP replicated (no merged_rows left)
    ("tp2dp2ep", "glm5"): {"replicated", "rows", "cols", "experts", "vocab"},
    ("tp2dp2ep", "glm45"): _TP | {"qkv_rows", "experts"},
}


@pytest.mark.parametrize("model", ["glm5", "glm45"])
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_tiny_shards_reassemble(model: str, case: str) -> None:
    config, layouts = {"glm5": TINY_GLM5, "glm45": TINY_GLM45}[model], LAYOUTS[case]
    gen = torch.Generator().manual_seed(0)
    per_rank = [engine_params(config, layout) for layout in layouts]
    assert len({tuple(p) for p in per_rank}) == 1  # the same names on every rank
    fulls = {n: _random(p.full_shape, p.dtype, gen) for n, p in per_rank[0].items()}
    kinds = set()
    for name, full in fulls.items():
        recon = torch.zeros_like(full)
        covered = torch.zeros(full.shape, dtype=torch.int32)
        for params in per_rank:
            p = params[name]
            kinds.add(p.shard.kind)
            piece = take_shard(full, p.shard)
            assert tuple(piece.shape) == p.shape, name
            dst = torch.ones(p.shape).to(full.dtype)
            assert _same(copy_shard_into(dst, full, p.shard), piece), name
            if p.shard.kind == "replicated":
                assert piece is full
                recon.copy_(full)
                covered += 1
                continue
            off = 0
            for a, b in p.shard.parts:
                recon.narrow(p.shard.dim, a, b - a).copy_(piece.narrow(p.shard.dim, off, b - a))
                covered.narrow(p.shard.dim, a, b - a).add_(1)
                off += b - a
            if p.shard.pad:
                assert not piece.narrow(p.shard.dim, off, p.shard.pad).float().any(), name
            if name.endswith("_scale_inv"):
                w = params[name[: -len("_scale_inv")]]
                if p.shard.kind == "experts":
                    assert p.shard == w.shard, name
                else:
                    _check_scale_follows_weight(w.shard, p.shard, w.full_shape[w.shard.dim])
        assert _same(recon, full), name
        assert bool((covered >= 1).all()), name
        shard = per_rank[0][name].shard
        if ".qkv_proj." not in name and shard.kind != "replicated":
            # once per DP replica for TP shards, once in all for MoE-group (moe_tp / ep) shards
            assert bool((covered == len(per_rank) // shard.group_size).all()), name
    assert kinds == KINDS[case, model]


def test_tiny_glm5_tp2_direct_slices() -> None:
    """Hand-written expectations, independent of the Shard machinery's own parts."""
    gen = torch.Generator().manual_seed(1)
    r1 = EngineLayout(tp_size=2, tp_rank=1)
    emb = _random((1000, 256), BF16, gen)
    got = take_shard(emb, shard_for("model.embed_tokens.weight", emb.shape, TINY_GLM5, r1))
    assert got.shape == (512, 256) and torch.equal(got[:488], emb[512:]) and not got[488:].any()
    gu = _random((1024, 256), BF16, gen)
    got = take_shard(gu, shard_for("model.layers.0.mlp.gate_up_proj.weight", gu.shape, TINY_GLM5, r1))
    assert torch.equal(got, torch.cat([gu[256:512], gu[768:1024]]))
    w13 = _random((4, 1024, 256), BF16, gen)
    t3 = EngineLayout(tp_size=2, tp_rank=1, dp_size=2, dp_rank=1)  # MoE TP over 4, rank 3
    got = take_shard(w13, shard_for("model.layers.2.mlp.experts.w13_weight", w13.shape, TINY_GLM5, t3))
    assert torch.equal(got, torch.cat([w13[:, 384:512], w13[:, 896:1024]], dim=1))
    ep1 = EngineLayout.from_vllm(1, 0, 2, 1, enable_expert_parallel=True)
    got = take_shard(
        w13, shard_for("model.layers.2.mlp.experts.routed_experts.w13_weight", w13.shape, TINY_GLM5, ep1)
    )
    assert got.data_ptr() == w13[2:].data_ptr() and got.shape == (2, 1024, 256)  # a view
    s = shard_for("model.layers.2.mlp.experts.w2_weight_scale_inv", (4, 2, 4), TINY_GLM5, t3)
    assert (s.kind, s.dim, s.parts) == ("cols", -1, ((3, 4),))
    # GLM-4.5 qkv at tp=4: q rows r/4; KV head r // 2 (replicated twice).
    qkv = shard_for(
        "model.layers.0.self_attn.qkv_proj.weight",
        (1536, 256),
        TINY_GLM45,
        EngineLayout(tp_size=4, tp_rank=3),
    )
    assert qkv.parts == ((768, 1024), (1152, 1280), (1408, 1536))


def test_copy_shard_into_checks() -> None:
    full = torch.zeros(8, 4)
    shard = Shard("rows", -2, ((4, 8),), 0, 8, "tp", 2)
    with pytest.raises(ValueError, match="dtype"):
        copy_shard_into(torch.empty(4, 4, dtype=BF16), full, shard)
    with pytest.raises(ValueError, match=r"shape \[3, 4\]"):
        copy_shard_into(torch.empty(3, 4), full, shard)
    with pytest.raises(ValueError, match="size 8"):
        take_shard(torch.zeros(6, 4), shard)


# --- names and dtypes -----------------------------------------------------------------------------------


def test_engine_names_and_dtypes() -> None:
    assert engine_name("model.layers.3.mlp.experts.w13_weight") == P3 + E + "w13_weight"
    assert engine_name(P3 + E + "w2_weight_scale_inv") == P3 + E + "w2_weight_scale_inv"
    assert engine_name("model.layers.78.self_attn.q_b_proj.weight", GLM5) == (
        "model.layers.78.mtp_block.self_attn.q_b_proj.weight"
    )
    assert (
        engine_name("model.layers.78.mlp.experts.w13_weight", GLM5) == MTP + "mtp_block." + E + "w13_weight"
    )
    assert engine_name("model.layers.78.eh_proj.weight", GLM5) == "model.layers.78.eh_proj.weight"
    assert engine_name("lm_head.weight", GLM5) == "lm_head.weight"
    assert engine_dtype(P3 + "mlp.gate.weight", GLM5) == BF16
    assert engine_dtype(P3 + "mlp.gate.weight", TINY_GLM45) == F32
    assert engine_dtype(P3 + "self_attn.indexer.k_norm.bias", GLM5) == F32
    assert engine_dtype(P3 + "mlp.experts.w13_weight", GLM5) == FP8
    assert engine_dtype(P3 + "self_attn.q_b_proj.weight", GLM5, quantize=False) == BF16
    bf16 = engine_param_specs(TINY_GLM5, EngineLayout(tp_size=2), quantize=False)
    assert not any(n.endswith("_scale_inv") for n in bf16)
    assert bf16[P3 + E + "w13_weight"] == ((4, 512, 256), BF16)


# --- refusals -------------------------------------------------------------------------------------------


def test_refuses_unaligned_fp8_shards() -> None:
    with pytest.raises(ValueError, match=r"shared_experts\.down_proj\.weight: full size 2048 .* tp size 32"):
        shard_for(P3 + "mlp.shared_experts.down_proj.weight", (6144, 2048), GLM5, EngineLayout(tp_size=32))
    with pytest.raises(ValueError, match=r"w13_weight: .* 2048 / 32 = 64 .* refines .* not support yet"):
        shard_for(P3 + "mlp.experts.w13_weight", (256, 4096, 6144), GLM5, EngineLayout(tp_size=32))
    with pytest.raises(
        ValueError, match=r"shared_experts\.gate_up_proj\.weight_scale_inv: .* multiple of 128"
    ):
        shard_for(
            P3 + "mlp.shared_experts.gate_up_proj.weight_scale_inv", (32, 48), GLM5, EngineLayout(tp_size=32)
        )
    with pytest.raises(ValueError, match=r"self_attn\.o_proj\.weight: full size 256 .* tp size 4"):
        engine_param_specs(TINY_GLM5, EngineLayout(tp_size=4, tp_rank=1))
    # Without fp8 there is no block rule: the same layout is fine.
    assert engine_param_specs(TINY_GLM5, EngineLayout(tp_size=4, tp_rank=1), quantize=False)
    with pytest.raises(ValueError, match=r"num_attention_heads 4 is not divisible by tp_size 8"):
        engine_param_specs(TINY_GLM5, EngineLayout(tp_size=8), quantize=False)
    small_i = {**TINY_GLM5, "moe_intermediate_size": 72}
    with pytest.raises(ValueError, match="validate_fp8_block_shape_moe"):
        shard_for(P3 + "mlp.experts.w2_weight", (4, 256, 72), small_i, EngineLayout())


def test_refuses_bad_configs_and_names() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        engine_param_specs({k: v for k, v in PRESETS["glm-5"].items() if k != "vocab_size"}, EngineLayout())
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        engine_param_specs({**TINY_GLM5, "num_nextn_predict_layers": 2}, EngineLayout())
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        engine_param_specs({**TINY_GLM5, "tie_word_embeddings": True}, EngineLayout())
    with pytest.raises(ValueError, match="indexer schedule is read differently by prime-rl and vLLM"):
        engine_param_specs({**TINY_GLM5, "index_topk": 8, "index_topk_freq": 2}, EngineLayout())
    with pytest.raises(ValueError, match=r"self_attn\.bogus\.weight: not a parameter"):
        shard_for(P3 + "self_attn.bogus.weight", (4, 4), TINY_GLM5, EngineLayout())
    with pytest.raises(ValueError, match=r"q_b_proj\.weight: full kernel-format shape \[4, 4\]"):
        shard_for(P3 + "self_attn.q_b_proj.weight", (4, 4), TINY_GLM5, EngineLayout())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"dp_size": 2, "dp_rank": -1}, "dp_rank"),
        ({"ep_size": 2}, "ep_size"),
        ({"tp_size": 2, "dp_size": 2, "ep_size": 2}, "ep_size"),
        ({"tp_size": 2, "tp_rank": 1, "dp_size": 2, "ep_size": 4, "ep_rank": 2}, "ep_rank"),
        ({"tp_size": 2, "ep_size": 2, "sequence_parallel_moe": True}, "sequence_parallel_moe"),
        ({"tp_size": 1.0}, "tp_size"),
    ],
)
def test_layout_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"EngineLayout\.{field}:"):
        EngineLayout(**kwargs)


def test_layout_from_vllm() -> None:
    lay = EngineLayout.from_vllm(4, 3, dp_size=2, dp_rank=1)
    assert (lay.moe_tp_size, lay.moe_tp_rank, lay.ep_size, lay.sp_moe) == (8, 7, 1, False)
    lay = EngineLayout.from_vllm(4, 3, dp_size=2, dp_rank=1, enable_expert_parallel=True)
    assert (lay.moe_tp_size, lay.ep_size, lay.ep_rank, lay.sp_moe) == (1, 8, 7, True)
    assert EngineLayout.from_vllm(1, 0, enable_expert_parallel=True).ep_size == 1  # T = 1: no EP
    with pytest.raises(ValueError, match=r"EngineLayout\.tp_rank:"):
        EngineLayout.from_vllm(2, 5)
