"""The engine side of an update in a vLLM 0.34 worker, without vLLM: ``EngineUpdater`` lands an
update in one worker's parameters (target model and MTP drafter, under vLLM's names, gathered by
``collect_params``) and redoes vLLM's post-load step on what landed (docs/vllm.md). What the worker
was built with (its layout, its post-load plan) is read by ``glm_fp8.integrations.vllm.probe``.
Everything here takes any ``torch.nn.Module`` tree with vLLM's parameter names, so it is tested
without vLLM (tests/integrations/test_vllm_worker.py, tests/integrations/test_vllm_backend.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from glm_fp8.core.errors import EngineNotSupported
from glm_fp8.engine.layout import EngineLayout
from glm_fp8.engine.postload import PostLoadPlan, apply_postload_, postload_inverse
from glm_fp8.engine.specs import engine_param_specs, engine_params
from glm_fp8.model.config import as_config
from glm_fp8.model.families import REST, model_layer_ids, mtp_layer_index
from glm_fp8.model.plans import plans_for_model
from glm_fp8.transfer.delta.carry import HeldCopy, adopt_held, detach_held
from glm_fp8.transfer.delta.receive import check_receiver_delta
from glm_fp8.transfer.receiver import Receiver
from glm_fp8.transfer.votes import refusal_is_voted

# --- the parameters -------------------------------------------------------------------------------


@dataclass
class EngineParams:
    """The engine's tensors under vLLM's names, as ``Receiver.load_into`` takes them.

    ``aliases`` maps a drafter name to the target name of the same tensor (vLLM 0.34 shares the
    target's ``lm_head`` with the GLM-5 drafter's ``shared_head.head``:
    ``v1/worker/gpu/spec_decode/eagle/utils.py::load_eagle_model``); ``missing`` lists spec names
    neither model holds; ``not_in_specs`` counts engine parameters outside the update (derived
    ones such as MLA's ``W_UK_T``)."""

    params: dict[str, torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    not_in_specs: int = 0


def _named_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    # LoRA wraps layers as ``<name>.base_layer``; vLLM's own reload strips that level too
    # (model_loader/reload/inplace.py::reload_weights).
    return {n.replace(".base_layer.", "."): p for n, p in model.named_parameters()}


def collect_params(
    target: torch.nn.Module, drafter: torch.nn.Module | None, specs: Mapping[str, object]
) -> EngineParams:
    """The tensors of ``target`` (then ``drafter``, the MTP draft model) named in ``specs``
    (``engine_param_specs``), detached views of the real parameters: writing them updates the
    engine. A name both models hold must be one shared tensor (vLLM shares ``embed_tokens``,
    ``maybe_share_target_embed``); a drafter name holding a target tensor under another name is
    recorded in ``aliases``."""
    tp = _named_params(target)
    by_id = {id(p): n for n, p in tp.items()}
    params: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    outside = sum(1 for n in tp if n not in specs)
    for n, p in tp.items():
        if n in specs:
            params[n] = p.detach()
    if drafter is not None:
        for n, p in _named_params(drafter).items():
            if n in tp:
                if tp[n] is not p:
                    raise EngineNotSupported(
                        f"drafter {n}: a tensor of its own where vLLM 0.34 shares the target's "
                        "(maybe_share_target_embed); one name cannot carry two tensors in an update"
                    )
                continue
            if n not in specs:
                outside += 1
                continue
            if id(p) in by_id:
                aliases[n] = by_id[id(p)]
            params[n] = p.detach()
    missing = [n for n in specs if n not in params]
    return EngineParams(params, aliases, missing, outside)


# --- the update -----------------------------------------------------------------------------------


class EngineUpdater:
    """Lands updates in one engine worker's parameters and redoes vLLM's post-load step.

    Args:
        target, drafter: the served model and its MTP draft model (None without speculative
            decoding, or until ``attach_drafter``), ``torch.nn.Module`` trees with vLLM's names.
        config: the model's HF config (a dict, a config object or a path).
        layout: this worker's ``EngineLayout``.
        plan: its ``PostLoadPlan`` (``engine_postload_plan``).
        finalize: runs the engine's module hooks on one model after an update (the vLLM
            integration passes vLLM's ``finalize_model_weights`` under ``weights_already_processed``:
            MLA ``W_UK_T`` / ``W_UV``, not the quantization transforms). None: none run.

    An update of the target's decoder layers, the MTP layer (the drafter's), the non-layer
    tensors, or any of them together (``update``'s ``layer_ids`` and ``rest``), in any mode of the
    transfer protocol. A failed update leaves what it was landing in a mix of formats: that model
    then takes only a whole update (every decoder layer and the non-layer tensors; the MTP layer)
    until one succeeds. The drafter's ``shared_head.head`` is the target's ``lm_head`` in vLLM
    0.34 (``load_eagle_model``), which drops the checkpoint's MTP head: it is not written.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        drafter: torch.nn.Module | None,
        config: object,
        layout: EngineLayout,
        plan: PostLoadPlan,
        finalize: Callable[[torch.nn.Module], None] | None = None,
    ):
        self.target, self.config, self.layout = target, as_config(config), layout
        self.plan, self.finalize = plan, finalize
        self.specs = engine_param_specs(self.config, layout)
        self.mtp_index = mtp_layer_index(self.config)
        self.decoder_ids = model_layer_ids(self.config, mtp=False)
        self.dirty = {"target": False, "drafter": False}  # a failed update: only a whole one may follow
        self.updates = 0
        self._receivers: dict[tuple, Receiver] = {}
        self._held: dict[tuple, HeldCopy] = {}  # delta: what each session held, off a dropped link
        self.attach_drafter(drafter)

    def attach_drafter(self, drafter: torch.nn.Module | None) -> None:
        """Use ``drafter`` as the MTP draft model (vLLM hands it over in a draft session)."""
        self.drafter = drafter
        self.engine = collect_params(self.target, drafter, self.specs)
        scales = {n: p.dtype for n, p in self.engine.params.items() if n.endswith("_scale_inv")}
        bad = [n for n, dt in scales.items() if dt != torch.float32]
        if bad:
            raise EngineNotSupported(
                f"{bad[0]}: the engine holds {scales[bad[0]]} block scales, not float32: DeepGEMM packed "
                "them (SM100 UE8M0 layout, fp8_utils.py::deepgemm_post_process_weight_scale_block), which "
                "glm_fp8 does not land yet"
            )

    @property
    def mtp(self) -> int | None:
        """The MTP layer's index when this worker has a drafter."""
        return self.mtp_index if self.drafter is not None else None

    @property
    def full_layer_ids(self) -> list[int]:
        return self.decoder_ids + ([self.mtp] if self.mtp is not None else [])

    def drop_link(self) -> None:
        """The link is gone (a new generation of the fleet): drop its receivers, keeping what each
        delta session holds for the next link's (``glm_fp8.transfer.delta.carry``). The parameters
        stay; a byte rewritten meanwhile fails its layer's checksum and is resent dense."""
        for (session, _), receiver in self._receivers.items():
            if receiver.delta is not None:
                self._held[session] = detach_held(receiver)
        self._receivers.clear()

    def describe(self) -> dict[str, object]:
        """What a trainer needs to build a matching update, as plain data."""
        return {
            "layer_ids": list(self.full_layer_ids),
            "rest": True,
            "scale_fmt": self.plan.scale_fmt,
            "layout": {
                k: getattr(self.layout, k)
                for k in ("tp_size", "tp_rank", "ep_size", "ep_rank", "dp_size", "dp_rank")
            },
            "sequence_parallel_moe": self.layout.sp_moe,
            "postload": self.plan.describe(),
            "aliases": dict(self.engine.aliases),
            "needs_full_update": any(self.dirty.values()),
        }

    def _parts(self, layer_ids: list[int], rest: bool) -> dict[str, bool]:
        """Which models an update writes: the target (decoder layers or the non-layer tensors) and
        the drafter (the MTP layer)."""
        return {
            "target": rest or any(i != self.mtp_index for i in layer_ids),
            "drafter": self.mtp_index in layer_ids,
        }

    def delta_refusal(self, scale_fmt: str | None = None) -> EngineNotSupported | None:
        """Why this worker cannot take delta updates (docs/delta.md), or None. A delta layer is rebuilt
        from the parameters, so they must hold the bytes that arrived, up to what the post-load step
        rewrites in place and ``postload_inverse`` undoes on the rebuilt copy (FlashInfer CUTLASS:
        the w13 halves swapped, the expert scales clamped): a landing that is a plain copy (the
        Receiver's own ``check_receiver_delta``, on this worker's layout and plans). MLA's
        ``W_UK_T`` / ``W_UV`` are not updated tensors: vLLM's hook rebuilds them from ``kv_b_proj``."""
        ids = [*self.full_layer_ids, REST]
        fmt = self.plan.scale_fmt if scale_fmt is None else scale_fmt
        try:
            check_receiver_delta(
                wire="fp8",
                checksum=True,
                full=False,
                layout=self.layout,
                rank=0,
                layer_ids=ids,
                plans=plans_for_model(self.config, "fp8", layer_ids=ids, scale_fmt=fmt),
                targets={p.kernel_name: p for p in engine_params(self.config, self.layout).values()},
            )
        except ValueError as exc:
            return EngineNotSupported(str(exc))
        return None

    def _refusal(self, layer_ids: list[int], rest: bool, scale_fmt: str) -> Exception | None:
        if self.plan.scale_fmt == "ue8m0" and scale_fmt != "ue8m0":
            return EngineNotSupported(
                f"scale_fmt={scale_fmt!r}: this engine serves DeepGEMM-requantized weights (MoE backend "
                f"{self.plan.moe_backend} / DeepGEMM linears, VLLM_USE_DEEP_GEMM_E8M0), which hold "
                "power-of-two block scales; the trainer must send scale_fmt='ue8m0'"
            )
        if self.mtp_index in layer_ids and self.drafter is None:
            return EngineNotSupported(
                f"layer_ids: layer {self.mtp_index} is the MTP layer, and this engine "
                "runs no MTP drafter (speculative decoding off)"
            )
        decoder = [i for i in layer_ids if i != self.mtp_index]
        if self.dirty["target"] and (decoder or rest) and (decoder != self.decoder_ids or not rest):
            return EngineNotSupported(
                "a previous update of the target model failed, so its parameters hold a mix of formats; "
                f"only a whole update (layer_ids={self.decoder_ids}, rest=True) may follow, got "
                f"layer_ids={layer_ids}, rest={rest}"
            )
        return None

    def update(
        self,
        comm: object | None,
        src: int = 0,
        *,
        layer_ids: Sequence[int] | None = None,
        rest: bool = True,
        scale_fmt: str | None = None,
        device: torch.device | str | None = None,
        ring: int = 2,
        engines: Sequence[EngineLayout | str | None] | None = None,
        senders: Sequence[int] | None = None,
        checksum: bool = True,
        delta: bool = False,
        holders: Mapping | None = None,
        step_layers: int = 1,
    ) -> dict[str, object]:
        """Receive one update from ``src`` over ``comm`` into the engine's parameters (``engines``,
        ``senders``, ``holders`` and ``step_layers`` as ``Receiver`` takes them: the trainer's),
        then redo the post-load step on what landed. ``layer_ids`` default to every decoder layer,
        then the MTP layer when there is a drafter; ``scale_fmt`` to the plan's. Refusals known
        before the transfer (a scale format the engine cannot serve, a partial update after a failed
        one, the MTP layer without a drafter) are voted at the manifest, so every rank stops there.
        Raises what ``Receiver.load_into`` raises; after a failure the parameters must not be served
        until a whole update succeeds. The receiver (plans, groups; with ``delta`` the versions it
        holds) is kept for the next update with the same arguments, and what it holds goes on to the
        next link's receiver of the same session (``drop_link``); its ring is given back after each."""
        # The other ranks may already be in the transfer: an error before the receiver exists is
        # voted at the update's first vote, as the receiver's own refusals are.
        with refusal_is_voted(comm, src, device):
            ids = list(self.full_layer_ids if layer_ids is None else (int(i) for i in layer_ids))
            fmt = self.plan.scale_fmt if scale_fmt is None else scale_fmt
            if device is None:
                device = next(iter(self.engine.params.values())).device
            session = (tuple(ids), rest, fmt, str(device))  # what a held copy goes on with (drop_link)
            fleet = (None if engines is None else tuple(engines), None if senders is None else tuple(senders))
            held = None if holders is None else repr(sorted(holders.items()))
            key = (session, (id(comm), src, ring, checksum, *fleet, delta, held, step_layers))
        receiver = self._receivers.get(key)
        if receiver is None:
            receiver = self._receivers[key] = Receiver(
                comm,
                src,
                config=self.config,
                layout=self.layout,
                layer_ids=ids,
                rest=rest,
                scale_fmt=fmt,
                ring=ring,
                device=device,
                engines=engines,
                senders=senders,
                checksum=checksum,
                delta=delta,
                holders=holders,
                step_layers=step_layers,
            )
            if delta and session in self._held:  # the session's layers on a new link: still held
                adopt_held(receiver, self._held.pop(session))
        refusal = self._refusal(ids, rest, fmt)
        parts = self._parts(ids, rest)
        unland = None
        if delta and refusal is None:
            try:
                unland = postload_inverse(self.plan, self.config, ids, fmt)
            except Exception as exc:  # noqa: BLE001 - voted at the manifest like the refusals above
                refusal = exc
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                # A refusal is voted with the manifest: every rank (the trainer included) stops
                # there with it instead of waiting for this rank until the transport's timeout.
                stats = receiver.load_into(
                    self.engine.params, aliases=self.engine.aliases, unland=unland, refusal=refusal
                )
        except BaseException:
            if refusal is None:  # nothing landed when the refusal was ours; otherwise some may have
                self.dirty.update({k: True for k, v in parts.items() if v})
            raise
        finally:
            receiver.release()
        t1 = time.perf_counter()
        landed = [layer.layer for layer in stats.layers]
        try:
            with torch.no_grad():
                rewritten = apply_postload_(self.engine.params, self.plan, self.config, landed)
                hooks = self._run_hooks(landed)
        except BaseException:
            self.dirty.update({k: True for k, v in parts.items() if v})
            raise
        if parts["target"] and [i for i in ids if i != self.mtp_index] == self.decoder_ids and rest:
            self.dirty["target"] = False
        if parts["drafter"]:
            self.dirty["drafter"] = False
        self.updates += 1
        return {
            "layers": len(landed),
            "bytes": sum(layer.nbytes for layer in stats.layers),
            "receive_s": round(t1 - t0, 6),
            "postload_s": round(time.perf_counter() - t1, 6),
            "rewritten": len(rewritten),
            "hooks": hooks,
            "scale_fmt": fmt,
            "update": self.updates,
        }

    def _run_hooks(self, landed: list[int]) -> list[str]:
        if self.finalize is None:
            return []
        ran = []
        if any(i != self.mtp_index for i in landed):
            self.finalize(self.target)
            ran.append("target")
        if self.drafter is not None and (self.mtp_index in landed or REST in landed):
            # The drafter's hooks read what it shares with the target too (embed_tokens, lm_head).
            self.finalize(self.drafter)
            ran.append("drafter")
        return ran


__all__ = ["EngineParams", "EngineUpdater", "collect_params"]
