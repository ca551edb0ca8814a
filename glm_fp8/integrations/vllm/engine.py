"""The engine side of glm_fp8's vLLM 0.34 integration, without vLLM: one worker's layout, its
parameters (target model and MTP drafter, under vLLM's names), what vLLM's post-load step
changed, and ``EngineUpdater``, which lands an update in them and redoes that step
(docs/vllm.md). Everything here takes any ``torch.nn.Module`` tree with vLLM's parameter names,
so it is tested without vLLM (tests/test_vllm_worker.py, tests/test_vllm_backend.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from glm_fp8.config import as_config
from glm_fp8.engine.layout import EngineLayout
from glm_fp8.engine.postload import PostLoadPlan, apply_postload_, postload_plan
from glm_fp8.engine.specs import engine_param_specs, mtp_layer_index
from glm_fp8.models import REST, model_layer_ids
from glm_fp8.transfer.receiver import Receiver


class EngineNotSupported(ValueError):
    """The engine holds its weights in a form glm_fp8 cannot update in place (the reason names
    the setting and the vLLM source it was read from)."""


# --- parallel layout ------------------------------------------------------------------------------


def layout_from_parallel_config(
    parallel_config: object, *, tp_rank: int, dp_rank: int, config: Mapping | None = None
) -> EngineLayout:
    """This worker's ``EngineLayout`` from vLLM's ``ParallelConfig`` (``config/parallel.py``) and its
    ranks in the attention TP group (``get_tp_group().rank_in_group``) and the DP group
    (``get_dp_group().rank_in_group``, 0 when ``data_parallel_size`` is 1, as
    ``fused_moe/config.py::FusedMoEParallelConfig.make`` takes it).

    Raises ``EngineNotSupported`` for what ``EngineLayout`` does not model: pipeline parallelism,
    prefill context parallelism, EPLB, and round-robin expert placement where vLLM honours it
    (``expert_map_manager.py::determine_expert_placement_strategy``: only with ``n_group > 1``)."""
    pc = parallel_config
    for attr, why in (
        ("pipeline_parallel_size", "pipeline parallelism"),
        ("prefill_context_parallel_size", "prefill context parallelism"),
    ):
        if getattr(pc, attr, 1) != 1:
            raise EngineNotSupported(
                f"parallel_config.{attr}={getattr(pc, attr)}: {why} is not supported "
                "(EngineLayout models pipeline_parallel_size 1, pcp 1)"
            )
    if getattr(pc, "enable_eplb", False):
        raise EngineNotSupported(
            "parallel_config.enable_eplb: EPLB moves experts at run time and adds "
            "redundant ones; glm_fp8's expert placement is vLLM's static 'linear' one"
        )
    if (
        getattr(pc, "expert_placement_strategy", "linear") == "round_robin"
        and config is not None
        and (config.get("n_group") or 1) > 1
    ):
        raise EngineNotSupported(
            "parallel_config.expert_placement_strategy='round_robin' with n_group > 1: "
            "only the 'linear' placement is supported"
        )
    return EngineLayout.from_vllm(
        tp_size=int(pc.tensor_parallel_size),
        tp_rank=int(tp_rank),
        dp_size=int(pc.data_parallel_size),
        dp_rank=int(dp_rank) if pc.data_parallel_size > 1 else 0,
        enable_expert_parallel=bool(pc.enable_expert_parallel),
        all2all_backend=str(getattr(pc, "all2all_backend", "allgather_reducescatter")),
    )


def check_moe_parallel(layout: EngineLayout, model: torch.nn.Module) -> int:
    """Compare ``layout`` with what every routed-experts module of ``model`` was built with
    (``module.moe_config.moe_parallel_config``: ``fused_moe/config.py::FusedMoEParallelConfig``,
    whose ``tp_*`` are the MoE TP group and ``ep_*`` the expert-parallel one). Returns how many
    modules were checked; raises ``EngineNotSupported`` naming the first that differs."""
    checked = 0
    for name, module in model.named_modules():
        mpc = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
        if mpc is None:
            continue
        want = {
            "ep_size": layout.ep_size,
            "ep_rank": layout.ep_rank,
            "tp_size": layout.moe_tp_size,
            "tp_rank": layout.moe_tp_rank,
        }
        got = {k: getattr(mpc, k, None) for k in want}
        if got != want:
            raise EngineNotSupported(
                f"{name}.moe_config.moe_parallel_config: the engine built {got}, glm_fp8's layout "
                f"{layout} gives {want}"
            )
        checked += 1
    return checked


# --- what the engine's kernels did to its weights -------------------------------------------------


def _modules(models: Sequence[torch.nn.Module | None]) -> Iterator[tuple[str, torch.nn.Module]]:
    seen: set[int] = set()
    for model in models:
        if model is None:
            continue
        for name, module in model.named_modules():
            if id(module) not in seen:
                seen.add(id(module))
                yield name, module


def moe_backends(*models: torch.nn.Module | None) -> dict[str, str]:
    """{module name: ``Fp8MoeBackend`` value} of every routed-experts module whose quant method
    chose a backend (``quantization/fp8.py::Fp8MoEMethod.fp8_backend``, from
    ``fused_moe/oracle/fp8.py::select_fp8_moe_backend``)."""
    out = {}
    for name, module in _modules(models):
        backend = getattr(getattr(module, "quant_method", None), "fp8_backend", None)
        if backend is not None:
            out[name] = str(getattr(backend, "value", backend))
    return out


def deepgemm_requantized_linears(*models: torch.nn.Module | None) -> list[str]:
    """Names of the linear modules whose block-FP8 weights vLLM re-quantized to power-of-two scales
    after loading: their kernel (``Fp8LinearMethod.fp8_linear``) is DeepGEMM's, or FlashInfer's
    dispatcher with a DeepGEMM ``fallback``, and had DeepGEMM and its E8M0 mode on
    (``kernels/linear/scaled_mm/deep_gemm.py::DeepGemmFp8BlockScaledMMKernel.
    process_weights_after_loading`` -> ``fp8_utils.py::deepgemm_post_process_fp8_weight_block``)."""
    out = []
    for name, module in _modules(models):
        kernel = getattr(getattr(module, "quant_method", None), "fp8_linear", None)
        if kernel is None:
            continue
        for k in (kernel, getattr(kernel, "base", None), getattr(kernel, "fallback", None)):
            deepgemm = getattr(k, "is_deep_gemm_supported", False) is True
            if deepgemm and getattr(k, "use_deep_gemm_e8m0", False):
                out.append(name)
                break
    return out


def engine_postload_plan(
    config: Mapping, target: torch.nn.Module, drafter: torch.nn.Module | None, *, deepgemm_e8m0: bool
) -> PostLoadPlan:
    """The ``PostLoadPlan`` of this engine: its routed experts' backend (one for every MoE module of
    target and drafter) and whether DeepGEMM re-quantized any linear."""
    backends = moe_backends(target, drafter)
    kinds = sorted(set(backends.values()))
    if len(kinds) > 1:
        raise EngineNotSupported(
            f"routed experts run on several fused-MoE backends {kinds}; glm_fp8 plans one post-load "
            "step for all of them"
        )
    if not kinds:
        raise EngineNotSupported(
            "no routed-experts module with an FP8 MoE backend (quant_method.fp8_backend) was found: the "
            "engine does not serve a block-FP8 checkpoint, which glm_fp8's updates are"
        )
    return postload_plan(
        config,
        moe_backend=kinds[0],
        deepgemm_linears=bool(deepgemm_requantized_linears(target, drafter)),
        deepgemm_e8m0=deepgemm_e8m0,
    )


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


class _Refusing(Mapping):
    """Params that make the receiver refuse at the manifest vote, so every rank (the trainer
    included) stops there with this error instead of waiting for a timeout."""

    def __init__(self, error: Exception):
        self.error = error

    def __getitem__(self, key):
        raise self.error

    def __contains__(self, key) -> bool:
        raise self.error

    def __iter__(self):
        raise self.error

    def __len__(self) -> int:
        return 0


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
    ) -> dict[str, object]:
        """Receive one update from ``src`` over ``comm`` into the engine's parameters (``engines`` and
        ``senders`` as ``Receiver`` takes them: the same lists as the trainer's), then redo the
        post-load step on what landed. ``layer_ids`` default to every decoder layer, then the MTP
        layer when there is a drafter; ``scale_fmt`` to the plan's. Refusals known before the transfer
        (a scale format the engine cannot serve, a partial update after a failed one, the MTP layer
        without a drafter) are voted at the manifest, so every rank stops there. Raises what
        ``Receiver.load_into`` raises; after a failure the parameters must not be served until a
        whole update succeeds. The receiver (plans, groups) is kept for the next update with the
        same arguments; its ring is given back after each."""
        ids = list(self.full_layer_ids if layer_ids is None else (int(i) for i in layer_ids))
        fmt = self.plan.scale_fmt if scale_fmt is None else scale_fmt
        if device is None:
            device = next(iter(self.engine.params.values())).device
        key = (
            id(comm),
            src,
            tuple(ids),
            rest,
            fmt,
            str(device),
            ring,
            checksum,
            None if engines is None else tuple(engines),
            None if senders is None else tuple(senders),
        )
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
            )
        refusal = self._refusal(ids, rest, fmt)
        parts = self._parts(ids, rest)
        params: Mapping[str, torch.Tensor] = self.engine.params if refusal is None else _Refusing(refusal)
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                stats = receiver.load_into(params, aliases=self.engine.aliases)
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


__all__ = [
    "EngineNotSupported",
    "EngineParams",
    "EngineUpdater",
    "check_moe_parallel",
    "collect_params",
    "deepgemm_requantized_linears",
    "engine_postload_plan",
    "layout_from_parallel_config",
    "moe_backends",
]
