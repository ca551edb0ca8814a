"""Megatron-Core's ``GPTModel`` of a small GLM-5 on a CPU, for the tests and the example
(examples/megatron_update.py): what Megatron-Core 0.19 builds without CUDA, and how.

Transformer Engine's modules (TEGroupedMLP, TE linears with fused norms) need CUDA, so Megatron's
local specs build the model (SequentialMLP's ``local_experts.{j}`` names; ``MegatronSource`` maps
TEGroupedMLP's ``linear_fc1.weight{j}`` and the fused ``*.layer_norm_weight`` names too). The DSA
attention's spec functions build with Transformer Engine only, so the local decoder spec gets
Megatron's DSA attention over local linears (the indexer's duplicated linears are Megatron's own
local ``Linear``, which ``absorbed_mla`` imports only beside Transformer Engine). Its torch norms
refuse sequence parallelism, which AbsorbedMLA requires with TP, so they are built as without it
(it concerns activations and gradients, not the weights). MLA's rotary embedding asks
``torch.cuda.current_device()``, answered "cpu"; with PP and MTP the last stage's copy of the
embeddings is synced through ``.cuda()``, made a no-op. Those two patches are process-wide: call
this only in a process that runs no CUDA.

On a GPU, build the model as the trainer does (Megatron's Transformer Engine specs); glm_fp8 reads
either (``glm_fp8.integrations.megatron``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping

import torch


def tiny_glm5_gpt_model(
    config: Mapping, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1, vocab: int | None = None
):
    """Megatron-Core's ``GPTModel`` of the GLM-5 ``config`` on this rank of the default process
    group (Megatron's parallel state initialized here over TP x PP x EP x ETP), built on a CPU from
    Megatron's local specs, weights in bfloat16, seeded alike on every rank (each EP rank's experts
    its own); ``vocab``: Megatron's padded vocabulary (default the config's)."""
    torch.cuda.current_device = lambda: "cpu"  # MLA's RotaryEmbedding asks, even with CPU init
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # the embedding copies' sync (PP with MTP)
    import megatron.core.transformer.experimental_attention_variant.absorbed_mla as absorbed_mla
    from megatron.core import parallel_state as ps
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    c = config
    E, H = c["n_routed_experts"], c["hidden_size"]
    cfg = MLATransformerConfig(
        num_layers=c["num_hidden_layers"],
        hidden_size=H,
        num_attention_heads=c["num_attention_heads"],
        ffn_hidden_size=c["intermediate_size"],
        q_lora_rank=c["q_lora_rank"],
        kv_lora_rank=c["kv_lora_rank"],
        qk_head_dim=c["qk_nope_head_dim"],
        qk_pos_emb_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
        rope_type="rope",
        num_moe_experts=E,
        moe_ffn_hidden_size=c["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=c["moe_intermediate_size"] * c["n_shared_experts"],
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
        moe_router_topk=2,
        moe_layer_freq=[0] * c["first_k_dense_replace"]
        + [1] * (c["num_hidden_layers"] - c["first_k_dense_replace"]),
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        qk_layernorm=True,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
        bf16=True,
        mtp_num_layers=1,
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=c["index_n_heads"],
        dsa_indexer_head_dim=c["index_head_dim"],
        dsa_indexer_topk=64,
        dsa_indexer_rope_interleaved=True,  # GLM-5's indexer RoPE (MegatronSource refuses False)
        dsa_indexer_loss_coeff=0.0,
        moe_grouped_gemm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,  # AbsorbedMLA requires it with TP (it moves activations, not weights)
        pipeline_dtype=torch.bfloat16,
    )
    # The DSA spec functions build with Transformer Engine only: the local decoder spec, its attention
    # replaced by Megatron's DSA attention (AbsorbedMLASelfAttention, DSAttention, DSAIndexer) over
    # local linears, the indexer's duplicated ones Megatron's own local ``Linear`` (which
    # absorbed_mla imports only beside Transformer Engine).
    absorbed_mla.Linear = Linear
    # The torch norms refuse sequence parallelism (its gradient reduction, not their weights): they
    # are built as without it.
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build_norm = WrappedTorchNorm.__new__
    if not getattr(build_norm, "sequence_parallel_off", False):

        def norm_without_sp(cls, config, *args, **kwargs):
            config = copy.copy(config)
            config.sequence_parallel = False
            return build_norm(cls, config, *args, **kwargs)

        norm_without_sp.sequence_parallel_off = True
        WrappedTorchNorm.__new__ = staticmethod(norm_without_sp)

    class Local(LocalSpecProvider):
        def linear(self):
            return Linear

    plain = dataclasses.replace(cfg, experimental_attention_variant=None)
    spec = get_gpt_decoder_block_spec(plain, use_transformer_engine=False, normalization="RMSNorm")
    for layer_spec in spec.layer_specs:
        layer_spec.submodules.self_attention = get_dsa_module_spec_for_backend(cfg, Local())
    mtp = get_gpt_mtp_block_spec(cfg, spec.layer_specs[-1], use_transformer_engine=False)
    torch.manual_seed(0)
    model = GPTModel(
        cfg,
        spec,
        vocab_size=c["vocab_size"] if vocab is None else vocab,
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        mtp_block_spec=mtp,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # norms, router and bias off their ones and zeros, alike on every rank
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or "router" in name or "expert_bias" in name:
                g = torch.Generator().manual_seed(sum(map(ord, name)))
                t.copy_(torch.randn(t.shape, generator=g) * 0.5 + 1.0)
            elif "experts" in name:  # SequentialMLP's experts start alike: make each rank's its own
                t.add_(
                    torch.randn(t.shape, generator=gen).to(t.dtype)
                    * 0.01
                    * (ps.get_expert_model_parallel_rank() + 1)
                )
    return model


__all__ = ["tiny_glm5_gpt_model"]
