"""The SGLang rank's side of an update: SGLang's custom weight loader (``receive_update``), run by
``update_weights_from_tensor`` in every scheduler process of the server, with the model
(docs/sglang.md#the-hook).

Each rank reads the update from the call's payload (``glm_fp8.integrations.sglang.update``), its
own layout from SGLang's runtime context (``sglang_rank_layout``), and checks that the model holds
exactly the parameters glm_fp8 lands (``sglang_landing``: a shared expert SGLang fused into the
routed experts' stacks is landed in its slot; on Blackwell, the parameters SGLang requantized for
DeepGEMM are landed in the checkpoint's format, then requantized in place by SGLang's own code).
It joins glm_fp8's link before either check: a
refusal is voted with the manifest, so the senders and the other ranks stop at once instead of
waiting for this rank until the link's timeout. The link and the ``Receiver`` stay open between
updates (a delta update needs what the last one left); its receive buffers (the ring) are given
back after each (``held_receive_bytes``). On a speculative server with
``SGLangUpdate.drafter``, SGLang runs the loader a second time in the same call, for its MTP
drafter: that call lands the drafter's update (the MTP layer) on the same link
(docs/sglang.md#the-mtp-drafter).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from glm_fp8.core.errors import EngineNotSupported, LinkLost
from glm_fp8.core.numerics import BLOCK, ceil_blocks
from glm_fp8.engine.postload import check_w13_halves, swap_w13_halves_
from glm_fp8.engine.sglang import SGLangLayout, sglang_params
from glm_fp8.engine.specs import engine_param_specs
from glm_fp8.integrations.sglang.update import SGLangUpdate
from glm_fp8.model.layer_plan import packed_ue8m0_shape
from glm_fp8.transfer.link import StoreLink
from glm_fp8.transfer.receiver import Receiver

logger = logging.getLogger(__name__)
KV_SCALES = (".k_scale", ".v_scale")  # the KV cache's scales: not weights, never updated


def sglang_rank_layout() -> SGLangLayout:
    """This process's layout, read from SGLang 0.5.23's runtime context (the scheduler's published
    ``ServerArgs``): its TP rank and size, attention DP, EP size, ``moe_dense_tp_size``,
    ``moe_a2a_backend``, ``enable_dp_lm_head`` and ``SGLANG_SHARED_EXPERT_TP1``. Raises
    ``EngineNotSupported`` for pipeline or attention context parallelism and for EPLB or
    redundant experts."""
    from sglang.srt.runtime_context import get_exec, get_parallel

    p, moe = get_parallel(), get_exec().moe
    for what, size in (("pp_size", p.pp_size), ("attn_cp_size", p.attn_cp_size)):
        if size != 1:
            raise EngineNotSupported(f"SGLang {what} {size}: glm_fp8 models one stage, no attention CP")
    if getattr(moe, "enable_eplb", False) or getattr(moe, "ep_num_redundant_experts", 0):
        raise EngineNotSupported(
            "SGLang --enable-eplb / --ep-num-redundant-experts: its experts then move between ranks and "
            "repeat, which glm_fp8's expert placement does not follow (docs/sglang.md)"
        )
    return SGLangLayout.from_sglang(
        p.tp_size,
        p.tp_rank,
        attn_dp_size=p.attn_dp_size,
        ep_size=p.moe_ep_size,
        moe_dense_tp_size=p.moe_dense_tp_size,
        moe_a2a_backend=str(moe.moe_a2a_backend or "none"),
        enable_dp_lm_head=bool(p.enable_dp_lm_head),
        shared_expert_tp1=os.environ.get("SGLANG_SHARED_EXPERT_TP1", "").lower() in ("1", "true"),
    )


def is_drafter(model: torch.nn.Module) -> bool:
    """Whether ``model`` is SGLang's MTP drafter (``DeepseekModelNextN`` under ``model``: one
    decoder layer, ``model.decoder``) rather than a target model."""
    return hasattr(getattr(model, "model", None), "decoder")


# SGLang 0.5.23's requantization of one block-FP8 weight [N, K] with its float32 block scales:
# (fp8 weight, packed int32 UE8M0 scales [N, ceil(nb(K) / 4)]), as
# ``sglang.srt.layers.quantization.fp8_utils.requant_weight_ue8m0(weight, scale, [128, 128])``.
Requantize = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SGLangLanding:
    """Where one update lands on one SGLang rank (``sglang_landing``), and what follows the landing
    (docs/sglang.md#blackwell).

    ``params``: the tensors the ``Receiver`` writes, by the names glm_fp8 lands: the model's own
    parameters (``.data``), but for each scale SGLang requantized and packed for DeepGEMM, a float32
    tensor of the checkpoint's shape. ``restore``: those (weight, packed scale parameter, float32
    scales). ``swap``: the routed-expert stacks (w13, its scales) SGLang's loader fills in FlashInfer
    TRT-LLM's order, [w3; w1].
    """

    params: dict[str, torch.Tensor]
    restore: list[tuple[torch.Tensor, torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)
    swap: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def converts(self) -> str | None:
        """What this landing does to the bytes after they arrive (None: nothing), in words: a delta
        update rebuilds the last update's bytes from the parameters, which then no longer hold them."""
        what = []
        if self.restore:
            what.append(f"DeepGEMM's UE8M0 requantization of {len(self.restore)} block-FP8 parameters")
        if self.swap:
            what.append(f"FlashInfer TRT-LLM's [w3; w1] order of {len(self.swap)} expert stacks")
        return " and ".join(what) or None

    def finish(
        self, model: torch.nn.Module, post_load: Callable[[torch.nn.Module], None], requantize: Requantize
    ) -> None:
        """After every byte landed (never after a failed update: the model keeps the scales it had),
        leave ``model`` as SGLang's own load of the update's checkpoint leaves it, in the storage it
        had: SGLang's decode CUDA graphs read the parameters where they were captured.

        1. The TRT-LLM stacks' w13 halves swapped, scales alike (``swap_w13_halves_``).
        2. ``post_load`` (SGLang's ``post_load_weights``: MLA's ``w_kc`` / ``w_vc``, copied into
           their tensors) with the checkpoint's float32 scales in the requantized parameters
           (``format_ue8m0`` False meanwhile), as SGLang's own load derives them before requantizing.
        3. Each requantized parameter back in its packed storage (``format_ue8m0`` True, so the
           session's ``process_weights_after_loading`` leaves it), then ``requantize``'s result for
           each weight (each expert of a stack alone: one expert's temporaries) copied into the
           weight and the packed scales in place.
        """
        for w13, scale in self.swap:
            swap_w13_halves_(w13, scale)
        packed = [param.data for _, param, _ in self.restore]
        for _, param, staged in self.restore:
            param.data, param.format_ue8m0 = staged, False
        try:
            post_load(model)
        finally:
            for (_, param, _), storage in zip(self.restore, packed):
                param.data, param.format_ue8m0 = storage, True
        for (weight, _, staged), scales in zip(self.restore, packed):
            pieces = [(weight, staged, scales)] if weight.dim() == 2 else zip(weight, staged, scales)
            for w, s, out in pieces:
                new_w, new_s = requantize(w, s)
                w.copy_(new_w)
                out.copy_(new_s)


def sglang_landing(model: torch.nn.Module, config: Mapping, layout: SGLangLayout) -> SGLangLanding:
    """Where an update lands in ``model`` (``SGLangLanding``), checked against what glm_fp8 lands at
    ``layout`` (names, shapes, dtypes; the KV cache's scales aside): ``EngineNotSupported`` names the
    first parameter that differs. A shared expert SGLang fused into the routed experts' stacks lands
    in its slot (``sglang_params``). The drafter's ``model.embed_tokens`` and ``lm_head`` are the
    target's (SGLang's draft worker shares them: ``set_embed_and_head``), landed by the target's
    update: not listed.

    On Blackwell (docs/sglang.md#blackwell): a block-FP8 scale SGLang requantized for DeepGEMM
    (``format_ue8m0``: int32 [(E,) N, ceil(nb(K) / 4)], packed) is landed in a float32 tensor of the
    checkpoint's shape, allocated here (4 bytes per 128 x 128 block of the weight), and a
    routed-expert module SGLang runs with FlashInfer TRT-LLM (``use_flashinfer_trtllm_moe``) is
    listed for its w13 halves' swap: ``SGLangLanding.finish`` does both after the landing."""
    fused = getattr(getattr(model, "shared_experts_config", None), "num_fused_shared_experts", 0)
    skip = DRAFTER_TARGETS if layout.drafter else ()
    named = {n: p for n, p in model.named_parameters() if not n.endswith(KV_SCALES) and n not in skip}
    held, restore = {}, []
    for name, p in named.items():
        held[name] = p.data
        if getattr(p, "is_shuffled", False):
            raise EngineNotSupported(
                f"{name}: SGLang shuffled its bytes for AITER's kernels (is_shuffled), a layout glm_fp8 "
                "does not land (docs/sglang.md#layouts)"
            )
        if not getattr(p, "format_ue8m0", False):
            continue
        weight = named.get(name.removesuffix("_scale_inv")) if name.endswith("weight_scale_inv") else None
        packed = None if weight is None else packed_ue8m0_shape(tuple(weight.shape))
        if p.dtype != torch.int32 or tuple(p.shape) != packed:
            raise EngineNotSupported(
                f"{name}: SGLang marks it UE8M0 (format_ue8m0) as {tuple(p.shape)} {p.dtype}; glm_fp8 "
                "lands DeepGEMM's requantized block scales of a block-FP8 weight only, int32 "
                f"{packed} here (docs/sglang.md#blackwell)"
            )
        *g, n, k = weight.shape
        staged = torch.full((*g, ceil_blocks(n), ceil_blocks(k)), float("nan"), device=p.device)
        held[name] = staged
        restore.append((weight.data, p, staged))
    try:
        params = sglang_params(held, layout, fused)
    except ValueError as e:
        raise EngineNotSupported(str(e)) from None
    want = engine_param_specs(config, layout)
    for name in sorted(set(want) | set(params)):
        got = (tuple(params[name].shape), params[name].dtype) if name in params else None
        if want.get(name) != got:
            raise EngineNotSupported(
                f"{name}: SGLang's model holds {got}, glm_fp8 lands {want.get(name)} at {layout} "
                "(docs/sglang.md#layouts)"
            )
    swap = []
    for prefix, module in model.named_modules():
        if getattr(module, "use_flashinfer_trtllm_moe", False) and prefix + ".w13_weight" in held:
            w13, scale = held[prefix + ".w13_weight"], held.get(prefix + ".w13_weight_scale_inv")
            try:
                check_w13_halves(w13, scale)
            except ValueError as e:
                raise EngineNotSupported(
                    f"{prefix}.{e} (SGLang runs these experts with FlashInfer TRT-LLM, whose order "
                    "glm_fp8 lands by swapping the halves; docs/sglang.md#blackwell)"
                ) from None
            swap.append((w13, scale))
    return SGLangLanding(params, restore, swap)


# The drafter's parameters that are the target's own tensors (aliases, not landed twice).
DRAFTER_TARGETS = ("model.embed_tokens.weight", "lm_head.weight")
# Kept open between updates: a link per (host, port, rank, world size), which the target's and
# the drafter's updates share, and a Receiver per update (its options as JSON) on it.
_LINKS: dict[tuple, StoreLink] = {}
_RECEIVERS: dict[str, tuple[tuple, Receiver]] = {}
# The payloads whose target update failed on this rank: SGLang still runs the loader for the
# drafter in the same call, and no sender sends the drafter's update then (it would wait for it).
_TARGET_FAILED: set[str] = set()


def _payload_key(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    return str(named_tensors[0][0]) if len(named_tensors) == 1 else ""


def receive_update(model: torch.nn.Module, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader (``LOADER``): land one glm_fp8 update in ``model``, this rank's
    shard of every parameter, then run SGLang's ``post_load_weights``.

    It never raises: SGLang 0.5.23 calls a custom loader with no handler around it, so an
    exception would end the scheduler's event loop and stop the whole server
    (``managers/scheduler.py::run_scheduler_process``). A failed update (any rank's or sender's,
    voted on the link: a layout or a model glm_fp8 cannot land, ``EngineNotSupported``, too) is
    logged here and raised on every sender, whose caller then leaves generation paused
    (``SGLangUpdateCall.finish`` is not called); SGLang reports the call a success all the same."""
    try:
        _receive(model, named_tensors)
    except Exception as exc:  # noqa: BLE001 - see above: the senders raise it
        if not is_drafter(model):  # the drafter's call that follows in this call returns at once
            _TARGET_FAILED.add(_payload_key(named_tensors))
        logger.error(
            "glm_fp8: the update did not land on this rank (the trainer's send_model says why): %s: %s",
            type(exc).__name__,
            exc,
        )
        if isinstance(exc, LinkLost):  # that link carries no other update: the trainer builds a new one
            for where, link in list(_LINKS.items()):
                if getattr(getattr(link, "liveness", None), "lost", None) is not None:
                    _LINKS.pop(where)
                    for key in [k for k, (w, _) in _RECEIVERS.items() if w == where]:
                        _RECEIVERS.pop(key)
                    link.close()


def _receive(model: torch.nn.Module, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    from sglang.srt.model_loader.loader import post_load_weights
    from sglang.srt.runtime_context import get_parallel

    update = SGLangUpdate.from_named_tensors(named_tensors)
    drafter = is_drafter(model)
    if drafter and update.drafter and _payload_key(named_tensors) in _TARGET_FAILED:
        _TARGET_FAILED.discard(_payload_key(named_tensors))
        logger.error("glm_fp8: the drafter's update is not sent: the target's update failed on this rank")
        return
    if not drafter:
        _TARGET_FAILED.discard(_payload_key(named_tensors))
    refusal = None
    if drafter and not update.drafter:  # called with selector "all": no drafter's update follows
        logger.warning(
            "glm_fp8: SGLang called the loader for its MTP drafter, but the update says drafter=False: "
            "the drafter keeps its weights (docs/sglang.md#the-mtp-drafter)"
        )
        return
    if drafter:
        update = update.drafter_update()
    elif update.drafter and not _runs_drafter():
        refusal = EngineNotSupported(
            "SGLangUpdate.drafter: this SGLang server runs no speculative decoding "
            "(--speculative-algorithm), so no drafter would take the MTP layer; pass drafter=False"
        )
    rank = update.rank_offset + get_parallel().tp_rank  # this rank on the link: SGLang's TP rank
    if not rank < update.world_size or update.engines[rank] is None:
        raise ValueError(
            f"SGLangUpdate: SGLang's TP rank {rank - update.rank_offset} is link rank {rank}, which "
            f"the update gives no engine layout (world_size {update.world_size}, rank_offset "
            f"{update.rank_offset})"
        )
    landing = SGLangLanding({})
    try:
        layout = sglang_rank_layout()
        layout = layout.drafter_layout if drafter else layout
        landing = sglang_landing(model, update.config, layout)  # every update: SGLang may re-allocate
        if update.delta and landing.converts:
            raise EngineNotSupported(
                f"SGLangUpdate.delta: this rank's landing converts what arrives ({landing.converts}), "
                "so its parameters do not hold the bytes a delta update rebuilds from; send this "
                "server dense updates (delta=False; docs/sglang.md#blackwell)"
            )
    except Exception as exc:  # noqa: BLE001 - voted at the manifest: the senders are in the transfer
        refusal, layout = refusal or exc, update.engines[rank]
    if refusal is not None:
        layout, landing = update.engines[rank], SGLangLanding({})
    where = (update.host, update.port, rank, update.world_size)
    device = next(model.parameters()).device
    if where not in _LINKS:
        _LINKS[where] = StoreLink(
            update.host,
            update.port,
            rank,
            update.world_size,
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=update.timeout_s),
            device=device,
        )
    link = _LINKS[where]
    key = update.to_json()
    if key not in _RECEIVERS:
        receiver = Receiver(
            link,
            0,
            config=update.config,
            layer_ids=list(update.layer_ids),
            rest=update.rest,
            device=device,
            engines=list(update.engines),
            senders=list(update.senders),
            holders=update.holders,
            step_layers=update.step_layers,
            layout=layout,
            delta=update.delta,
        )
        _RECEIVERS[key] = (where, receiver)
    _, receiver = _RECEIVERS[key]
    try:
        receiver.load_into(landing.params, refusal=refusal)
    finally:
        # The ring goes back after every update, landed or not: SGLang sized its KV cache at start
        # and serves between updates, so nothing of the transfer stays held.
        receiver.release()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # post_load_weights: the drafter's too (MLA's w_kc / w_vc of its decoder layer)
    landing.finish(model, post_load_weights, _requantize)


def _requantize(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's own requantization for DeepGEMM (``SGLangLanding.finish``)."""
    from sglang.srt.layers.quantization.fp8_utils import requant_weight_ue8m0

    return requant_weight_ue8m0(weight, scale, [BLOCK, BLOCK])


def held_receive_bytes() -> int:
    """The bytes of receive buffers this process's glm_fp8 receivers hold now: 0 between updates
    (each update allocates its ring and gives it back; plans and links stay)."""
    return sum(receiver.held_nbytes for _, receiver in _RECEIVERS.values())


def _runs_drafter() -> bool:
    """Whether this SGLang server decodes speculatively (its published ``--speculative-algorithm``):
    then its draft worker calls the loader again, for the drafter, after this call."""
    from sglang.srt.runtime_context import get_spec

    return bool(getattr(get_spec(), "speculative_algorithm", None))


__all__ = [
    "DRAFTER_TARGETS",
    "KV_SCALES",
    "SGLangLanding",
    "held_receive_bytes",
    "is_drafter",
    "receive_update",
    "sglang_landing",
    "sglang_rank_layout",
]
