"""The trainer side of glm_fp8's vLLM weight-transfer backend, without vLLM (docs/vllm.md#the-backend):
``TrainerOptions`` (what ``GlmFp8TrainerInitInfo`` carries) and ``TrainerSide``, which every
trainer rank builds at init and calls each step. It drives the engine through any object with
vLLM's ``VLLMWeightSyncClient`` methods (``LLM``, ``AsyncLLM``, the HTTP routes; rank 0 only).

At init the senders open the link (a TCP store served by trainer rank 0 and a process group of
its own) while rank 0 sends every engine worker the ``SyncInit``; every engine rank then tells
every rank of the link its layout and needs, and all of them derive the same transfer plan. Each
step is one update per session: the target's decoder layers and non-layer tensors, then the MTP
layer in vLLM's draft session when both sides have one; rank 0 calls ``start``, ``update`` (while
every sender sends) and ``finish``.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from glm_fp8.config import as_config
from glm_fp8.integrations.vllm.sources import LayerSource, WeightSourceLayers
from glm_fp8.integrations.vllm.sync import (
    DRAFTS,
    LINK_BACKENDS,
    MODES,
    SyncInit,
    SyncUpdate,
    fleet_layouts,
    fleet_mtp,
    fleet_scale_fmt,
    read_fleet,
    session_layers,
)
from glm_fp8.models import REST, mtp_layer_index
from glm_fp8.transfer.gather import GATHERS, contribute_shards
from glm_fp8.transfer.link import StoreLink
from glm_fp8.transfer.sender import Broadcaster

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, None: None}


@dataclass
class TrainerOptions:
    """What the trainer side needs (``GlmFp8TrainerInitInfo`` has these fields, and ``rank``).

    - ``master_address``, ``master_port``: where trainer rank 0 serves the link's TCP store.
    - ``engine_ranks``: the engine workers (every GPU of every engine and DP replica).
    - ``config``: the model's HF config (a dict, a transformers config object or a config.json path).
    - ``mode``: "auto" (default: many senders when every trainer rank holds whole experts, else
      scatter), "senders", "scatter" or "broadcast" (every engine rank receives every byte).
    - ``trainer_ranks``: the trainer's ranks (default: ``torch.distributed``'s world size, else 1).
    - ``link_backend``: "auto" (NCCL on CUDA, gloo on the CPU), "nccl" or "gloo".
    - ``draft``: "auto" (the MTP layer in vLLM's draft session when the trainer holds it and the
      client can start one), "session", "stream" (one update with it: ``GlmFp8WorkerExtension``)
      or "none" (the target only).
    - ``scale_fmt``: None (what the engines need: power-of-two scales where vLLM re-quantizes for
      DeepGEMM), "fp32" or "ue8m0"; ``checksum``, ``ring``: as ``Broadcaster`` takes them.
    - ``gather``, ``gather_dtype``: how one sender collects DTensor layers (``Broadcaster``).
    - ``timeout_s``: the link's and the rendezvous' timeout.
    """

    master_address: str
    master_port: int
    engine_ranks: int
    config: object
    mode: str = "auto"
    trainer_ranks: int | None = None
    link_backend: str = "auto"
    draft: str = "auto"
    scale_fmt: str | None = None
    checksum: bool = True
    ring: int = 2
    gather: str = "auto"
    gather_dtype: str | None = "bfloat16"
    timeout_s: float = 600.0
    rank: int = field(kw_only=True)

    def check(self) -> None:
        if self.mode not in ("auto", *MODES):
            raise ValueError(f"init_info.mode: expected 'auto' or one of {MODES}, got {self.mode!r}")
        if self.draft not in ("auto", *DRAFTS):
            raise ValueError(f"init_info.draft: expected 'auto' or one of {DRAFTS}, got {self.draft!r}")
        if self.link_backend not in ("auto", *LINK_BACKENDS):
            raise ValueError(
                f"init_info.link_backend: expected 'auto' or one of {LINK_BACKENDS}, got "
                f"{self.link_backend!r}"
            )
        if self.gather not in GATHERS:
            raise ValueError(f"init_info.gather: expected one of {GATHERS}, got {self.gather!r}")
        if self.gather_dtype not in _DTYPES:
            raise ValueError(
                f"init_info.gather_dtype: expected one of {list(_DTYPES)}, got {self.gather_dtype!r}"
            )
        for key in ("engine_ranks", "ring"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < (2 if key == "ring" else 1):
                raise ValueError(
                    f"init_info.{key}: expected an int >= {2 if key == 'ring' else 1}, got {value!r}"
                )


class TrainerSide:
    """One trainer rank's end of the backend; see the module docstring. Build with ``connect``."""

    def __init__(self, opts: TrainerOptions, client: object, source: object, device: torch.device):
        opts.check()
        self.opts, self.client, self.device = opts, client, device
        self.rank = int(opts.rank)
        self.config = as_config(opts.config)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.trainer_ranks = int(opts.trainer_ranks or world)
        self.source = self._source(source)
        self.mode = self._mode()
        self.senders = self.trainer_ranks if self.mode == "senders" else 1
        backend = (
            opts.link_backend
            if opts.link_backend != "auto"
            else ("nccl" if device.type == "cuda" else "gloo")
        )
        draft = opts.draft
        if draft == "auto":
            draft = "session" if self.source.mtp and hasattr(client, "start_draft_weight_update") else "none"
            if self.source.mtp and draft == "none":
                # vLLM's HTTP and Ray clients have no draft session: say so rather than leave the
                # drafter on its old weights without a word.
                warnings.warn(
                    f"init_info.draft='auto': the source holds the MTP layer but "
                    f"{type(client).__name__} has no start_draft_weight_update, so it is not sent; "
                    "wrap AsyncLLM's start_draft_weight_update in the client, or pass draft='none' "
                    "to silence this",
                    stacklevel=2,
                )
        if draft != "none" and not self.source.mtp:
            raise ValueError(
                f"init_info.draft: {draft!r} sends the MTP layer, which the source does not hold"
            )
        self.init = SyncInit(
            master_address=opts.master_address,
            master_port=int(opts.master_port),
            world_size=self.senders + opts.engine_ranks,
            senders=self.senders,
            mode=self.mode,
            link_backend=backend,
            layer_ids=list(self.source.layer_ids),
            rest=self.source.rest,
            draft=draft,
            scale_fmt=opts.scale_fmt,
            checksum=opts.checksum,
            ring=opts.ring,
            timeout_s=float(opts.timeout_s),
        )
        self.init.check()
        self.link: StoreLink | None = None
        self.steps = 0
        self._senders_cache: dict[str, Broadcaster] = {}

    def _source(self, source: object):
        if isinstance(source, LayerSource):
            return _LayerSourceView(source, self.config)
        return WeightSourceLayers(
            source,
            self.config,
            rank=self.rank,
            trainer_ranks=self.trainer_ranks,
            local=False,
            device=self.device,
        )

    def _mode(self) -> str:
        mode = self.opts.mode
        whole = self.source.experts_whole and self.trainer_ranks > 1
        if mode == "auto":
            return "senders" if whole else "scatter"
        if mode == "senders" and not whole:
            raise ValueError(
                "init_info.mode: 'senders' needs every trainer rank to hold whole experts (each expert stack "
                f"Shard(0) over the {self.trainer_ranks} trainer ranks in order); the source does not"
            )
        return mode

    @property
    def on_link(self) -> bool:
        return self.rank < self.senders

    def connect(self) -> TrainerSide:
        """Open the link and learn the engines (rank 0 sends them the init meanwhile)."""
        if self.mode == "senders" and isinstance(self.source, WeightSourceLayers):
            self.source.local = True  # each rank reads its own pieces: iter_local
        if not self.on_link:
            return self
        error: list[BaseException] = []
        rpc = None
        if self.rank == 0:
            rpc = threading.Thread(
                target=_capture,
                args=(error, self.client.init_weight_transfer_engine, self.init.to_dict()),
                daemon=True,
            )
            rpc.start()
        try:
            self.link = StoreLink(
                self.init.master_address,
                self.init.master_port,
                self.rank,
                self.init.world_size,
                backend=self.init.link_backend,
                timeout=timedelta(seconds=self.init.timeout_s),
                device=self.device,
            )
            self.fleet = read_fleet(self.link.store, range(self.senders, self.init.world_size))
        except BaseException as exc:
            if rpc is not None:
                rpc.join(self.init.timeout_s)
                if error and hasattr(exc, "add_note"):
                    exc.add_note(f"the engine's init raised: {type(error[0]).__name__}: {error[0]}")
            raise
        if rpc is not None:
            rpc.join(self.init.timeout_s)
        if error:
            raise error[0]
        self.engines = fleet_layouts(self.fleet, self.senders) if self.mode != "broadcast" else None
        self.scale_fmt = fleet_scale_fmt(self.fleet, self.init.scale_fmt)
        if self.init.draft != "none" and fleet_mtp(self.fleet) != self.mtp:
            raise ValueError(
                f"init_info.draft: {self.init.draft!r} sends the MTP layer, and the engines run no "
                "MTP drafter (speculative decoding off); pass draft='none'"
            )
        return self

    @property
    def mtp(self) -> int | None:
        return mtp_layer_index(self.config)

    def sessions(self) -> list[str]:
        """This step's updates, the same on every trainer rank."""
        if self.init.draft == "stream":
            return ["stream"]
        return ["target"] + (["draft"] if self.init.draft == "session" else [])

    def _broadcaster(self, session: str) -> Broadcaster:
        if session not in self._senders_cache:
            ids, rest = session_layers(self.init, session, self.mtp)
            self._senders_cache[session] = Broadcaster(
                self.link,
                0,
                config=self.config,
                layer_ids=ids,
                rest=rest,
                ring=self.init.ring,
                gather=self.opts.gather,
                gather_dtype=_DTYPES[self.opts.gather_dtype],
                checksum=self.init.checksum,
                scale_fmt=self.scale_fmt,
                engines=self.engines,
                senders=list(range(self.senders)),
                device=self.device,
            )
        return self._senders_cache[session]

    def send(self) -> list[dict]:
        """One step: every session's update (on every trainer rank). Raises what a ``Broadcaster``
        raises (an engine rank's refusal names it), with the engine's own error as a note on rank 0."""
        self.steps += 1
        self.source.begin_step()
        out = []
        for session in self.sessions():
            ids, rest = session_layers(self.init, session, self.mtp)
            layers, rest_map = self.source.session(ids, rest)
            if not self.on_link:
                self._contribute(layers, rest_map, ids)
                continue
            out.append(self._update(session, layers, rest_map))
        self.source.drain()
        return out

    def _contribute(self, layers, rest_map, ids) -> None:
        """A trainer rank off the link (one sender): its part of the sender's gathers."""
        if isinstance(self.source, WeightSourceLayers):
            for _ in layers:  # the pass's full_tensor() gathers
                pass
            if rest_map is not None:
                dict(rest_map)
            return
        items = itertools.chain(layers, [(REST, rest_map)] if rest_map is not None else [])
        contribute_shards(
            items,
            config=self.config,
            sender=0,
            gather=self.opts.gather,
            gather_dtype=_DTYPES[self.opts.gather_dtype],
            device=self.device,
            layer_ids=[*ids, REST] if rest_map is not None else ids,
        )

    def _update(self, session: str, layers, rest_map) -> dict:
        sender = self._broadcaster(session)
        info = SyncUpdate(session, self.steps).to_dict()
        if self.rank != 0:
            stats = sender.broadcast_model(layers, rest=rest_map)
            return {"session": session, "seconds": stats.seconds, "bytes": stats.nbytes}
        start = (
            self.client.start_draft_weight_update if session == "draft" else self.client.start_weight_update
        )
        start()
        error: list[BaseException] = []
        rpc = threading.Thread(target=_capture, args=(error, self.client.update_weights, info), daemon=True)
        rpc.start()
        try:
            stats = sender.broadcast_model(layers, rest=rest_map)
        except BaseException as exc:
            rpc.join(self.init.timeout_s)
            if error and hasattr(exc, "add_note"):
                exc.add_note(f"the engine's update_weights raised: {type(error[0]).__name__}: {error[0]}")
            raise
        rpc.join(self.init.timeout_s)
        if error:
            raise error[0]
        self.client.finish_weight_update()
        return {"session": session, "seconds": stats.seconds, "bytes": stats.nbytes}

    def shutdown(self) -> None:
        self._senders_cache.clear()
        if self.link is not None:
            self.link.close()
            self.link = None


class _LayerSourceView:
    """A ``LayerSource`` as ``TrainerSide`` reads sources."""

    def __init__(self, src: LayerSource, config: Mapping):
        self.src = src
        ids = range(config["num_hidden_layers"]) if src.layer_ids is None else src.layer_ids
        self.layer_ids, self.mtp, self.experts_whole = [int(i) for i in ids], src.mtp, src.experts_whole
        self.rest = src.rest is not None

    def begin_step(self) -> None:
        return None

    def drain(self) -> None:
        return None

    def session(self, layer_ids, rest: bool):
        return self.src.layers(list(layer_ids)), (
            self.src.rest() if rest and self.src.rest is not None else None
        )


def _capture(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
        errors.append(exc)


__all__ = ["TrainerOptions", "TrainerSide"]
