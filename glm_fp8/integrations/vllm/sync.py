"""The handshake of glm_fp8's vLLM weight-transfer backend, both sides, without vLLM
(docs/vllm.md#the-backend): what the trainer sends every engine worker at init (``SyncInit``) and
with each update (``SyncUpdate``), and how every rank of the link learns every engine rank's
layout and needs (``publish`` / ``read_fleet``: JSON through the link's TCP store, no pickle).

The link's ranks: the trainer ranks that send, ``0 .. senders - 1``, then the engine workers,
``senders + data_parallel_index * world_size + rank`` (vLLM's own numbering of a DP fleet's
workers, ``nccl_common.py::_worker_group_rank``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta

from glm_fp8.engine.layout import EngineLayout
from glm_fp8.plan import SCALE_FMTS

HANDSHAKE_VERSION = 1
MODES = ("broadcast", "scatter", "senders")
DRAFTS = ("session", "stream", "none")
LINK_BACKENDS = ("nccl", "gloo")


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


@dataclass(frozen=True)
class SyncInit:
    """What every engine worker gets at init: the link (``master_address:master_port``, a TCP
    store served by trainer rank 0; ``world_size`` ranks, the first ``senders`` the trainer's;
    ``link_backend`` "nccl" or "gloo"), the mode the trainer chose, what an update carries
    (``layer_ids`` of the target session, ``rest``; ``draft``: the MTP layer in a draft session of
    its own, in the same stream, or not at all) and the wire options (``scale_fmt`` None: as the
    engines need, ``checksum``, ``ring``)."""

    master_address: str
    master_port: int
    world_size: int
    senders: int
    mode: str
    link_backend: str
    layer_ids: list[int]
    rest: bool = True
    draft: str = "session"
    scale_fmt: str | None = None
    checksum: bool = True
    ring: int = 2
    timeout_s: float = 600.0
    version: int = HANDSHAKE_VERSION

    @classmethod
    def from_dict(cls, d: Mapping) -> SyncInit:
        """Parse and check a payload (from JSON: the HTTP route passes it unchanged); a ValueError
        names the key."""
        if not isinstance(d, Mapping):
            raise ValueError(f"init_info: expected a mapping, got {type(d).__name__}")
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
            mode=_field(d, "mode", str, f"one of {MODES}"),
            link_backend=_field(d, "link_backend", str, f"one of {LINK_BACKENDS}"),
            layer_ids=list(_field(d, "layer_ids", list, "a list of layer indices")),
            rest=_field(d, "rest", bool, "a bool", True),
            draft=_field(d, "draft", str, f"one of {DRAFTS}", "session"),
            scale_fmt=_field(d, "scale_fmt", (str, type(None)), f"None or one of {SCALE_FMTS}", None),
            checksum=_field(d, "checksum", bool, "a bool", True),
            ring=_field(d, "ring", int, "an int >= 2", 2),
            timeout_s=float(_field(d, "timeout_s", (int, float), "seconds", 600.0)),
        )
        out.check()
        return out

    def check(self) -> None:
        if not 0 < self.master_port < 65536:
            raise ValueError(f"init_info.master_port: expected 1..65535, got {self.master_port}")
        if not 1 <= self.senders < self.world_size:
            raise ValueError(
                f"init_info.senders: expected 1 <= senders < world_size={self.world_size}, got {self.senders}"
            )
        for key, allowed in (("mode", MODES), ("draft", DRAFTS), ("link_backend", LINK_BACKENDS)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"init_info.{key}: expected one of {allowed}, got {getattr(self, key)!r}")
        if self.scale_fmt not in (None, *SCALE_FMTS):
            raise ValueError(
                f"init_info.scale_fmt: expected None or one of {SCALE_FMTS}, got {self.scale_fmt!r}"
            )
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in self.layer_ids):
            raise ValueError(f"init_info.layer_ids: expected a list of ints, got {self.layer_ids!r}")
        if self.ring < 2:
            raise ValueError(f"init_info.ring: expected at least 2, got {self.ring}")
        if self.mode != "senders" and self.senders != 1:
            raise ValueError(f"init_info.senders: mode {self.mode!r} has one sender, got {self.senders}")
        if not self.timeout_s > 0:
            raise ValueError(f"init_info.timeout_s: expected > 0, got {self.timeout_s}")

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
        if not isinstance(d, Mapping):
            raise ValueError(f"update_info: expected a mapping, got {type(d).__name__}")
        session = d.get("session")
        if session not in SESSIONS:
            raise ValueError(f"update_info.session: expected one of {SESSIONS}, got {session!r}")
        step = d.get("step", 0)
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"update_info.step: expected an int, got {step!r}")
        return cls(session, step, {k: v for k, v in d.items() if k not in ("session", "step")})

    def to_dict(self) -> dict:
        return {"session": self.session, "step": self.step, **self.extra}


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


def read_fleet(store, ranks: Sequence[int]) -> dict[int, dict]:
    """Every engine rank's description (waits for each, up to the store's timeout); raises
    naming the first rank that reported an error, on every rank alike."""
    fleet = {r: json.loads(store.get(_key(r)).decode()) for r in ranks}
    for r, desc in fleet.items():
        if desc.get("error"):
            raise RuntimeError(f"engine rank {r} refused the weight transfer: {desc['error']}")
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


__all__ = [
    "DRAFTS",
    "HANDSHAKE_VERSION",
    "LINK_BACKENDS",
    "MODES",
    "SESSIONS",
    "SyncInit",
    "SyncUpdate",
    "fleet_layouts",
    "fleet_mtp",
    "fleet_scale_fmt",
    "publish",
    "read_fleet",
    "session_layers",
]
