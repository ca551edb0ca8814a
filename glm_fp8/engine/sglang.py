"""Where an SGLang 0.5.23 rank sits and what it calls each parameter (docs/sglang.md#layouts).

SGLang's Hopper block-FP8 parameters for GLM-5 are the kernel-format entries themselves, under two
other names: the fused ``q_a_proj``/``kv_a_proj_with_mqa`` weight is
``self_attn.fused_qkv_a_proj_with_mqa`` and the routed experts sit directly under ``mlp.experts``
(vLLM 0.34 adds a ``routed_experts.`` level). What differs is which group splits what:

- attention (``q_b_proj``, ``kv_b_proj`` rows, ``o_proj`` columns) and the embedding: the attention
  TP group, ``tp_size / attn_dp_size`` ranks (``parallel_group="attn_tp"``; the embedding's
  ``use_attn_tp_group`` under attention DP);
- the dense MLP and the shared experts: the whole TP group (``parallel_group="tp"``), or no split
  (``moe_dense_tp_size`` 1 for the dense MLP; any all-to-all MoE backend but "none" for the shared
  experts, ``DeepseekV2MoE``);
- ``lm_head``: the whole TP group, or the attention TP group with ``enable_dp_lm_head``;
- routed experts: by expert over the whole TP group (``ep_size == tp_size``) or by intermediate
  size (``ep_size`` 1); SGLang's intermediate case (EP groups that split each expert again) is
  refused here;
- the vocabulary: padded to a multiple of 64, or of 64 * size where 64 leaves rows the group cannot
  split evenly (``VocabParallelEmbedding``).

So an ``SGLangLayout`` is an ``EngineLayout`` whose ``tp_size``/``tp_rank`` are the attention TP
group's and ``dp_size``/``dp_rank`` attention DP's; its MoE group (``tp_size * dp_size``) is
SGLang's whole TP group. ``ShardRules`` asks the layout for its groups (``mlp_group``,
``vocab_group``, ``padded_vocab``), so every cut, pack and route of the transfer serves SGLang
ranks, alone or beside vLLM ranks, unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from glm_fp8.core.checks import check_int
from glm_fp8.engine.layout import VOCAB_PAD, EngineLayout
from glm_fp8.engine.rules import MTP_OWN
from glm_fp8.model.families import mtp_layer_index
from glm_fp8.model.trainer_layouts import layer_prefix

# SGLang 0.5.23's --moe-a2a-backend values (layers/moe/utils.py::MoeA2ABackend) under which
# DeepseekV2MoE builds the shared experts unsplit (parallel_group="replicated").
SHARED_EXPERTS_UNSPLIT_A2A = frozenset(
    {
        "deepep",
        "deepep_v2",
        "mooncake",
        "nixl",
        "mori",
        "ascend_fuseep",
        "flashinfer",
        "megamoe",
        "flashinfer_megamoe",
        "pplx",
    }
)
MOE_A2A_BACKENDS = SHARED_EXPERTS_UNSPLIT_A2A | {"none", "ascend_tp", "customized"}
# Model types whose SGLang 0.5.23 classes these rules were read from (models/deepseek_v2.py and
# glm4_moe.py::GlmMoeDsaForCausalLM).
SGLANG_FAMILIES = frozenset({"glm_moe_dsa"})
_DOC = "docs/sglang.md#layouts"


def _flag(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"SGLangLayout.{field}: expected a bool, got {value!r}")
    return value


@dataclass(frozen=True)
class SGLangLayout(EngineLayout):
    """One SGLang 0.5.23 rank (``from_sglang`` builds it from SGLang's server arguments).

    ``tp_size``/``tp_rank``: the attention TP group; ``dp_size``/``dp_rank``: attention DP (1/0
    without it); ``ep_size``/``ep_rank``: 1/0, or SGLang's whole TP group and this rank in it.
    ``dense_mlp_split``: the dense MLP split over the whole TP group (SGLang's default) or not
    (``moe_dense_tp_size`` 1); ``shared_experts_split``: the same for the shared experts (not with an
    all-to-all MoE backend); ``dp_lm_head``: ``lm_head`` over the attention TP group
    (``enable_dp_lm_head``) instead of the whole TP group. ``drafter``: the rank's MTP drafter
    instead of its target model (``drafter_layout``).
    """

    engine: ClassVar[str] = "sglang"

    dense_mlp_split: bool = True
    shared_experts_split: bool = True
    dp_lm_head: bool = False
    drafter: bool = False

    def __post_init__(self) -> None:
        if self.sequence_parallel_moe:
            raise ValueError(
                "SGLangLayout.sequence_parallel_moe: a vLLM setting; SGLang's unsplit dense MLP is "
                "dense_mlp_split=False"
            )
        object.__setattr__(self, "sequence_parallel_moe", False)
        super().__post_init__()
        for field in ("dense_mlp_split", "shared_experts_split", "dp_lm_head", "drafter"):
            _flag(field, getattr(self, field))

    @classmethod
    def from_sglang(
        cls,
        tp_size: int,
        tp_rank: int,
        *,
        attn_dp_size: int = 1,
        ep_size: int = 1,
        moe_dense_tp_size: int | None = None,
        moe_a2a_backend: str = "none",
        enable_dp_lm_head: bool = False,
        shared_expert_tp1: bool = False,
    ) -> SGLangLayout:
        """The layout of TP rank ``tp_rank`` of an SGLang server started with ``--tp-size tp_size``,
        ``--attn-dp-size`` (``--dp-size`` with ``--enable-dp-attention``), ``--ep-size``,
        ``--moe-dense-tp-size``, ``--moe-a2a-backend`` and ``--enable-dp-lm-head``;
        ``shared_expert_tp1``: the ``SGLANG_SHARED_EXPERT_TP1`` environment variable. Attention ranks
        follow ``runtime_context.derive_attention_ranks``: ``attn_tp_rank = tp_rank % attn_tp_size``,
        ``attn_dp_rank = tp_rank // attn_tp_size``. Raises ValueError for what SGLang refuses or
        these rules do not model, naming the argument."""
        tp = check_int("SGLangLayout.from_sglang: tp_size", tp_size, 1)
        rank = check_int("SGLangLayout.from_sglang: tp_rank", tp_rank, 0)
        dp = check_int("SGLangLayout.from_sglang: attn_dp_size", attn_dp_size, 1)
        ep = check_int("SGLangLayout.from_sglang: ep_size", ep_size, 1)
        if rank >= tp:
            raise ValueError(f"SGLangLayout.from_sglang: tp_rank {rank} is not below tp_size {tp}")
        if tp % dp:
            raise ValueError(
                f"SGLangLayout.from_sglang: attn_dp_size {dp} does not divide tp_size {tp} (SGLang's "
                "attention DP groups split its TP group)"
            )
        if ep not in (1, tp):
            raise ValueError(
                f"SGLangLayout.from_sglang: ep_size {ep} with tp_size {tp}: SGLang then splits each "
                f"expert again over {tp // ep if tp % ep == 0 else '?'} ranks inside an EP group, which "
                f"glm_fp8 does not model; use --ep-size 1 or --ep-size {tp} ({_DOC})"
            )
        if moe_dense_tp_size not in (None, 1):
            raise ValueError(
                f"SGLangLayout.from_sglang: moe_dense_tp_size {moe_dense_tp_size}: expected None "
                f"(the dense MLP over the whole TP group) or 1 (unsplit) ({_DOC})"
            )
        if moe_a2a_backend not in MOE_A2A_BACKENDS:
            raise ValueError(
                f"SGLangLayout.from_sglang: moe_a2a_backend {moe_a2a_backend!r}: expected one of "
                f"{sorted(MOE_A2A_BACKENDS)}"
            )
        attn_tp = tp // dp
        return cls(
            tp_size=attn_tp,
            tp_rank=rank % attn_tp,
            ep_size=tp if ep > 1 else 1,
            ep_rank=rank if ep > 1 else 0,
            dp_size=dp,
            dp_rank=rank // attn_tp,
            dense_mlp_split=moe_dense_tp_size != 1,
            shared_experts_split=moe_a2a_backend not in SHARED_EXPERTS_UNSPLIT_A2A
            and not _flag("shared_expert_tp1", shared_expert_tp1),
            dp_lm_head=_flag("enable_dp_lm_head", enable_dp_lm_head),
        )

    @classmethod
    def all_sglang_ranks(cls, tp_size: int, **server_args: object) -> list[SGLangLayout]:
        """Every rank of one SGLang server, in TP-rank order (``from_sglang`` takes the rest)."""
        return [cls.from_sglang(tp_size, r, **server_args) for r in range(tp_size)]

    @property
    def whole_tp(self) -> tuple[int, int]:
        """(size, rank) in SGLang's whole TP group: the MoE group."""
        return self.moe_group_size, self.moe_group_rank

    def mlp_group(self, shared: bool, model_type: str) -> tuple[int, int]:
        split = self.shared_experts_split if shared else self.dense_mlp_split
        return self.whole_tp if split else (1, 0)

    def vocab_group(self, head: bool) -> tuple[int, int]:
        if head and not self.dp_lm_head:
            return self.whole_tp
        return self.tp_size, self.tp_rank

    def indexer_form(self, config: Mapping) -> str:
        return sglang_indexer_form(config)

    @property
    def drafter_layout(self) -> SGLangLayout:
        """The same rank's MTP drafter (SGLang's ``GlmMoeDsaForCausalLMNextN``, the draft worker's
        model): its decoder layer is cut as a target decoder layer is on this rank."""
        return dataclasses.replace(self, drafter=True)

    def holds(self, config: Mapping, name: str) -> bool:
        """As ``EngineLayout.holds``; the target model holds nothing of the MTP layer (SGLang's
        drafter is a model of its own, in the draft worker: an update that carries the layer for
        vLLM ranks' drafter sends it no byte of it), the drafter only the MTP layer's entries but
        ``shared_head.head`` (it takes the target's ``lm_head``, as its embeddings)."""
        mtp = mtp_layer_index(config)
        in_mtp = mtp is not None and name.startswith(layer_prefix(mtp))
        if in_mtp != self.drafter or name.endswith(DRAFTER_SHARED):
            return False
        return super().holds(config, name)

    def padded_vocab(self, vocab: int, size: int) -> int:
        pad = VOCAB_PAD
        if math.ceil(vocab / pad) * pad % size:
            pad *= size  # VocabParallelEmbedding: "the vocab size is not divisible by the TP size"
        return math.ceil(vocab / pad) * pad


# The one MTP-layer entry SGLang's drafter does not hold (the draft worker gives it the target's
# lm_head: set_embed_and_head); the layer's other own entries sit under ``model.`` there.
DRAFTER_SHARED = "shared_head.head.weight"
DRAFTER_OWN = tuple(n for n in MTP_OWN if n != DRAFTER_SHARED)

# SGLang's fused shared expert (DeepseekV2MoE with num_fused_shared_experts 1): the routed experts'
# stacks hold it as their last expert; each stack and the shared-expert entry it stands for.
FUSED_SHARED_SLOTS = {
    "mlp.experts.w13_weight": "mlp.shared_experts.gate_up_proj.weight",
    "mlp.experts.w13_weight_scale_inv": "mlp.shared_experts.gate_up_proj.weight_scale_inv",
    "mlp.experts.w2_weight": "mlp.shared_experts.down_proj.weight",
    "mlp.experts.w2_weight_scale_inv": "mlp.shared_experts.down_proj.weight_scale_inv",
}


def sglang_params(
    params: Mapping[str, torch.Tensor], layout: SGLangLayout, fused_shared_experts: int = 0
) -> dict[str, torch.Tensor]:
    """The tensors an update lands in, under the names ``engine_params`` lists, from an SGLang model's
    parameters (``.data``, by SGLang's names): as they are; where SGLang fused the shared expert into
    the routed experts' stacks (its default on an NVIDIA GPU without EP: ``fused_shared_experts``
    1), each stack's first E experts under the stack's name and its last expert under the shared
    expert's entry, views of the same tensor. That slot holds the shared expert cut as a routed
    expert is, which without EP is the shared experts' own cut over the whole TP group. Raises
    ValueError where SGLang fuses otherwise: several shared experts, or under EP or an all-to-all
    backend (the shared expert then is not cut as a routed expert)."""
    out = dict(params)
    if not fused_shared_experts:
        return out
    if fused_shared_experts != 1 or layout.expert_parallel or not layout.shared_experts_split:
        raise ValueError(
            f"SGLang fused {fused_shared_experts} shared expert(s) into the routed experts at {layout}: "
            "glm_fp8 lands one, without EP and with the shared experts split over the whole TP group; "
            f"start the server with --disable-shared-experts-fusion ({_DOC})"
        )
    for name in [n for n in out if any(n.endswith("." + s) for s in FUSED_SHARED_SLOTS)]:
        stack = out[name]
        short = next(s for s in FUSED_SHARED_SLOTS if name.endswith("." + s))
        prefix = name[: -len(short)]
        out[name] = stack[:-1]
        out[prefix + FUSED_SHARED_SLOTS[short]] = stack[-1]
    return out


def sglang_name(kernel_name: str) -> str:
    """SGLang 0.5.23's name for a kernel-format entry: ``self_attn.fused_qkv_a_proj.*`` ->
    ``self_attn.fused_qkv_a_proj_with_mqa.*``; every other entry keeps its name (the routed
    experts' ``mlp.experts.w13_weight`` included)."""
    return kernel_name.replace(".self_attn.fused_qkv_a_proj.", ".self_attn.fused_qkv_a_proj_with_mqa.")


def sglang_drafter_name(kernel_name: str, config: Mapping) -> str:
    """The name of an MTP-layer entry in SGLang 0.5.23's drafter (``DeepseekModelNextN``, as its
    ``load_weights`` maps the checkpoint: deepseek_weight_loader.py): ``enorm``, ``hnorm``,
    ``eh_proj`` and ``shared_head.norm`` under ``model.``, the decoder layer's entries under
    ``model.decoder.`` (with ``sglang_name``'s fused attention name)."""
    prefix = layer_prefix(mtp_layer_index(config))
    if not kernel_name.startswith(prefix):
        raise ValueError(f"{kernel_name}: not an entry of the MTP layer ({prefix}*)")
    short = kernel_name[len(prefix) :]
    if short in DRAFTER_OWN:
        return "model." + short
    return sglang_name("model.decoder." + short)


def check_sglang_config(config: Mapping) -> None:
    """Refuse, naming the setting, a model whose SGLang 0.5.23 parameters these rules were not read
    for: another family."""
    if config["model_type"] not in SGLANG_FAMILIES:
        raise ValueError(
            f"config.model_type: SGLang engines are modelled for {sorted(SGLANG_FAMILIES)} only "
            f"({_DOC}), got {config['model_type']!r}"
        )


def sglang_indexer_form(config: Mapping) -> str:
    """How SGLang 0.5.23 holds GLM-5's indexer wk / weights_proj on a GPU (dsa_indexer.py,
    ``use_dsa_indexer_fusion``: CUDA and a rotary that is not NeoX-style, i.e. the config says
    ``"indexer_rope_interleave": true``, as GLM-5.2's does): "fused" into the bf16
    ``wk_weights_proj``; else "split": ``wk`` a block-FP8 linear, ``weights_proj`` bf16 (GLM-5's)."""
    return "fused" if config.get("indexer_rope_interleave") is True else "split"


def update_indexer_form(config: Mapping | None, engines: Sequence[object] | None) -> str:
    """The indexer form one update's plans take (``glm_fp8.core.vocab.IndexerForm``): what its engine
    ranks hold (``EngineLayout.indexer_form``: vLLM 0.34 "fused", SGLang ``sglang_indexer_form``),
    "fused" with none given, and "both" where some hold it fused and some split (GLM-5 into vLLM and
    SGLang servers together): the sender converts each form once, and each rank receives its own
    (``EngineLayout.holds``)."""
    if config is None or engines is None:
        return "fused"
    forms = {lay.indexer_form(config) for lay in engines if isinstance(lay, EngineLayout)}
    if not forms:
        return "fused"
    return forms.pop() if len(forms) == 1 else "both"


__all__ = [
    "MOE_A2A_BACKENDS",
    "SGLANG_FAMILIES",
    "SHARED_EXPERTS_UNSPLIT_A2A",
    "SGLangLayout",
    "FUSED_SHARED_SLOTS",
    "DRAFTER_OWN",
    "DRAFTER_SHARED",
    "check_sglang_config",
    "sglang_drafter_name",
    "sglang_indexer_form",
    "sglang_name",
    "sglang_params",
    "update_indexer_form",
]
