"""The handshake of glm_fp8's vLLM weight-transfer backend, both sides, without vLLM
(docs/vllm.md#the-backend): what the trainer sends every engine worker at init (``SyncInit``) and
with each update (``SyncUpdate``), and how every rank of the link learns every engine rank's
layout and needs (``publish`` / ``read_fleet``: JSON through the link's TCP store, no pickle).

The link's ranks: the trainer ranks that send, ``0 .. senders - 1``, then each server's engine
workers in the order of the fleet (``servers``), server ``k``'s at ``rank_offset`` (``senders`` plus
the earlier servers' workers) ``+ data_parallel_index * world_size + rank`` (vLLM's own numbering
of a DP engine's workers and its ``rank_offset``, ``nccl_common.py::_worker_group_rank``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta

from glm_fp8.core.checks import check_int, check_seconds
from glm_fp8.core.vocab import (
    DRAFTS,
    LINK_BACKENDS,
    SCALE_FORMATS,
    TRANSFER_MODES,
    Draft,
    LinkBackend,
    ScaleFormat,
    TransferMode,
    check_choice,
)
from glm_fp8.engine.layout import EngineLayout
from glm_fp8.model.families import REST

# checked at init, before any buffer is sized
from glm_fp8.transfer.options import MAX_RING, MAX_STEP_LAYERS, check_holders, holders_of

# 2: every update passes the gate (``publish_ready`` / ``open_gate``) before the link is used.
HANDSHAKE_VERSION = 2
# Link ranks (trainer senders + engine workers): far above any cluster (one rank per GPU), and
# small enough that nothing sized per rank (the store's keys, the engines list) can exhaust memory.
MAX_LINK_RANKS = 1 << 16


def _field(d: Mapping, key: str, kinds: type | tuple[type, ...], what: str, default=KeyError):
    if key not in d:
        if default is KeyError:
            raise ValueError(f"init_info.{key}: missing; expected {what}")
        return default
    value = d[key]
    if (
        isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,))
    ) or not isinstance(value, kinds):
        raise ValueError(f"init_info.{key}: expected {what}, got {value!r}")
    return value


def from_json(what: str, payload: object) -> Mapping:
    """A payload that may come as JSON text (the dev server's ``/collective_rpc`` route passes
    strings to the worker extension) as a mapping: a mapping as it is, JSON text parsed; a
    ValueError naming ``what`` otherwise. Only the extension's entry points take text; everything
    behind them takes mappings (``as_mapping``)."""
    if isinstance(payload, (str, bytes, bytearray)):
        try:
            payload = json.loads(payload)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(
                f"{what}: not valid JSON ({exc}); expected a JSON object of glm_fp8's fields"
            ) from None
    if not isinstance(payload, Mapping):
        raise ValueError(f"{what}: expected a mapping (or its JSON text), got {type(payload).__name__}")
    return payload


def as_mapping(what: str, payload: object) -> Mapping:
    """``payload`` if it is a mapping; a ValueError naming ``what`` otherwise (text too: JSON is
    parsed where it arrives, by the worker extension, not taken here in its place)."""
    if not isinstance(payload, Mapping):
        hint = (
            " (JSON text: parse it first, e.g. with from_json)" if isinstance(payload, (str, bytes)) else ""
        )
        raise ValueError(
            f"{what}: expected a mapping of glm_fp8's fields, got {type(payload).__name__}{hint}"
        )
    return payload


def check_delta(mode: str, checksum: bool) -> None:
    """A ValueError naming the init info's field for what delta updates cannot run with: the full
    broadcast (a vLLM worker lands through its layout, which cuts its shard out of whole entries,
    so its parameters are not what arrived and the old segment cannot be rebuilt from them), and
    no checksums (they prove each rebuilt layer exact)."""
    if mode == "broadcast":
        raise ValueError(
            "init_info.mode: delta=True needs each engine rank to receive its own shard; with 'broadcast' a "
            "worker cuts its shard out of whole entries, so its parameters are not the bytes that arrived; "
            "pass mode='scatter' or 'senders', or delta=False"
        )
    if not checksum:
        raise ValueError(
            "init_info.checksum: delta=True needs checksum=True (the checksum proves each rebuilt layer "
            "exact)"
        )


@dataclass(frozen=True)
class SyncInit:
    """What every engine worker gets at init: the link (``master_address:master_port``, a TCP
    store served by trainer rank 0; ``world_size`` ranks, the first ``senders`` the trainer's;
    ``link_backend`` "nccl" or "gloo"), the mode the trainer chose, what an update carries
    (``layer_ids`` of the target session, ``rest``; ``draft``: the MTP layer in a draft session of
    its own, in the same stream, or not at all) and the wire options (``scale_fmt`` None: as the
    engines need, ``checksum``, ``ring``).

    A fleet (several vLLM servers on one link): ``servers`` lists every server as ``[name,
    first link rank, workers]`` in link order (None: one server, its workers from ``senders``);
    ``rank_offset`` is the first link rank of the server this init is sent to (None: ``senders``);
    ``generation`` counts the link's rebuilds (a change of membership): its keys in the store
    live under it, so a rebuilt link never reads an old one's. ``delta``: updates carry only the
    bytes that changed (docs/delta.md): each worker keeps its receivers, and what they hold,
    across the updates of this link; mode "scatter" only. ``holders``: which senders hold which
    layers (a Megatron-Core trainer's pipeline stages; ``SendOptions.holders`` as ``[[layer,
    link ranks or [[entry, link ranks], ...]], ...]``), None: every sender every layer; mode
    "senders" only. ``step_layers``: the most layers one step carries
    (``UpdateOptions.step_layers``); 1 with ``delta``."""

    master_address: str
    master_port: int
    world_size: int
    senders: int
    mode: TransferMode
    link_backend: LinkBackend
    layer_ids: list[int]
    rest: bool = True
    draft: Draft = "session"
    scale_fmt: ScaleFormat | None = None
    checksum: bool = True
    ring: int = 2
    step_layers: int = 1
    timeout_s: float = 600.0
    rank_offset: int | None = None
    servers: list | None = None
    generation: int = 0
    delta: bool = False
    holders: list | None = None
    version: int = HANDSHAKE_VERSION

    @classmethod
    def from_dict(cls, d: Mapping) -> SyncInit:
        """Parse and check a payload (from JSON: the HTTP route passes it unchanged); a ValueError
        names the key."""
        d = as_mapping("init_info", d)
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"init_info.{unknown[0]}: not a field of glm_fp8's init info")
        version = _field(d, "version", int, f"the handshake version {HANDSHAKE_VERSION}", HANDSHAKE_VERSION)
        if version != HANDSHAKE_VERSION:
            raise ValueError(f"init_info.version: expected {HANDSHAKE_VERSION} (this glm_fp8), got {version}")
        out = cls(
            master_address=_field(d, "master_address", str, "the TCP store's host"),
            master_port=_field(d, "master_port", int, "the TCP store's port"),
            world_size=_field(d, "world_size", int, "the link's ranks (senders + engine workers)"),
            senders=_field(d, "senders", int, "the trainer ranks that send"),
            mode=_field(d, "mode", str, f"one of {TRANSFER_MODES}"),
            link_backend=_field(d, "link_backend", str, f"one of {LINK_BACKENDS}"),
            layer_ids=list(_field(d, "layer_ids", list, "a list of layer indices")),
            rest=_field(d, "rest", bool, "a bool", True),
            draft=_field(d, "draft", str, f"one of {DRAFTS}", "session"),
            scale_fmt=_field(d, "scale_fmt", (str, type(None)), f"None or one of {SCALE_FORMATS}", None),
            checksum=_field(d, "checksum", bool, "a bool", True),
            ring=_field(d, "ring", int, "an int >= 2", 2),
            step_layers=_field(d, "step_layers", int, "an int >= 1", 1),
            timeout_s=_field(d, "timeout_s", (int, float), "seconds", 600.0),
            rank_offset=_field(d, "rank_offset", (int, type(None)), "the server's first link rank", None),
            servers=_field(d, "servers", (list, type(None)), "[[name, first link rank, workers], ...]", None),
            generation=_field(d, "generation", int, "the link's generation (an int >= 0)", 0),
            delta=_field(d, "delta", bool, "a bool", False),
            holders=_field(d, "holders", (list, type(None)), "[[layer, link ranks], ...]", None),
        )
        out.check()
        return out

    def check(self) -> None:
        """Every field's type and range (a ValueError naming it): the trainer checks what it builds,
        a worker what it is sent."""
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError(f"init_info.master_address: expected a host name, got {self.master_address!r}")
        check_int("init_info.master_port", self.master_port, 1, 65535, " (a TCP port)")
        check_int(
            "init_info.world_size",
            self.world_size,
            2,
            MAX_LINK_RANKS,
            " (the link's ranks: the senders, then every engine worker)",
        )
        check_int(
            "init_info.senders",
            self.senders,
            1,
            self.world_size - 1,
            f" (the trainer ranks that send, fewer than world_size={self.world_size})",
        )
        for key, allowed in (("mode", TRANSFER_MODES), ("draft", DRAFTS), ("link_backend", LINK_BACKENDS)):
            check_choice(f"init_info.{key}", getattr(self, key), allowed)
        check_choice("init_info.scale_fmt", self.scale_fmt, SCALE_FORMATS, also=(None,))
        if not isinstance(self.layer_ids, (list, tuple)):
            raise ValueError(f"init_info.layer_ids: expected a list of layer indices, got {self.layer_ids!r}")
        for k, i in enumerate(self.layer_ids):
            check_int(f"init_info.layer_ids[{k}]", i, 0, None, " (a decoder layer's index)")
        for key in ("rest", "checksum", "delta"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"init_info.{key}: expected True or False, got {getattr(self, key)!r}")
        check_int("init_info.ring", self.ring, 2, MAX_RING, " (layer buffers per rank; 2 overlap every step)")
        check_int("init_info.step_layers", self.step_layers, 1, MAX_STEP_LAYERS, " (layers a step carries)")
        if self.delta and self.step_layers != 1:
            raise ValueError(
                f"init_info.step_layers: {self.step_layers} with delta; a delta update carries one "
                "layer a step"
            )
        if self.step_layers > 1 and self.holders is None:
            raise ValueError(
                f"init_info.step_layers: {self.step_layers} needs holders (a Megatron-Core source's "
                "pipeline stages); every sender holds every layer"
            )
        if self.mode != "senders" and self.senders != 1:
            raise ValueError(f"init_info.senders: mode {self.mode!r} has one sender, got {self.senders}")
        check_seconds("init_info.timeout_s", self.timeout_s)
        check_int("init_info.generation", self.generation, 0, None, " (the link's rebuilds)")
        if self.delta:
            check_delta(self.mode, self.checksum)
        if self.holders is not None:
            if self.mode != "senders":
                raise ValueError(
                    f"init_info.holders: for mode 'senders' (many senders), got mode {self.mode!r}"
                )
            try:
                check_holders(holders_of(self.holders))
            except (TypeError, ValueError) as e:
                raise ValueError(f"init_info.{e}") from None
        self._check_servers()

    def _check_servers(self) -> None:
        """The fleet tiles the link's engine ranks in order, and ``rank_offset`` starts one server."""
        servers = self.servers
        if servers is None:
            if self.rank_offset not in (None, self.senders):
                raise ValueError(
                    f"init_info.rank_offset: {self.rank_offset!r} without init_info.servers; expected None "
                    f"or senders={self.senders}"
                )
            return
        at, names = self.senders, set()
        for k, entry in enumerate(servers):
            what = f"init_info.servers[{k}]"
            if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not isinstance(entry[0], str):
                raise ValueError(f"{what}: expected [name, first link rank, workers], got {entry!r}")
            if not entry[0] or entry[0] in names:
                raise ValueError(f"{what}: the name {entry[0]!r} is empty or used twice")
            names.add(entry[0])
            check_int(f"{what}[1]", entry[1], at, at, f" (server {entry[0]!r} starts after the last one)")
            at += check_int(f"{what}[2]", entry[2], 1, MAX_LINK_RANKS - 1, f" ({entry[0]!r}'s workers)")
        if at != self.world_size:
            raise ValueError(
                f"init_info.servers: the servers' workers end at link rank {at}; world_size={self.world_size}"
            )
        if self.rank_offset is not None and self.rank_offset not in [e[1] for e in servers]:
            raise ValueError(
                f"init_info.rank_offset: {self.rank_offset!r} is no server's first link rank "
                f"{[e[1] for e in servers]}"
            )

    def fleet(self) -> list[tuple[str, int, int]]:
        """Every server as ``(name, first link rank, workers)``: one nameless server when the trainer
        sent no ``servers`` (one vLLM engine)."""
        if self.servers is None:
            return [("", self.senders, self.world_size - self.senders)]
        return [(str(n), int(o), int(w)) for n, o, w in self.servers]

    def rank_name(self, rank: int) -> str:
        """Link rank ``rank`` in words: "engine rank 5 (server 'decode' #1, its worker 2)"."""
        if rank < self.senders:
            return f"trainer rank {rank} (a sender)"
        for k, (name, first, workers) in enumerate(self.fleet()):
            if first <= rank < first + workers:
                # one server without a name (one vLLM engine): the rank says it all
                where = f" (server {name!r} #{k}, its worker {rank - first})" if name else ""
                return f"engine rank {rank}{where}"
        return f"link rank {rank} (outside the link's {self.world_size})"

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)


SESSIONS = ("target", "draft", "stream")


@dataclass(frozen=True)
class SyncUpdate:
    """What one update carries: ``session`` "target" (the init's ``layer_ids`` and ``rest``),
    "draft" (the MTP layer, in vLLM's draft session) or "stream" (both in one update); ``step``
    counts the trainer's updates."""

    session: str
    step: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping) -> SyncUpdate:
        d = as_mapping("update_info", d)
        session = d.get("session")
        if session not in SESSIONS:
            raise ValueError(f"update_info.session: expected one of {SESSIONS}, got {session!r}")
        step = check_int("update_info.step", d.get("step", 0), 0, None, " (the trainer's update count)")
        return cls(session, step, {k: v for k, v in d.items() if k not in ("session", "step")})

    def to_dict(self) -> dict:
        return {"session": self.session, "step": self.step, **self.extra}


def session_holders(init: SyncInit, layer_ids: Sequence[int], rest: bool) -> dict | None:
    """The holders of an update of ``layer_ids`` (and the non-layer tensors when ``rest``)."""
    if init.holders is None:
        return None
    wanted = set(layer_ids) | ({REST} if rest else set())
    return {idx: h for idx, h in holders_of(init.holders).items() if idx in wanted}


def session_layers(init: SyncInit, session: str, mtp: int | None) -> tuple[list[int], bool]:
    """(layer_ids, rest) of an update of ``session``: the target's layers and the non-layer
    tensors, the MTP layer ``mtp`` alone, or all of them in one stream."""
    if session == "target":
        return list(init.layer_ids), init.rest
    if mtp is None:
        raise ValueError(f"update_info.session: {session!r} carries the MTP layer; the model has none")
    if session == "draft":
        return [mtp], False
    return [*init.layer_ids, mtp], init.rest


# --- what every engine rank tells every rank of the link, through the TCP store ------------------


def _key(rank: int) -> str:
    return f"glm_fp8/fleet/{rank}"


def publish(store, rank: int, desc: Mapping) -> None:
    """This engine rank's description (``EngineUpdater.describe()`` and its ``error``, if it cannot
    take part), as JSON under its rank."""
    store.set(_key(rank), json.dumps(dict(desc), default=str))


def read_fleet(store, ranks: Sequence[int], name=None) -> dict[int, dict]:
    """Every engine rank's description (waits for each, up to the store's timeout); raises
    naming the first rank that reported an error (``name(rank)``: its server too), on every rank alike."""
    fleet = {r: json.loads(store.get(_key(r)).decode()) for r in ranks}
    for r, desc in fleet.items():
        if desc.get("error"):
            who = name(r) if name is not None else f"engine rank {r}"
            raise RuntimeError(f"{who} refused the weight transfer: {desc['error']}")
    return fleet


def fleet_layouts(fleet: Mapping[int, Mapping], senders: int) -> list[EngineLayout | None]:
    """The ``engines`` list of the link: None at each sender, then each engine rank's layout."""
    out: list[EngineLayout | None] = [None] * senders
    for r in sorted(fleet):
        lay = fleet[r]["layout"]
        out.append(EngineLayout(**lay, sequence_parallel_moe=fleet[r].get("sequence_parallel_moe")))
    return out


def fleet_scale_fmt(fleet: Mapping[int, Mapping], asked: str | None) -> str:
    """The scale format of the updates: the one asked for, else the one every engine rank needs
    (power-of-two scales where vLLM re-quantizes for DeepGEMM); engines that need different ones
    cannot share an update."""
    needs = {desc["scale_fmt"] for desc in fleet.values()}
    if asked is not None:
        return asked
    if len(needs) > 1:
        raise RuntimeError(
            f"engine ranks need different scale formats {sorted(needs)}; one update cannot serve them"
        )
    return needs.pop() if needs else "fp32"


def fleet_mtp(fleet: Mapping[int, Mapping]) -> int | None:
    """The MTP layer's index when every engine rank runs an MTP drafter, else None."""
    mtps = {desc.get("mtp") for desc in fleet.values()}
    return mtps.pop() if len(mtps) == 1 else None


# --- what trainer rank 0 decided, for every trainer rank -----------------------------------------

_TRAINER_INIT = "glm_fp8/trainer/init"


def publish_trainer_init(store, init: SyncInit) -> None:
    """Trainer rank 0's ``SyncInit`` (its ``draft`` decided by the client it holds), for the other
    trainer ranks to adopt."""
    store.set(_TRAINER_INIT, json.dumps(init.to_dict()))


def read_trainer_init(store) -> SyncInit:
    return SyncInit.from_dict(json.loads(store.get(_TRAINER_INIT).decode()))


__all__ = [
    "MAX_LINK_RANKS",
    "HANDSHAKE_VERSION",
    "SESSIONS",
    "SyncInit",
    "SyncUpdate",
    "check_delta",
    "fleet_layouts",
    "fleet_mtp",
    "fleet_scale_fmt",
    "from_json",
    "publish",
    "publish_trainer_init",
    "read_fleet",
    "read_trainer_init",
    "session_layers",
]
