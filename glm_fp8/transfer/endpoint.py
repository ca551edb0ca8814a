"""What a sender and a receiver share: the link, the update's layers and their plans, the
device, the ring of layer buffers and the votes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from glm_fp8.engine.layout import EngineLayout
from glm_fp8.engine.routes import TransferPlan, transfer_plan
from glm_fp8.models import REST, mtp_layer_index
from glm_fp8.plan import SCALE_FMTS, LayerPlan, plans_for_model
from glm_fp8.transfer.scatter import Scatter
from glm_fp8.transfer.wire import (
    COMPLETE,
    DATA,
    Comm,
    checksum_scratch,
    header_words,
    is_process_group,
    manifest_of,
)

MODES = ("fp8", "bf16")


@dataclass
class LayerStats:
    layer: int
    nbytes: int
    seconds: float


@dataclass
class UpdateStats:
    layers: list[LayerStats] = field(default_factory=list)
    seconds: float = 0.0
    peak_bytes: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers)


class Ring:
    """Preallocated layer buffers; a slot is reused only once its last broadcast finished."""

    def __init__(self, size: int, nbytes: int, device: torch.device):
        if size < 1:
            raise ValueError(f"ring: expected at least 1 slot, got {size}")
        self.slots = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(size)]
        cuda = device.type == "cuda"
        self.free = [torch.cuda.Event() if cuda else None for _ in range(size)]
        self.used = [False] * size
        self.scratch = checksum_scratch(nbytes, device)

    def slot(self, k: int, nbytes: int) -> tuple[torch.Tensor, object]:
        i = k % len(self.slots)
        return self.slots[i][:nbytes], i


class Endpoint:
    """The shared setup of ``Broadcaster`` and ``Receiver``.

    ``layer_ids`` (default: every decoder layer of the model; ``glm_fp8.plan.model_layer_ids``
    adds the MTP layer) are the layers of this update in order, then ``REST`` (-1: the
    embeddings, final norm and lm_head, which travel last) when ``rest`` is true; ``plans[k]``
    is the plan of ``layer_ids[k]``. ``engines`` (scatter mode, ``glm_fp8.transfer.scatter``):
    the ``EngineLayout`` of every rank of the link, None at the sender's; each engine rank then
    receives only its shard. ``senders`` (many senders, ``glm_fp8.engine.routes``): the link
    ranks of every trainer rank, in the order of their expert chunks (``engines`` None at each);
    each sends its own experts' share to the engine ranks that hold them, ``src`` leads the
    steps. Both sides build the manifest from them (``glm_fp8.transfer.wire.manifest_of``).
    ``link_stream`` is the stream the link's collectives run on (None on the CPU).
    """

    link_stream: torch.cuda.Stream | None = None

    def __init__(
        self,
        comm: object | None,
        src: int,
        *,
        config: Mapping | None,
        plans: Sequence[LayerPlan] | None,
        layer_ids: Sequence[int] | None,
        ring: int,
        mode: str,
        device: torch.device | str | None,
        rest: bool = False,
        scale_fmt: str | None = None,
        engines: Sequence[EngineLayout | None] | None = None,
        senders: Sequence[int] | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if (config is None) == (plans is None):
            raise ValueError("config / plans: pass exactly one of them")
        if scale_fmt not in (None, *SCALE_FMTS):
            raise ValueError(f"scale_fmt: expected one of {SCALE_FMTS}, got {scale_fmt!r}")
        self.comm, self.src, self.mode = Comm(comm), src, mode
        if plans is not None:
            if rest:
                raise ValueError("rest: needs config= (the non-layer tensors' plan is built from it)")
            if scale_fmt is not None:
                raise ValueError(
                    "scale_fmt: with plans=, the plans' own scale_fmt is used; pass config= instead"
                )
            known = list(range(len(plans)))
        else:
            known = list(range(config["num_hidden_layers"]))
            mtp = mtp_layer_index(config)
            known += [mtp] if mtp is not None else []
        if layer_ids is None:
            self.layer_ids = list(range(len(plans) if plans is not None else config["num_hidden_layers"]))
        else:
            self.layer_ids = [int(i) for i in layer_ids]
            bad = [i for i in self.layer_ids if i not in known]
            if bad:
                raise ValueError(
                    f"layer_ids: layer {bad[0]} is not a layer of the model ({known[0]}..{known[-1]}"
                    f"{', the last the MTP layer' if plans is None and mtp is not None else ''})"
                )
            if len(set(self.layer_ids)) != len(self.layer_ids):
                raise ValueError(f"layer_ids: expected distinct layers, got {self.layer_ids}")
        if not self.layer_ids:
            raise ValueError("layer_ids: expected at least one layer")
        self.rest = bool(rest)
        if self.rest:
            self.layer_ids.append(REST)
        if plans is not None:
            self.plans = [plans[i] for i in self.layer_ids]
        else:
            self.plans = plans_for_model(config, mode, layer_ids=self.layer_ids, scale_fmt=scale_fmt)
        self.device = resolve_device(device) if device else default_device()
        self.link_rank = link_rank(comm)
        self.scatter: Scatter | None = None
        self.routes: TransferPlan | None = None
        self.trainer_group = None
        if senders is not None:
            if engines is None or config is None or mode != "fp8":
                raise ValueError("senders: many senders need engines=, config= and mode='fp8'")
            if src not in senders:
                raise ValueError(f"src: expected one of the senders {list(senders)} (it leads), got {src}")
            self.routes = transfer_plan(config, self.plans, self.layer_ids, engines, senders)
            self.trainer_group = _trainer_group(comm, self.routes.senders)
        elif engines is not None:
            if config is None or mode != "fp8":
                raise ValueError("engines: scatter mode needs config= and mode='fp8'")
            self.scatter = Scatter(comm, src, config, self.plans, self.layer_ids, engines)
        self.ring = Ring(ring, self._slot_nbytes(), self.device)
        self.vote_buf = torch.zeros(1, dtype=torch.int64, device=self.device)

    def _slot_nbytes(self) -> int:
        """The ring's slot size: the largest layer buffer."""
        return max(p.nbytes for p in self.plans)

    def wire_nbytes(self, pos: int) -> int:
        """The bytes the sender sends for the layer at ``pos`` (its header's byte count; with many
        senders, every segment of the layer once)."""
        if self.routes is not None:
            return self.routes.layers[pos].wire_nbytes
        return self.scatter.layers[pos].nbytes if self.scatter is not None else self.plans[pos].nbytes

    def manifest(self, checksum: bool) -> dict:
        m = manifest_of(self.plans, self.layer_ids, self.mode, checksum)
        if self.scatter is not None:
            m["scatter"] = self.scatter.manifest()
        if self.routes is not None:
            m["senders"] = self.routes.manifest()
        return m

    def header_table(self) -> torch.Tensor:
        """int64 [steps + 1, HEADER_WORDS] on the device: every step's header (many senders), the
        announced layers' DATA headers and the last, COMPLETE. The leader sends its rows, the
        engine ranks compare what arrives with theirs, both without a host round trip."""
        rows = [header_words(DATA, i, pos, self.wire_nbytes(pos)) for pos, i in enumerate(self.layer_ids)]
        rows.append(header_words(COMPLETE, -1, len(self.plans)))
        return torch.tensor(rows, dtype=torch.int64).to(self.device)

    def vote(self, code: int) -> int:
        """Contribute ``code`` (0: fine; never negative) to an all-reduce MAX on the link and
        return every rank's maximum (a host read)."""
        with on_stream(self.link_stream):
            self.vote_buf.fill_(max(0, code))
            self.comm.all_reduce_max(self.vote_buf)
            return int(self.vote_buf.item())


class StepVotes:
    """The votes of a pipelined many-senders update, read one step late: a step's vote is queued
    on the link stream behind its messages and copied to host memory there, and the host reads it
    only after it queued the next step, so the link always has a layer to carry (a host read
    waits for that vote's copy only, not for what was queued after it). Two in flight at most:
    step k's vote must be read before step k + 2 is queued."""

    def __init__(self, comm: Comm, device: torch.device):
        cuda = device.type == "cuda"
        self.comm = comm
        self.votes = torch.zeros(2, dtype=torch.int64, device=device)
        self.host = torch.zeros(2, dtype=torch.int64, pin_memory=cuda)
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]

    def post(self, step: int, code: int, flags: Sequence[tuple[torch.Tensor, int]] = ()) -> None:
        """Queue step ``step``'s vote on the current stream: ``code`` (0: fine), raised to ``c``
        for each ``(flag, c)`` whose device boolean ``flag`` is set (a check decided on the
        device: a checksum, a header, non-finite weights), all-reduced MAX over the link."""
        i = step % 2
        buf = self.votes[i : i + 1]
        buf.fill_(max(0, code))
        for flag, c in flags:
            torch.maximum(buf, flag.reshape(1).to(torch.int64) * c, out=buf)
        self.comm.all_reduce_max(buf)
        self.host[i : i + 1].copy_(buf, non_blocking=True)
        if self.events[i] is not None:
            self.events[i].record()

    def read(self, step: int) -> int:
        """Every rank's maximum at step ``step`` (waits for that vote only)."""
        i = step % 2
        if self.events[i] is not None:
            self.events[i].synchronize()
        return int(self.host[i])


def link_rank(comm: object | None) -> int:
    """This process's rank on the link: the group's rank, a stand-in's ``rank``, else the global
    rank (0 without torch.distributed)."""
    import torch.distributed as dist

    if comm is not None and not is_process_group(comm) and isinstance(getattr(comm, "rank", None), int):
        return comm.rank
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(comm) if comm is None or is_process_group(comm) else dist.get_rank()


def _trainer_group(comm: object | None, senders: Sequence[int]):
    """The senders' own process group (their step votes), created by every process of the
    default group as ``torch.distributed.new_group`` requires; None for a stand-in link."""
    import torch.distributed as dist

    if not (comm is None or is_process_group(comm)) or not dist.is_initialized():
        return None
    glob = [r if comm is None else dist.get_global_rank(comm, r) for r in senders]
    return dist.new_group(sorted(glob))


def my_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class on_stream:
    """``torch.cuda.stream(s)`` when ``s`` is a stream, a no-op on the CPU."""

    def __init__(self, stream):
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            return self.ctx.__exit__(*exc)
        return False


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: "cuda" is the current CUDA device, as a tensor made there
    reports it (``cuda:0``), so that a parameter's device compares equal to the endpoint's."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
