"""What vLLM's processes call: ``register`` (the ``vllm.general_plugins`` entry point: the
"glm_fp8" weight-transfer backend in vLLM's factories), ``vllm_updater`` (a worker's
``EngineUpdater`` from its vLLM config), ``vllm_finalize`` (vLLM's own post-load step after an
in-place reload), and the worker-extension route (``GlmFp8WorkerExtension`` driven through
``collective_rpc`` by ``ExtensionClient``). vLLM itself is imported inside each function: importing
this module needs no vLLM."""

from __future__ import annotations

from collections.abc import Callable

import torch

from glm_fp8.integrations.vllm.probe import (
    check_moe_parallel,
    engine_postload_plan,
    layout_from_parallel_config,
)
from glm_fp8.integrations.vllm.sync import from_json
from glm_fp8.integrations.vllm.updater import EngineUpdater
from glm_fp8.integrations.vllm.worker import WorkerSide, worker_index

BACKEND = "glm_fp8"
_BACKEND_MODULE = "glm_fp8.integrations.vllm.backend"


def register() -> None:
    """Register the "glm_fp8" weight-transfer backend with vLLM (idempotent; lazy: the engine
    classes are imported when vLLM first builds one)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, name in (
        (WeightTransferEngineFactory, "GlmFp8WeightTransferEngine"),
        (WeightTransferTrainerFactory, "GlmFp8TrainerWeightTransferEngine"),
    ):
        if BACKEND not in factory._registry:
            factory.register_engine(BACKEND, _BACKEND_MODULE, name)


def vllm_updater(
    vllm_config: object, target: torch.nn.Module, drafter: torch.nn.Module | None
) -> EngineUpdater:
    """This vLLM worker's ``EngineUpdater``: its layout from its parallel state, checked against what
    every routed-experts module was built with, its post-load plan from the kernels vLLM chose.
    Raises ``EngineNotSupported`` naming what glm_fp8 cannot update in place."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import get_dp_group, get_tp_group
    from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used

    model_config = vllm_config.model_config
    hf = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    config = hf.to_dict()
    pc = vllm_config.parallel_config
    with set_current_vllm_config(vllm_config):
        dp_rank = get_dp_group().rank_in_group if pc.data_parallel_size > 1 else 0
        layout = layout_from_parallel_config(
            pc, tp_rank=get_tp_group().rank_in_group, dp_rank=dp_rank, config=config
        )
        check_moe_parallel(layout, target)
        plan = engine_postload_plan(config, target, drafter, deepgemm_e8m0=is_deep_gemm_e8m0_used())
    return EngineUpdater(target, drafter, config, layout, plan, finalize=vllm_finalize)


def vllm_finalize(model: torch.nn.Module) -> None:
    """vLLM 0.34's own end of a kernel-format reload (``model_loader/reload/inplace.py::
    reload_weights``): every module's ``process_weights_after_loading`` hook, children first
    (``weight_utils.py::finalize_model_weights``), inside ``weights_already_processed()`` so
    quantization methods transform nothing (``quantization/fp8.py``: ``is_weights_pre_processed``)
    while MLA rebuilds ``W_UK_T`` / ``W_UV`` in place (``replace_parameter``)."""
    from vllm.model_executor.model_loader.weight_utils import finalize_model_weights
    from vllm.model_executor.utils import weights_already_processed

    with weights_already_processed():
        finalize_model_weights(model)


class GlmFp8WorkerExtension:
    """vLLM worker extension (``--worker-extension-cls glm_fp8.integrations.vllm.GlmFp8WorkerExtension``):
    glm_fp8's engine side driven through ``collective_rpc`` (methods named ``glm_fp8_*``, which vLLM
    requires not to clash with the worker's). The trainer drives it with ``ExtensionClient`` as its
    client; every method takes JSON-able arguments."""

    def glm_fp8_init(self, init_info: dict | str) -> dict:
        """``init_info`` may come as JSON text (the dev server's ``/collective_rpc`` passes strings);
        text that is not JSON is refused naming ``init_info``."""
        return self._glm_fp8_side().init(from_json("init_info", init_info))

    def glm_fp8_start(self) -> None:
        self._glm_fp8_side().start()

    def glm_fp8_update(self, update_info: dict | str) -> dict:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            return self._glm_fp8_side().receive(from_json("update_info", update_info))

    def glm_fp8_finish(self) -> None:
        self._glm_fp8_side().finish()
        # What GPUModelRunner.reload_weights does after a reload (v1/worker/gpu/model_runner.py).
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.model_runner, reset, None)
            if callable(fn):
                fn()

    def glm_fp8_describe(self) -> dict:
        side = self._glm_fp8_side()
        return side.updater.describe() if side.updater is not None else {}

    def glm_fp8_close(self) -> None:
        side = getattr(self, "_glm_fp8_state", None)
        if side is not None:
            side.close()

    def _glm_fp8_side(self) -> WorkerSide:
        side = getattr(self, "_glm_fp8_state", None)
        if side is None:
            runner = self.model_runner
            get_draft = getattr(runner, "get_draft_model", None)
            drafter = (
                get_draft()
                if callable(get_draft)
                else getattr(getattr(runner, "speculator", None), "model", None)
            )
            pc = self.vllm_config.parallel_config
            side = self._glm_fp8_state = WorkerSide(
                lambda: vllm_updater(self.vllm_config, runner.get_model(), drafter),
                lambda senders: senders + worker_index(pc),
                has_drafter=drafter is not None,
                device=torch.device(self.device),
            )
        return side


class ExtensionClient:
    """A ``VLLMWeightSyncClient`` over ``GlmFp8WorkerExtension``: ``rpc(method, args)`` runs a method
    on every worker (``LLM.collective_rpc``, ``AsyncLLM.collective_rpc`` wrapped to wait, or the dev
    server's ``/collective_rpc`` route)."""

    def __init__(self, rpc: Callable[[str, tuple], object]):
        self.rpc = rpc

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.rpc("glm_fp8_init", (init_info,))

    def start_weight_update(self) -> None:
        self.rpc("glm_fp8_start", ())

    def update_weights(self, update_info: dict) -> None:
        self.rpc("glm_fp8_update", (update_info,))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.rpc("glm_fp8_finish", ())

    def shutdown_weight_transfer_engine(self) -> None:
        """Leave the link (a server removed from a fleet: ``remove_server``)."""
        self.rpc("glm_fp8_close", ())


__all__ = ["BACKEND", "ExtensionClient", "GlmFp8WorkerExtension", "register", "vllm_finalize", "vllm_updater"]
