"""The engine side of glm_fp8's vLLM weight-transfer backend, without vLLM (docs/vllm.md#the-backend):
``WorkerSide``, one engine worker's end, which vLLM's ``GlmFp8WeightTransferEngine`` and the
``GlmFp8WorkerExtension`` adapter both drive (one code path).

``init`` joins the link the trainer opened and tells every rank this worker's layout and needs
(or why it cannot take part: every rank raises naming it); ``start``, ``receive`` and ``finish``
are one session of vLLM's four-phase handshake: ``receive`` lands one update
(``EngineUpdater.update``) and ``finish`` gives its buffers back. The updater keeps one receiver
per session (target, draft) for the link's life: with delta updates, what it holds; a new init (a
rebuilt link) or a restarted worker holds nothing, so its first update is dense.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from glm_fp8.core.checks import check_int
from glm_fp8.integrations.vllm.fleet_link import open_link
from glm_fp8.integrations.vllm.gate import publish_ready, wait_gate
from glm_fp8.integrations.vllm.sync import (
    MAX_LINK_RANKS,
    SyncInit,
    SyncUpdate,
    fleet_layouts,
    fleet_mtp,
    fleet_scale_fmt,
    publish,
    read_fleet,
    session_holders,
    session_layers,
)
from glm_fp8.integrations.vllm.updater import EngineUpdater
from glm_fp8.transfer.link import StoreLink


def worker_index(parallel_config: object) -> int:
    """This worker's index among the engine's workers, in vLLM's world order (``dp * T + rank``,
    ``T`` = TP x PP): its link rank after the senders. vLLM's own NCCL backend computes
    ``data_parallel_index * world_size + rank`` (``nccl_common.py::_worker_group_rank``), which
    is this with vLLM's executors; under ``external_launcher`` (torchrun starts every rank) vLLM
    makes ``world_size`` span the DP replicas and ``rank`` the global ``RANK`` already
    (``config/parallel.py``, ``worker_base.py``), so the rank alone is the index."""
    pc = parallel_config
    world = check_int("parallel_config.world_size", getattr(pc, "world_size", None), 1, MAX_LINK_RANKS)
    # A rank at or past the world would take another worker's link index: refused, not collided.
    why = f" (a worker of a world of parallel_config.world_size={world})"
    rank = check_int("parallel_config.rank", getattr(pc, "rank", None), 0, world - 1, why)
    if getattr(pc, "distributed_executor_backend", None) == "external_launcher":
        return rank
    dp = check_int(
        "parallel_config.data_parallel_index", getattr(pc, "data_parallel_index", None), 0, MAX_LINK_RANKS - 1
    )
    return dp * world + rank


class WorkerSide:
    """One engine worker's end of the backend.

    Args:
        make_updater: builds this worker's ``EngineUpdater`` (its layout, parameters and post-load
            plan); called at the first ``init``. What it raises is this worker's refusal, told to
            every rank of the link.
        link_rank: this worker's link rank, given its server's first link rank (``rank_offset``: the
            trainer ranks that send, then the earlier servers' workers).
        has_drafter: the engine runs an MTP drafter (speculative decoding), whose module may be
            handed over only in a draft session (``start(drafter=...)``).
        device: where the parameters live and updates are received.
    """

    def __init__(
        self,
        make_updater: Callable[[], EngineUpdater],
        link_rank: Callable[[int], int],
        *,
        has_drafter: bool,
        device: torch.device,
    ):
        self.make_updater, self.link_rank, self.has_drafter, self.device = (
            make_updater,
            link_rank,
            has_drafter,
            device,
        )
        self.updater: EngineUpdater | None = None
        self.link: StoreLink | None = None
        self.init_info: SyncInit | None = None
        self.session: str | None = None
        self.results: list[dict] = []

    def init(self, payload: Mapping) -> dict:
        """Join the trainer's link (``SyncInit``) and learn the fleet; raises on this worker's
        refusal or any other rank's, naming it. Again (a new generation of the fleet: a server
        added, removed or replaced): the old link is torn down first."""
        info = SyncInit.from_dict(payload)
        self.close()
        offset = info.senders if info.rank_offset is None else info.rank_offset
        rank = self.link_rank(offset)
        name, first, workers = next(s for s in info.fleet() if s[1] == offset)
        if not first <= rank < first + workers:
            raise ValueError(
                f"init_info.world_size: this worker is link rank {rank}, outside its server's ranks "
                f"{first}..{first + workers - 1} ({f'server {name!r}: ' if name else ''}{workers} workers "
                f"after {first} senders and earlier servers' workers); the trainer's engine_ranks"
                f"{'' if info.servers is None else ' for this server'} must be its TP x DP"
            )
        self.link = open_link(info, rank, self.device)
        desc: dict = {"error": None}
        try:
            if self.updater is None:
                self.updater = self.make_updater()
            if info.delta and (err := self.updater.delta_refusal(info.scale_fmt)) is not None:
                raise err  # at init, told to every rank: nothing has moved
            desc.update(self.updater.describe())
            desc["mtp"] = self.updater.mtp_index if self.has_drafter else None
        except Exception as exc:  # noqa: BLE001 - told to every rank, then raised here too
            desc["error"] = f"{type(exc).__name__}: {exc}"
            publish(self.link.store, rank, desc)
            raise
        publish(self.link.store, rank, desc)
        fleet = read_fleet(self.link.store, range(info.senders, info.world_size), name=info.rank_name)
        self.engines = fleet_layouts(fleet, info.senders) if info.mode != "broadcast" else None
        self.scale_fmt = fleet_scale_fmt(fleet, info.scale_fmt)
        self.mtp = fleet_mtp(fleet)
        self.init_info, self.rank = info, rank
        return {"rank": rank, **desc}

    def start(self, drafter: torch.nn.Module | None = None) -> None:
        """Begin a session; a draft session hands over the drafter module."""
        if self.init_info is None:
            raise RuntimeError("glm_fp8: init_weight_transfer_engine first (the trainer's trainer_init)")
        if drafter is not None and drafter is not self.updater.drafter:
            self.updater.attach_drafter(drafter)
        self.session = "draft" if drafter is not None else "target"

    def receive(self, update_info: Mapping) -> dict:
        """Land one update (the trainer sends at the same time). First the update's gate
        (``glm_fp8.integrations.vllm.sync``): this worker says it is ready, or why not (no session
        started, an update of another session), and waits for trainer rank 0's go; a refusal,
        its own or another's, is raised by every rank at once and nothing moves."""
        update = SyncUpdate.from_dict(update_info)
        if self.init_info is None:
            raise RuntimeError("glm_fp8: init_weight_transfer_engine first (the trainer's trainer_init)")
        refusal = error = None
        if self.session is None:
            refusal = "start_weight_update first: no weight-update session is open on this worker"
            error = RuntimeError(f"glm_fp8: {refusal}")
        elif (update.session == "draft") != (self.session == "draft"):
            refusal = f"update_info.session: {update.session!r} in a {self.session} session"
            error = ValueError(f"glm_fp8: {refusal}")
        else:
            # What the update holds is worked out before this worker says it is ready: an error
            # here is a refusal at the gate, which every rank raises at once. After the "go" the
            # other ranks are in the transfer, and would wait for this one until the link's timeout.
            try:
                ids, rest = session_layers(self.init_info, update.session, self.updater.mtp_index)
                holders = session_holders(self.init_info, ids, rest)
            except Exception as exc:  # noqa: BLE001 - told to every rank, then raised here
                refusal, error = f"{type(exc).__name__}: {exc}", exc
        publish_ready(self.link.store, update.step, update.session, self.rank, refusal)
        if error is not None:
            raise error
        wait_gate(self.link.store, update.step, update.session)
        result = self.updater.update(
            self.link,
            0,
            layer_ids=ids,
            rest=rest,
            scale_fmt=self.scale_fmt,
            ring=self.init_info.ring,
            step_layers=self.init_info.step_layers,
            engines=self.engines,
            senders=list(range(self.init_info.senders)),
            checksum=self.init_info.checksum,
            device=self.device,
            delta=self.init_info.delta,
            holders=holders,
        )
        self.results.append(result)
        return result

    def finish(self) -> None:
        """End the session: the receive buffers are already given back; the allocator's cache is
        emptied so that what the engine lent (KV cache) is whole again."""
        self.session = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.link, self.init_info, self.session = None, None, None
        if self.updater is not None:
            self.updater.drop_link()


__all__ = ["WorkerSide", "worker_index"]
