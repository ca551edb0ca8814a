"""Megatron-Core trainers (docs/trainers.md#megatron-core): a rank's ``GPTModel`` (or its
virtual-pipeline chunks) as the layers ``Sender.send_model`` takes, and who sends what.

Every rank that holds a piece sends it: the ranks of expert-data-parallel rank 0 (and the rest of
their TP groups) are the senders; each pipeline stage's senders hold that stage's layers
(``SendOptions.holders``), each its own experts (contiguous, ``ep_rank * E / EP + j``:
per-expert tensors, views of Megatron's own, never stacked); a tensor-parallel tensor travels as
a ``DTensor`` over Megatron's TP group, gathered onto the one sender that owns its entry.
Megatron's names become the checkpoint's here (``MEGATRON_NAMES``); nothing is converted to
Hugging Face tensors first. Megatron-Core is imported only by ``MegatronParallel.current`` (its
``parallel_state``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from glm_fp8.model.config import as_config
from glm_fp8.model.families import REST, is_sparse_layer, layer_shapes, model_layer_ids, mtp_layer_index
from glm_fp8.model.plans import plan_from_config
from glm_fp8.transfer.owners import stack_entries
from glm_fp8.transfer.routes import stage_order

# A decoder layer's Megatron-Core tensors (names inside the layer module) and the checkpoint's names
# (inside ``model.layers.{i}.``). Several Megatron names for one tensor: Transformer Engine's specs
# fuse a norm into the linear that follows it (``*.layer_norm_weight``), the local specs keep it
# separate. Sources: megatron/core/models/gpt/gpt_layer_specs.py (its ``sharded_state_dict_keys_map``
# ties the fused names to the separate ones) and multi_latent_attention.py, megatron-core 0.19.2;
# the checkpoint's names: transformers' DeepSeek-V3 / GLM-5 modules.
MEGATRON_NAMES: dict[str, str] = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_q_down_proj.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_q_proj.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
# The DSA indexer (experimental_attention_variant "dsa"), inside ``self_attention.core_attention``.
# Its rows are [rope; nope] per head in megatron-core 0.19.2 (dsa.py: "x_pe is placed at the
# front"), as in transformers' GlmMoeDsaIndexer and vLLM's indexer: no row permutation.
MEGATRON_NAMES.update(
    {
        f"self_attention.core_attention.indexer.{megatron}": f"self_attn.indexer.{checkpoint}"
        for megatron, checkpoint in [
            ("linear_wq_b.weight", "wq_b.weight"),
            ("linear_wk.weight", "wk.weight"),
            ("k_norm.weight", "k_norm.weight"),
            ("k_norm.bias", "k_norm.bias"),
            ("linear_weights_proj.weight", "weights_proj.weight"),
        ]
    }
)
# [gate; up] stacked on dim 0 (each TP shard holds [gate_i; up_i]): split into the two checkpoint
# tensors, each a view of its half of the shard.
MEGATRON_GATE_UP: dict[str, tuple[str, str]] = {
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.shared_experts.linear_fc1.weight": (
        "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight",
    ),
}
# The MTP layer's own tensors (``mtp.layers.{i}.*``; its decoder layer is ``mtp_model_layer.*``).
MEGATRON_MTP_NAMES: dict[str, str] = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
# Local experts: TEGroupedMLP's ``linear_fc1.weight{j}``, SequentialMLP's ``local_experts.{j}.*``.
_EXPERT = re.compile(
    r"^mlp\.experts\.(?:linear_fc([12])\.weight(\d+)|local_experts\.(\d+)\.linear_fc([12])\.weight)$"
)
# Megatron tensors the engine has no parameter for, or that Megatron keeps twice.
_SKIPPED = ("self_attention.linear_kv_down_proj.layer_norm_weight",)


@dataclass(frozen=True)
class MegatronParallel:
    """One Megatron-Core rank's place: its tensor-parallel group, pipeline stage, expert-parallel
    rank, expert-data-parallel rank (which replica of the experts it holds) and expert
    tensor-parallel group (its part of each of its experts' rows)."""

    tp_group: object
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    ep_rank: int
    ep_size: int
    etp_size: int
    edp_rank: int
    etp_group: object = None
    etp_rank: int = 0

    @classmethod
    def current(cls) -> MegatronParallel:
        """This rank's place as Megatron-Core's ``parallel_state`` holds it (initialized)."""
        from megatron.core import parallel_state as ps

        return cls(
            tp_group=ps.get_tensor_model_parallel_group(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            edp_rank=ps.get_expert_data_parallel_rank(),
            etp_group=ps.get_expert_tensor_parallel_group(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
        )


@dataclass(frozen=True)
class _Place:
    """What every rank learns of every other at ``MegatronSource``'s construction."""

    rank: int
    tp_group: tuple[int, ...]
    tp_rank: int
    pp_rank: int
    ep_rank: int
    edp_rank: int
    etp_rank: int
    layers: tuple[int, ...]
    embedding: bool
    head: bool
    error: str | None = None


class MegatronSource:
    """A Megatron-Core rank's model as glm_fp8's layers. Collective: every rank of the trainer's
    default group builds one, with the same ``config``.

    Args:
        model: the rank's ``GPTModel``, or its virtual-pipeline chunks (a list; DDP / Float16
            wrappers are unwrapped through ``.module``).
        config: the checkpoint's config (``glm_fp8.model.config``): names, shapes and layer kinds
            are checked against it.
        parallel: this rank's ``MegatronParallel`` (default: ``MegatronParallel.current()``).

    Attributes: ``senders`` (the trainer ranks that send, ascending: expert-data-parallel rank 0
    and the rest of their TP groups; sender k is link rank k), ``is_sender``, ``link_rank``,
    ``layer_ids`` (every decoder layer, then the MTP layer the model holds), ``stage_layer_ids``
    (the same, one layer of each pipeline stage in turn: the order for ``step_layers`` > 1, so that
    a step carries one layer of each stage), ``holders``
    (``SendOptions.holders``, in link ranks: by layer, the senders of its stage, in expert order;
    per entry where they differ: the non-layer tensors, the MTP layer's head, the expert stacks
    under ETP or a TP wider than EP). A sender opens its link at ``link_rank`` with
    ``global_ranks=source.senders`` (``StoreLink``: where the TP groups' DTensors live), passes
    ``senders=range(len(source.senders)), layer_ids=source.layer_ids, holders=source.holders,
    rest=True`` to its ``Sender`` and ``source.layers()``, ``rest=source.rest()`` to
    ``send_model``. One sender instead (broadcast, scatter): ``whole_layers`` and ``whole_rest`` on
    it, ``contribute_whole`` on every other trainer rank. Through vLLM's weight-transfer backend,
    pass the source as ``source=``: it does all that, with many senders (docs/vllm.md).

    Expert tensor parallelism (``expert_tensor_parallel_size`` > 1): each expert's rows are
    gathered onto its ETP rank 0 (its [gate_i; up_i] shards reordered to [gate; up], ``linear_fc2``
    joined along its columns), which sends the expert stacks; the other ETP ranks send their share
    of the other entries. Refused at construction, naming the Megatron option: a shared-expert gate
    (``moe_shared_expert_gate``), experts not divisible by expert parallelism, a layer whose MoE /
    dense kind differs from the config's (``moe_layer_freq`` against ``first_k_dense_replace``),
    tied embeddings (``share_embeddings_and_output_weights``) against an untied config, GLM-5's
    indexer without interleaved RoPE (``dsa_indexer_rope_interleaved``), MTP layers the config
    does not have (``mtp_num_layers``); a refusal on one rank is raised on every rank (it is part
    of the construction's one exchange). A tensor the name table does not map, or whose shape is
    neither the checkpoint's nor 1/TP of it, is refused at the step that reads it (voted: every
    rank stops there).
    """

    def __init__(self, model: object, config: Mapping, parallel: MegatronParallel | None = None):
        self.config = as_config(config)
        self.parallel = parallel if parallel is not None else MegatronParallel.current()
        self._layers: dict[int, torch.nn.Module] = {}
        self._mtp: dict[int, torch.nn.Module] = {}
        self._embedding = self._head = self._norm = None
        self._tp_mesh = None
        try:
            self._read(model)
            err = None
        except ValueError as exc:  # one stage's layers may be refused, the others' not
            err = exc
        self._places = self._exchange(err)
        refused = [(q.rank, q.error) for q in self._places if q.error is not None]
        if refused:  # every rank raises, within the exchange: none waits for a rank that stopped
            if err is not None:
                raise err
            rank, why = refused[0]
            raise ValueError(f"trainer rank {rank} refused its Megatron model: {why}")
        self._plan_senders()

    def _read(self, model: object) -> None:
        """This rank's model chunks: its decoder layers, MTP layer, embeddings, final norm and
        head; ValueError naming a Megatron option glm_fp8 does not map."""
        p = self.parallel
        chunks = [_unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
        n_layers = self.config["num_hidden_layers"]
        self.n_experts = _experts(self.config)
        if self.n_experts and self.n_experts % p.ep_size:
            raise ValueError(
                f"expert_model_parallel_size: {p.ep_size} does not divide the {self.n_experts} routed experts"
            )
        mtp_idx = mtp_layer_index(self.config)
        for c in chunks:
            mc = getattr(c, "config", None)
            if mc is not None and getattr(mc, "moe_shared_expert_gate", False):
                raise ValueError(
                    "moe_shared_expert_gate: a shared-expert gate has no parameter in the engine"
                )
            dsa = mc is not None and getattr(mc, "experimental_attention_variant", None) == "dsa"
            if dsa and self.config["model_type"] == "glm_moe_dsa" and not mc.dsa_indexer_rope_interleaved:
                raise ValueError(
                    "dsa_indexer_rope_interleaved: False, but GLM-5's indexer applies interleaved RoPE "
                    "(transformers' GlmMoeDsaIndexer, vLLM): the engine would score with other positions "
                    "than the trainer; train with dsa_indexer_rope_interleaved=True"
                )
            if getattr(c, "share_embeddings_and_output_weights", False) and not self.config.get(
                "tie_word_embeddings", False
            ):
                raise ValueError(
                    "share_embeddings_and_output_weights: Megatron ties the embeddings and the head, "
                    "the config (tie_word_embeddings) does not"
                )
            decoder = getattr(c, "decoder", None)
            for layer in getattr(decoder, "layers", []):
                idx = int(layer.layer_number) - 1
                if not 0 <= idx < n_layers:
                    raise ValueError(
                        f"decoder layer {layer.layer_number}: beyond the config's {n_layers} layers"
                    )
                self._layers[idx] = layer
            if decoder is not None and getattr(decoder, "final_layernorm", None) is not None:
                self._norm = decoder.final_layernorm.weight
            mtp = getattr(c, "mtp", None)
            for i, layer in enumerate(getattr(mtp, "layers", [])):
                if mtp_idx is None or i > 0:
                    raise ValueError(
                        f"mtp_num_layers: the model has MTP layer {i}, the config "
                        f"(num_nextn_predict_layers) {'none' if mtp_idx is None else 'one'}"
                    )
                self._mtp[mtp_idx] = layer
            emb = getattr(c, "embedding", None)
            if emb is not None and getattr(c, "pre_process", True):
                self._embedding = emb.word_embeddings.weight
            if getattr(c, "output_layer", None) is not None and getattr(c, "post_process", True):
                self._head = c.output_layer.weight
        for idx, layer in self._layers.items():
            sparse = any(n.startswith("mlp.router.") for n, _ in layer.named_parameters())
            if sparse != is_sparse_layer(self.config, idx):
                raise ValueError(
                    f"moe_layer_freq: Megatron's layer {idx} is {'an MoE' if sparse else 'a dense'} layer, "
                    f"the config's is {'sparse' if not sparse else 'dense'} (first_k_dense_replace / "
                    "mlp_layer_types)"
                )

    # -- who sends what --------------------------------------------------------------------

    def _exchange(self, err: BaseException | None) -> list[_Place]:
        """Every rank's ``_Place`` (and its refusal, if any), on every rank: collective over the
        trainer's default group."""
        p = self.parallel
        tp_ranks = tuple(dist.get_process_group_ranks(p.tp_group)) if p.tp_size > 1 else (dist.get_rank(),)
        mine = _Place(
            dist.get_rank(),
            tp_ranks,
            p.tp_rank,
            p.pp_rank,
            p.ep_rank,
            p.edp_rank,
            p.etp_rank,
            tuple(sorted(self._layers) + sorted(self._mtp)),
            self._embedding is not None,
            self._head is not None,
            None if err is None else str(err),
        )
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return out

    def _plan_senders(self) -> None:
        places = self._places
        # The ranks of expert-data-parallel rank 0, and the rest of their TP groups (TP wider than
        # EP): those send their share of the TP tensors, never their copies of the experts.
        first = [q for q in places if q.edp_rank == 0]
        wanted = {q.rank for q in first} | {r for q in first for r in q.tp_group}
        senders = [q for q in places if q.rank in wanted]
        self.senders = [q.rank for q in senders]
        self.is_sender = dist.get_rank() in self.senders
        n_layers = self.config["num_hidden_layers"]
        self.layer_ids = model_layer_ids(
            self.config, mtp=any(q.layers and max(q.layers) >= n_layers for q in places)
        )
        by_layer: dict[int, list[_Place]] = {}
        for q in senders:
            for idx in q.layers:
                by_layer.setdefault(idx, []).append(q)
        stage_of = {idx: held[0].pp_rank for idx, held in by_layer.items()}
        self.stage_layer_ids = stage_order(self.layer_ids, stage_of)
        holders: dict[int, object] = {}
        for idx in self.layer_ids:
            held = sorted(by_layer.get(idx, []), key=lambda q: (q.ep_rank, q.rank))
            if not held:
                raise ValueError(f"layer {idx}: no trainer rank holds it (pipeline stages)")
            holders[idx] = [q.rank for q in held]
            experts = [q.rank for q in held if q.edp_rank == 0 and q.etp_rank == 0]
            if experts != holders[idx]:  # ETP, or TP wider than EP: the stacks on their own ranks
                stacks = {e.name for e in stack_entries(plan_from_config(self.config, idx))}
                if stacks:
                    holders[idx] = {
                        e.name: experts if e.name in stacks else holders[idx]
                        for e in plan_from_config(self.config, idx).entries
                    }
        mtp_idx = mtp_layer_index(self.config)
        if mtp_idx in holders:  # the head on its stage's TP group, whole or split by rows
            held = holders[mtp_idx]
            stage = held if isinstance(held, list) else held["input_layernorm.weight"]
            head = self._tp_ranks(lambda q: q.head and q.rank in stage, "the MTP layer's head")
            holders[mtp_idx] = {
                e.name: head
                if e.name == "shared_head.head.weight"
                else (held if isinstance(held, list) else held[e.name])
                for e in plan_from_config(self.config, mtp_idx).entries
            }
        holders[REST] = {
            "model.embed_tokens.weight": self._tp_ranks(lambda q: q.embedding, "the embeddings"),
            "model.norm.weight": self._tp_ranks(lambda q: q.head, "the final norm")[:1],
            "lm_head.weight": self._tp_ranks(lambda q: q.head, "the output layer"),
        }
        self._held = holders  # in trainer ranks
        link = {r: k for k, r in enumerate(self.senders)}  # sender k is link rank k
        self.holders = {
            idx: {e: [link[r] for r in ranks] for e, ranks in h.items()}
            if isinstance(h, dict)
            else [link[r] for r in h]
            for idx, h in holders.items()
        }

    @property
    def link_rank(self) -> int | None:
        """This rank's link rank (its place among the senders), None when it does not send."""
        return self.senders.index(dist.get_rank()) if self.is_sender else None

    def _tp_ranks(self, pred, what: str) -> list[int]:
        """The TP group (by TP rank) of the first sender ``pred`` holds: where a vocabulary-parallel
        tensor lies whole."""
        q = next((q for q in self._places if q.edp_rank == 0 and pred(q)), None)
        if q is None:
            raise ValueError(f"{what}: no sending trainer rank holds it")
        return list(q.tp_group)

    # -- the tensors ------------------------------------------------------------------------

    def layers(self, layer_ids=None) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """``(layer_idx, tensors)`` for every layer of ``layer_ids`` (default: ``self.layer_ids``)
        in order: this rank's share under the checkpoint's names (nothing of a layer it does not
        hold, or when it does not send)."""
        for idx in self.layer_ids if layer_ids is None else layer_ids:
            if not self.is_sender:
                yield idx, {}
            elif idx in self._layers:
                yield idx, self._layer(self._layers[idx], "")
            elif idx in self._mtp:
                yield idx, self._mtp_layer(self._mtp[idx], idx)
            else:
                yield idx, {}

    def whole_layers(self, layer_ids=None, dst: int = 0) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """For the one-sender modes (broadcast, scatter): ``(layer_idx, tensors)`` for every layer
        of ``layer_ids`` (default: ``self.layer_ids``) in order, every tensor of the layer whole
        under the checkpoint's name on trainer rank ``dst`` (the link's one sender), nothing on the
        other ranks. Collective over the trainer's default group, layer by layer: every rank
        iterates it (the sender as ``send_model`` pulls it; the others with ``contribute_whole``).
        Each piece moves once to ``dst`` (a TP-split tensor gathered on its TP group first), from
        the lowest rank that holds it; ``dst`` holds one layer's tensors at a time."""
        for idx, mine in self.layers(layer_ids):
            yield idx, self._onto(mine, dst)

    def whole_rest(self, dst: int = 0) -> dict[str, torch.Tensor]:
        """The non-layer tensors, whole, on trainer rank ``dst`` (``whole_layers``); collective."""
        return self._onto(self.rest(), dst)

    def contribute_whole(self, layer_ids=None, dst: int = 0) -> None:
        """On every trainer rank but ``dst``, while ``dst`` runs ``send_model(source.whole_layers(),
        rest=source.whole_rest())``: its part of both, in that order (``rest=`` is read first)."""
        self.whole_rest(dst)
        for _ in self.whole_layers(layer_ids, dst):
            pass

    def _onto(self, mine: Mapping[str, torch.Tensor], dst: int) -> dict[str, torch.Tensor]:
        """``mine`` (this rank's share: ``layers`` / ``rest``) whole on rank ``dst``: every rank
        says what it holds, then each tensor goes once, from the lowest rank that holds it, in one
        order on every rank; {} elsewhere."""
        from torch.distributed.tensor import DTensor

        # A TP-split tensor whole on each rank of its group (collective there, in the layer's order)
        whole = {k: (t.full_tensor() if isinstance(t, DTensor) else t) for k, t in mine.items()}
        offers: list = [None] * dist.get_world_size()
        dist.all_gather_object(
            offers, [(k, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in whole.items()]
        )
        source: dict[str, tuple] = {}
        for r, held in enumerate(offers):
            for k, shape, dtype in held:
                source.setdefault(k, (r, shape, dtype))
        me = dist.get_rank()
        device = next(iter(whole.values())).device if whole else self._device()
        out: dict[str, torch.Tensor] = {}
        for k in sorted(source):
            r, shape, dtype = source[k]
            if me == dst and r == dst:
                out[k] = whole[k]
            elif me == dst:
                out[k] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                dist.recv(out[k], src=r)
            elif me == r:
                dist.send(whole[k].contiguous(), dst=dst)
        return out

    def _device(self) -> torch.device:
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def rest(self) -> dict[str, torch.Tensor]:
        """The non-layer tensors this rank sends: the embeddings (first stage), the final norm and
        the head (last stage); a vocabulary-parallel tensor as a DTensor over the TP group, or
        gathered whole and cut to the config's vocabulary when Megatron padded it."""
        out: dict[str, torch.Tensor] = {}
        if not self.is_sender:
            return out
        me, held = dist.get_rank(), self._held[REST]
        if self._embedding is not None and me in held["model.embed_tokens.weight"]:
            out["model.embed_tokens.weight"] = self._vocab(self._embedding)
        if self._norm is not None and me in held["model.norm.weight"]:
            out["model.norm.weight"] = self._norm.detach()
        if self._head is not None and me in held["lm_head.weight"]:
            out["lm_head.weight"] = self._vocab(self._head)
        return out

    def _layer(self, module: torch.nn.Module, prefix: str, idx: int | None = None) -> dict[str, torch.Tensor]:
        """A decoder layer's tensors under the checkpoint's names: this rank's experts as
        per-expert views, the rest as they are or (split over TP) DTensors."""
        idx = int(module.layer_number) - 1 if idx is None else idx
        shapes = _checkpoint_shapes(self.config, idx)
        out: dict[str, torch.Tensor] = {}
        e_local = self.n_experts // self.parallel.ep_size if self.n_experts else 0
        for name, t in _tensors(module):
            t = t.detach()
            m = _EXPERT.match(name)
            if m is not None:
                if self.parallel.edp_rank > 0:  # a copy of experts another sender sends
                    continue
                fc = m.group(1) or m.group(4)
                g = self.parallel.ep_rank * e_local + int(
                    m.group(2) if m.group(2) is not None else m.group(3)
                )
                parts = self._expert_parts(t)  # ETP: every rank's rows, on ETP rank 0 only
                if parts is None:
                    continue
                if fc == "1":  # each part [gate_i; up_i]: all gates, then all ups
                    halves = [x.chunk(2, dim=0) for x in parts]
                    gate = halves[0][0] if len(parts) == 1 else torch.cat([h[0] for h in halves])
                    up = halves[0][1] if len(parts) == 1 else torch.cat([h[1] for h in halves])
                    out[f"mlp.experts.{g}.gate_proj.weight"] = gate
                    out[f"mlp.experts.{g}.up_proj.weight"] = up
                else:
                    down = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
                    out[f"mlp.experts.{g}.down_proj.weight"] = down
            elif name in MEGATRON_GATE_UP:
                gate, up = t.chunk(2, dim=0)  # this TP shard's [gate_i; up_i]
                for key, half in zip(MEGATRON_GATE_UP[name], (gate, up)):
                    out[key] = self._placed(prefix + name, key, half, shapes)
            elif name in MEGATRON_NAMES:
                key = MEGATRON_NAMES[name]
                if key not in out:  # a norm Megatron holds twice (fused and plain) goes once
                    out[key] = self._placed(prefix + name, key, t, shapes)
            elif name in _SKIPPED:
                continue
            else:
                raise KeyError(
                    f"{prefix}{name}: a Megatron-Core tensor glm_fp8 does not map "
                    "(docs/trainers.md#megatron-core)"
                )
        return out

    def _expert_parts(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """An expert tensor's pieces over its expert tensor-parallel group, in ETP rank order: the
        local tensor alone without ETP (a view, no copy); with it, gathered onto ETP rank 0 (the
        copy: this rank's experts of the layer, whole), None on the other ETP ranks, which hold
        none of the expert stacks (``holders``)."""
        p = self.parallel
        if p.etp_size == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(p.etp_size)] if p.etp_rank == 0 else None
        dist.gather(t.contiguous(), parts, group=p.etp_group, group_dst=0)
        return parts

    def _mtp_layer(self, module: torch.nn.Module, idx: int) -> dict[str, torch.Tensor]:
        shapes = _checkpoint_shapes(self.config, idx)
        out = self._layer(module.mtp_model_layer, "mtp_model_layer.", idx)
        for name, t in _tensors(module):
            if name in MEGATRON_MTP_NAMES:
                key = MEGATRON_MTP_NAMES[name]
                out[key] = self._placed(name, key, t.detach(), shapes)
        head = self._held[idx]["shared_head.head.weight"]
        if self._head is not None and dist.get_rank() in head:
            out["shared_head.head.weight"] = self._vocab(self._head)
        return out

    def _placed(self, name: str, key: str, t: torch.Tensor, shapes: Mapping[str, tuple[int, ...]]):
        """``t`` (this rank's piece of ``key``) as it is when whole, else a DTensor over the TP
        group, split along the one dim where it is ``1 / TP`` of the checkpoint's shape."""
        want = tuple(shapes[key])
        if tuple(t.shape) == want:
            return t
        tp = self.parallel.tp_size
        dims = [d for d in range(t.dim()) if t.shape[d] != want[d]] if t.dim() == len(want) else []
        if tp == 1 or len(dims) != 1 or t.shape[dims[0]] * tp != want[dims[0]]:
            raise ValueError(
                f"{name}: Megatron holds {tuple(t.shape)} of {key} {want} at tensor-parallel size {tp}; "
                "expected the whole tensor or 1/TP of one dim (docs/trainers.md#megatron-core)"
            )
        return self._tp(t, dims[0])

    def _tp(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The local shard ``t`` of a tensor split evenly along ``dim`` over the TP group, as a
        DTensor (no copy)."""
        from torch.distributed.tensor import DTensor, Shard

        shape = list(t.shape)
        shape[dim] *= self.parallel.tp_size
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            t, self._mesh(), [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=stride
        )

    def _mesh(self):
        if self._tp_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            nccl = dist.get_backend(self.parallel.tp_group) == "nccl"
            self._tp_mesh = DeviceMesh.from_group(self.parallel.tp_group, "cuda" if nccl else "cpu")
        return self._tp_mesh

    def _vocab(self, t: torch.Tensor) -> torch.Tensor:
        """A vocabulary-parallel tensor (rows split over TP): a DTensor when the split is of the
        config's vocabulary, else gathered on every TP rank and cut to it (Megatron pads the
        vocabulary to a multiple of its TP size: ``make_vocab_size_divisible_by``)."""
        t = t.detach()
        vocab, tp = self.config["vocab_size"], self.parallel.tp_size
        if t.shape[0] * tp == vocab:
            return t if tp == 1 else self._tp(t, 0)
        if t.shape[0] * tp < vocab:
            raise ValueError(
                f"vocab_size: Megatron's vocabulary holds {t.shape[0] * tp} rows, the config's {vocab}"
            )
        if tp == 1:
            return t[:vocab]
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous(), group=self.parallel.tp_group)
        return torch.cat(parts)[:vocab]


# The checkpoint's names of the tensors whose prime-rl names (``layer_shapes``) differ.
_PRIME_RL_NAMES = {
    "mlp.gate.weight": "mlp.router.gate.weight",
    "mlp.gate.e_score_correction_bias": "mlp.expert_bias",
    "mlp.shared_experts.gate_proj.weight": "mlp.shared_expert.w1",
    "mlp.shared_experts.up_proj.weight": "mlp.shared_expert.w3",
    "mlp.shared_experts.down_proj.weight": "mlp.shared_expert.w2",
}


def _checkpoint_shapes(config, layer_idx: int) -> dict[str, tuple[int, ...]]:
    """A layer's global tensor shapes under the checkpoint's names (the shared expert unstacked)."""
    shapes = layer_shapes(config, layer_idx)
    out = dict(shapes)
    for key, prime in _PRIME_RL_NAMES.items():
        if prime in shapes:
            shape = shapes[prime]
            out[key] = shape[1:] if prime.startswith("mlp.shared_expert.") else shape
    return out


def _unwrap(m: object) -> torch.nn.Module:
    while hasattr(m, "module") and not hasattr(m, "decoder"):
        m = m.module
    return m


def _tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's parameters, and the buffers that are weights (``expert_bias``): Megatron's other
    buffers are routing statistics (``local_tokens_per_expert``), not sent."""
    yield from module.named_parameters()
    yield from ((n, b) for n, b in module.named_buffers() if n.endswith("expert_bias"))


def _experts(config) -> int:
    return int(config.get("n_routed_experts") or config.get("num_experts") or 0)


__all__ = ["MEGATRON_GATE_UP", "MEGATRON_MTP_NAMES", "MEGATRON_NAMES", "MegatronParallel", "MegatronSource"]
