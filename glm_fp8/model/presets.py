"""Model configs embedded in the package: the presets of released models (``PRESETS``, read by
``load_config`` and ``glm-fp8 plan --model``, so no download is needed) and the small configs that
tests, the demo, the examples and the CPU benchmarks use (``TINY_GLM5``, ``SMALL_GLM5``,
``SMALL_CONFIGS``) and named fleets of vLLM or SGLang servers (``FLEETS``, read by
``glm-fp8 plan --fleet``). Plain data validated by ``glm_fp8.model.config.as_config``; the rules that read a
config are ``glm_fp8.model.families``'.
"""

from __future__ import annotations

from glm_fp8.model.config import as_config

# Embedded configs (the fields the plans read), so `glm-fp8 plan` needs no download.
PRESETS: dict[str, dict] = {
    # docs/layouts.md. GLM's config.json files (glm_moe_dsa and glm4_moe, as public copies and test
    # fixtures of them show) say "topk_method": "noaux_tc": vLLM then builds the routing bias.
    "glm-5": {
        "model_type": "glm_moe_dsa",
        "hidden_size": 6144,
        "num_hidden_layers": 78,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "intermediate_size": 12288,
        "num_attention_heads": 64,
        "q_lora_rank": 2048,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "vocab_size": 154880,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
    },
    "glm-4.5": {  # zai-org/GLM-4.5 config.json
        "model_type": "glm4_moe",
        "hidden_size": 5120,
        "num_hidden_layers": 92,
        "first_k_dense_replace": 3,
        "n_routed_experts": 160,
        "moe_intermediate_size": 1536,
        "n_shared_experts": 1,
        "intermediate_size": 12288,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_bias": True,
        "use_qk_norm": True,
        "topk_method": "noaux_tc",
    },
    # zai-org/GLM-5.2 config.json (https://huggingface.co/zai-org/GLM-5.2/raw/main/config.json, as
    # recorded in public test fixtures; retrieved 2026-06-17 by them): GLM-5's widths, IndexShare with a
    # full indexer in layers 0-2 and every 4th layer from 6 (21 full, 57 shared; vLLM's offset rule
    # with index_topk_freq 4, index_skip_topk_offset 3 gives the same), max_position_embeddings 1048576.
    "glm-5.2": {
        "model_type": "glm_moe_dsa",
        "hidden_size": 6144,
        "num_hidden_layers": 78,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "intermediate_size": 12288,
        "num_attention_heads": 64,
        "q_lora_rank": 2048,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 2048,
        "index_topk_freq": 4,
        # GLM-5.2's config.json: the indexer's rotary interleaved (SGLang 0.5.23 then fuses the indexer's
        # wk and weights_proj as vLLM does, dsa_indexer.py; its comment names GLM-5.2)
        "indexer_rope_interleave": True,
        "index_skip_topk_offset": 3,
        "index_topk_pattern": None,
        "indexer_types": ["full" if i < 3 or (i - 2) % 4 == 0 else "shared" for i in range(78)],
        "vocab_size": 154880,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
    },
    "deepseek-v3": {  # deepseek-ai/DeepSeek-V3 config.json (DeepseekV3ForCausalLM)
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "intermediate_size": 18432,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
    },
    "deepseek-v3.2": {  # deepseek-ai/DeepSeek-V3.2 config.json (DeepseekV32ForCausalLM): V3 + the indexer
        "model_type": "deepseek_v32",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "intermediate_size": 18432,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 2048,
        "vocab_size": 129280,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
    },
    "kimi-k2": {  # moonshotai/Kimi-K2-Instruct config.json (DeepseekV3ForCausalLM, model_type kimi_k2)
        "model_type": "kimi_k2",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 1,
        "n_routed_experts": 384,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "intermediate_size": 18432,
        "num_attention_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 163840,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
    },
    "qwen3-moe": {  # Qwen/Qwen3-235B-A22B config.json (Qwen3MoeForCausalLM)
        "model_type": "qwen3_moe",
        "hidden_size": 4096,
        "num_hidden_layers": 94,
        "num_experts": 128,
        "moe_intermediate_size": 1536,
        "intermediate_size": 12288,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "attention_bias": False,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
}


# Named fleets (``glm-fp8 plan --fleet``; ``glm_fp8.planning.fleet.fleet_preset`` builds the ``Fleet``): the
# model they update, the trainer's GPUs, every GPU's NIC (Gb/s) and the vLLM servers (``Server``'s
# fields; ranks per replica TP x DP, EP over all of them when on). Plain data, as the configs above.
FLEETS: dict[str, dict] = {
    # Shaped like prime-rl's GLM-5.2 recipe: 16 trainer nodes of 8 H200; 2 replicas of a 4-node
    # prefill server and a 4-node decode server (disaggregated prefill and decode: four vLLM
    # servers). Prefill TP 8 x DP 4 needs EP (vLLM refuses MoE TP 32: 2048 / 32 = 64 intermediate
    # rows per rank, below the 128 of a scale block); decode is DP 32 with EP 32.
    "prime-rl-glm-5.2": {
        "model": "glm-5.2",
        "trainer_gpus": 128,
        "link_gbps": 400.0,
        "servers": (
            {"name": "prefill", "tp": 8, "dp": 4, "ep": True, "replicas": 2},
            {"name": "decode", "tp": 1, "dp": 32, "ep": True, "replicas": 2},
        ),
    },
    # miles' GLM-5 deployment (radixark/miles docs/advanced/p2p-weight-transfer.md: 58.3 s with NCCL
    # broadcast, 8.48 s with RDMA P2P, H100 + InfiniBand): Megatron-Core on 16 nodes of 8 H100, TP 4,
    # PP 8, CP 2, EP 16; 16 serving nodes as TP 64 / EP 64 (SGLang, attention DP), here vLLM's
    # equivalent: 2 servers of TP 8 x DP 8 with EP 64.
    "miles-glm-5": {
        "model": "glm-5",
        "trainer_gpus": 128,
        "link_gbps": 400.0,
        "trainer": "megatron:tp4,pp8,cp2,ep16",
        "servers": ({"tp": 8, "dp": 8, "ep": True, "replicas": 2},),
    },
    # miles' GLM-5 deployment (above) with its SGLang servers (docs/sglang.md#plan): 2 servers of 8
    # nodes, TP 64 with attention DP 64 and EP 64 over DeepEP, the dense MLP unsplit
    # (--moe-dense-tp-size 1), as SGLang's large-EP DeepSeek recipes run them; how miles splits
    # attention is not published.
    "miles-glm-5-sglang": {
        "model": "glm-5",
        "trainer_gpus": 128,
        "link_gbps": 400.0,
        "trainer": "megatron:tp4,pp8,cp2,ep16",
        "servers": (
            {
                "engine": "sglang",
                "tp": 64,
                "dp": 64,
                "ep": True,
                "moe_dense_tp_size": 1,
                "moe_a2a_backend": "deepep",
                "replicas": 2,
            },
        ),
    },
    # GLM-5 from 32 trainer H200 into 4 servers of one node each at EP 8 (docs/update_time.md).
    "glm-5-4xep8": {
        "model": "glm-5",
        "trainer_gpus": 32,
        "link_gbps": 400.0,
        "servers": ({"tp": 8, "dp": 1, "ep": True, "replicas": 4},),
    },
}

# GLM-5 with every width divided by 24 (hidden 256, 11 experts): the demo's and the CPU
# benchmarks' model, small enough for Triton's CPU interpreter.
SMALL_GLM5 = {
    "model_type": "glm_moe_dsa",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 11,
    "moe_intermediate_size": 88,
    "n_shared_experts": 1,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "q_lora_rank": 88,
    "kv_lora_rank": 24,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 12,
    "index_n_heads": 2,
    "index_head_dim": 8,
    "topk_method": "noaux_tc",
}

# Each preset scaled down with sizes that are not multiples of 128, so that blocks straddle
# every concatenation: the converter's test configs.
SMALL_CONFIGS = {
    "glm-5": {
        **PRESETS["glm-5"],
        "hidden_size": 200,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "n_routed_experts": 3,
        "moe_intermediate_size": 72,
        "intermediate_size": 150,
        "num_attention_heads": 2,
        "q_lora_rank": 130,
        "kv_lora_rank": 70,
        "qk_nope_head_dim": 24,
        "qk_rope_head_dim": 8,
        "v_head_dim": 40,
        "index_n_heads": 3,
        "index_head_dim": 24,
    },
    "glm-4.5": {
        **PRESETS["glm-4.5"],
        "hidden_size": 200,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "n_routed_experts": 3,
        "moe_intermediate_size": 72,
        "intermediate_size": 150,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 40,
    },
}
_SMALL_MLA = {
    "hidden_size": 200,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "n_routed_experts": 3,
    "moe_intermediate_size": 72,
    "intermediate_size": 150,
    "num_attention_heads": 2,
    "q_lora_rank": 130,
    "kv_lora_rank": 70,
    "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 8,
    "v_head_dim": 40,
}
SMALL_CONFIGS.update(
    {
        # layers: 0 dense + indexer, 1 sparse without one (shared), 2 sparse + indexer
        "glm-5.2": {**SMALL_CONFIGS["glm-5"], "index_topk": 64, "indexer_types": ["full", "shared", "full"]},
        "deepseek-v3": {**PRESETS["deepseek-v3"], **_SMALL_MLA},
        "deepseek-v3.2": {**PRESETS["deepseek-v3.2"], **_SMALL_MLA, "index_n_heads": 3, "index_head_dim": 24},
        "kimi-k2": {**PRESETS["kimi-k2"], **_SMALL_MLA, "n_routed_experts": 5},
        "qwen3-moe": {
            **PRESETS["qwen3-moe"],
            "hidden_size": 200,
            "num_hidden_layers": 3,
            "num_experts": 3,
            "moe_intermediate_size": 72,
            "intermediate_size": 150,
            "mlp_only_layers": [0],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 40,
        },
    }
)


# GLM-5 shrunk so that every width vLLM shards is a multiple of 128 per rank at TP=2, EP=2 and
# TP=2 x DP=2 without EP (MoE TP over 4: moe_intermediate 512 / 4 = 128); vocab 1000 is not a
# multiple of 64 (padded to 1024). At TP=4 o_proj's 256 columns give 64 per rank: refused.
TINY_GLM5 = {
    "model_type": "glm_moe_dsa",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "moe_intermediate_size": 512,
    "n_shared_experts": 1,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "index_n_heads": 2,
    "index_head_dim": 64,
    "vocab_size": 1000,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
}


def load_config(model: str | None = None, config_path: object = None) -> dict:
    """A preset by name (``PRESETS``: "glm-5", "glm-5.2", "glm-4.5", "deepseek-v3", ...) or a
    model config (``config_path``: a config.json's path, or anything ``as_config`` takes),
    validated (``glm_fp8.model.config.as_config``)."""
    if config_path is not None:
        return as_config(config_path)
    if model not in PRESETS:
        raise ValueError(f"model: expected one of {sorted(PRESETS)}, got {model!r}")
    return as_config(PRESETS[model])
