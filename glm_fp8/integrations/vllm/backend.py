"""glm_fp8 as vLLM 0.34's weight-transfer backend "glm_fp8" (docs/vllm.md): the worker engine and
the trainer engine, subclasses of vLLM's ``WeightTransferEngine`` and ``TrainerWeightTransferEngine``
over glm_fp8's ``WorkerSide`` and ``TrainerSide``. The one module of glm_fp8 that imports vLLM at
import time; importing it registers the backend (``glm_fp8.integrations.vllm.register``).

Engine: ``LLM(model, weight_transfer_config=WeightTransferConfig(backend="glm_fp8"), ...)`` or
``vllm serve ... --weight-transfer-config '{"backend": "glm_fp8"}'``. Trainer, on every rank::

    engine = WeightTransferTrainerFactory.trainer_init(
        GlmFp8TrainerInitInfo(master_address=host, master_port=port, engine_ranks=n_workers,
                              config=hf_config, rank=rank),
        client=client, source=ModuleStateSource(model))  # a transformers model: its buffers too
    engine.send_weights()  # each step

A fleet (several vLLM servers, one link): ``engine_ranks=[n0, n1, ...]``, ``server_names=[...]``,
``client=[c0, c1, ...]``; between updates ``engine.add_server(VllmServer(...))``,
``engine.remove_server(name)``, ``engine.replace_server(name, VllmServer(...))`` or
``engine.set_fleet([...])`` on every trainer rank (docs/vllm.md#fleet). Exact delta updates (only
the bytes that changed): ``delta=True`` (and ``delta_resync_every``) in the init info, scatter or
many senders into engine layouts (docs/vllm.md#delta-updates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
)

from glm_fp8.integrations.vllm.clients import VllmServer
from glm_fp8.integrations.vllm.plugin import register, vllm_updater
from glm_fp8.integrations.vllm.probe import engine_postload_plan
from glm_fp8.integrations.vllm.sync import SyncInit, SyncUpdate
from glm_fp8.integrations.vllm.trainer import TrainerSide
from glm_fp8.integrations.vllm.trainer_options import TrainerOptions
from glm_fp8.integrations.vllm.worker import WorkerSide, worker_index


class GlmFp8WeightTransferEngine(WeightTransferEngine):
    """The worker engine: lands glm_fp8 updates in this worker's parameters (its shard, under
    vLLM's names) and redoes vLLM's post-load step. Draft sessions update the MTP drafter."""

    init_info_cls = SyncInit
    update_info_cls = SyncUpdate
    supports_draft_weight_update = True

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        spec = getattr(vllm_config, "speculative_config", None)
        pc = self.parallel_config
        self.side = WorkerSide(
            lambda: vllm_updater(vllm_config, self._default_model, None),
            lambda senders: senders + worker_index(pc),
            has_drafter=spec is not None and getattr(spec, "draft_model_config", None) is not None,
            device=torch.device(device),
        )

    def parse_init_info(self, init_dict: dict[str, Any]) -> SyncInit:
        return SyncInit.from_dict(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> SyncUpdate:
        return SyncUpdate.from_dict(update_dict)

    def init_transfer_engine(self, init_info: SyncInit) -> None:
        self.side.init(init_info.to_dict())

    def start_weight_update(self) -> None:
        drafter = self.model if self.model is not self._default_model else None
        self.side.start(drafter)
        if drafter is not None:  # the drafter's MoE backend joins the post-load plan
            from vllm.config import set_current_vllm_config
            from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used

            with set_current_vllm_config(self.vllm_config):
                updater = self.side.updater
                updater.plan = engine_postload_plan(
                    updater.config, updater.target, drafter, deepgemm_e8m0=is_deep_gemm_e8m0_used()
                )

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's ``update_weights`` (parse, receive, synchronize), synchronizing only an accelerator:
        the base class's ``torch.accelerator.synchronize()`` raises where there is none (vLLM's
        ``CPUWorker``, a gloo link), after the update has landed."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.device(self.device).type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: SyncUpdate) -> None:
        self.side.receive(update_info.to_dict())

    def finish_weight_update(self) -> None:
        self.side.finish()

    def shutdown(self) -> None:
        self.side.close()


@dataclass
class GlmFp8TrainerInitInfo(TrainerOptions, TrainerInitInfo):
    """The trainer's init info: ``TrainerOptions``' fields (``master_address``, ``master_port``,
    ``engine_ranks``, ``config``, ``mode``...) and ``rank`` (keyword, explicit on every rank)."""

    backend: ClassVar[str] = "glm_fp8"


class GlmFp8TrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """The trainer engine: every trainer rank builds it with ``trainer_init`` and calls
    ``send_weights()`` each step; rank 0 drives the engine through the client."""

    init_info_cls = GlmFp8TrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlmFp8TrainerInitInfo, *, client: Any, source: Any = None):
        if source is None:
            raise ValueError(
                "source: glm_fp8's trainer engine needs a WeightSource (a transformers model: "
                "glm_fp8.integrations.vllm.ModuleStateSource(model)) or a glm_fp8 LayerSource"
            )
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        side = TrainerSide(init_info, client, source, device).connect()
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        engine.side = side
        return engine

    def send_weights(self) -> list[dict]:
        """One step's updates, on every trainer rank. Returns one dict per session ("target", then
        "draft"; or "stream") of what **this rank** did: ``bytes`` it put on the link (0 off the
        link), ``seconds``, ``sender``, ``update_bytes`` (the whole converted update; None off the
        link). See ``TrainerSide.send`` and docs/vllm.md#what-send_weights-returns."""
        return self.side.send()

    # --- the fleet (docs/vllm.md#fleet): on every trainer rank alike, between updates -------------

    @property
    def servers(self) -> list[VllmServer]:
        """The fleet this engine updates, in link order."""
        return list(self.side.servers)

    def set_fleet(self, servers: list[VllmServer]) -> None:
        """Make ``servers`` the fleet (``VllmServer(name, engine_ranks, client)``; the client on trainer
        rank 0): the link is rebuilt, every server re-runs its init, and the next ``send_weights()``
        is a whole update for every server. See ``FleetMembership.set_fleet``."""
        self.side.set_fleet(servers)

    def add_server(self, server: VllmServer) -> None:
        self.side.add_server(server)

    def remove_server(self, name: str) -> None:
        self.side.remove_server(name)

    def replace_server(self, name: str, server: VllmServer) -> None:
        self.side.replace_server(name, server)

    def shutdown(self) -> None:
        self.side.shutdown()


register()

__all__ = ["GlmFp8TrainerInitInfo", "GlmFp8TrainerWeightTransferEngine", "GlmFp8WeightTransferEngine"]
