"""The link an update travels on: one interface over every transport (``Link``), and the adapters.

A link has ranks ``0 .. size - 1`` (the trainer ranks that send and the engine ranks that
receive) and offers what the protocol (``glm_fp8.transfer.wire``) needs: a broadcast from one
rank, an all-reduce MAX (the votes), point-to-point messages posted together (``exchange``), and,
where the transport can make them, groups of some ranks (``make_groups``), in which a single
sender gives a class of replicas one broadcast. Groups are made only after the manifest vote, by
every rank alike, and kept for the link's life, so that endpoints rebuilt on one side and reused
on the other find the same groups.

Where the link has a store (``StoreLink``, ``TorchLink``), every rank also beats in it
(``glm_fp8.transfer.liveness``): a rank that dies or hangs is found within seconds, and every rank's
next wait on the link raises ``LinkLost`` naming it, whatever the transport still waits for.

Adapters (``as_link``):
- a ``torch.distributed`` ProcessGroup, or None for the default group (``TorchLink``); its groups
  are ``torch.distributed.new_group``, which every process of the default group must make, so they
  exist only when the link spans the default group;
- ``StoreLink``: a process group built from a TCP store, outside ``torch.distributed``'s default
  group (a trainer and a vLLM engine each have their own); groups are made by their members only;
- any object with vLLM's ``PyNcclCommunicator`` methods (``broadcast``, ``all_reduce``, ``send``,
  ``recv``, ``group_start``, ``group_end``, ``rank``, ``world_size``): ``ObjectLink``, no groups;
- ``HostSinkComm``: a one-GPU stand-in whose sends are device-to-host copies.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from glm_fp8.transfer.liveness import DEFAULT_LEASE_S, Liveness

Message = tuple[torch.Tensor, int]  # (tensor, peer link rank)


class Link:
    """What the protocol needs of a transport; ranks are link ranks."""

    rank: int = 0
    size: int = 1
    #: a single sender can broadcast to a class of several ranks in a group of its own
    groups_supported: bool = False
    #: a stand-in whose other ranks do not exist: votes among the senders are this rank's own
    stand_in: bool = False
    #: the watch over the link's ranks (None: the transport's own errors and timeout only)
    liveness: Liveness | None = None

    def check(self) -> None:
        """Raise ``LinkLost`` if a rank of the link was lost (``liveness``); a host read of a result
        the link delivered calls it after the read, since an aborted transport delivers garbage."""
        if self.liveness is not None:
            self.liveness.check()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        raise NotImplementedError

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Every rank's value, the maximum, in place."""
        raise NotImplementedError

    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        """Post this rank's point-to-point messages of one step together (no order between
        peers can deadlock) and queue their completion on the current stream."""
        raise NotImplementedError

    def global_rank(self, r: int) -> int:
        """Link rank ``r``'s rank in this process's ``torch.distributed`` default group (where a
        sender's DTensors live): the same number, unless the link is a group of it."""
        return r

    def make_groups(self, groups: Sequence[tuple[int, ...]]) -> None:
        """Make the groups (sorted tuples of link ranks) not made yet; every rank of the link
        calls it with the same list after the manifest vote. Here: none but the whole link, which
        ``group_broadcast`` reaches by the link's own broadcast."""
        some = [g for g in groups if len(g) < self.size]
        if some:
            raise ValueError(f"{type(self).__name__}: this link cannot make groups of ranks ({some[0]})")

    def group_broadcast(self, tensor: torch.Tensor, src: int, ranks: tuple[int, ...]) -> None:
        """Broadcast from ``src`` within the group ``ranks`` (this rank is one of them)."""
        if len(ranks) == self.size:
            self.broadcast(tensor, src)
            return
        raise ValueError(f"{type(self).__name__}: no group {ranks}")

    def group_all_reduce_max(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        if len(ranks) == self.size:
            self.all_reduce_max(tensor)
            return
        raise ValueError(f"{type(self).__name__}: no group {ranks}")


# Groups made on a torch.distributed link, per process group, for the process's life (the key
# holds the group, so its id is never reused).
_TORCH_GROUPS: dict[int, tuple[object, dict[tuple[int, ...], object]]] = {}


class TorchLink(Link):
    """A ``torch.distributed`` ProcessGroup (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None):
        if not dist.is_initialized():
            raise ValueError(
                "comm: torch.distributed is not initialized (pass a link object, or call "
                "init_process_group first)"
            )
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.groups_supported = self.size == dist.get_world_size()
        key = id(group) if group is not None else 0
        self._groups = _TORCH_GROUPS.setdefault(key, (group, {}))[1]
        self.gloo = dist.get_backend(group) == "gloo"
        self.liveness = _torch_liveness(group, self.rank, self.size)

    def global_rank(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _wait(self, work) -> None:
        _wait(work, self.liveness, self.gloo)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.check()
        with _blamed(self.liveness, self.gloo):
            work = dist.broadcast(tensor, group=self.group, group_src=src, async_op=True)
        self._wait(work)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        self.check()
        with _blamed(self.liveness, self.gloo):
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._wait(work)

    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        self.check()
        with _via_host(self.gloo, sends, recvs) as (sends, recvs):
            ops = [dist.P2POp(dist.isend, t, self.global_rank(r), self.group) for t, r in sends]
            ops += [dist.P2POp(dist.irecv, t, self.global_rank(r), self.group) for t, r in recvs]
            with _blamed(self.liveness, self.gloo):
                works = dist.batch_isend_irecv(ops) if ops else []
            for work in works:
                self._wait(work)

    def make_groups(self, groups: Sequence[tuple[int, ...]]) -> None:
        todo = [g for g in groups if len(g) < self.size and g not in self._groups]
        if todo and not self.groups_supported:
            raise ValueError(
                f"comm: the transfer plan needs groups of ranks {todo[:3]}, which "
                "torch.distributed.new_group makes only with every process of the default group "
                f"({dist.get_world_size()}); this link has {self.size}. Pass the default group (None) or a "
                "StoreLink"
            )
        for g in todo:  # every process of the default group, in the plan's order
            self._groups[g] = dist.new_group([self.global_rank(r) for r in g])

    def group_broadcast(self, tensor: torch.Tensor, src: int, ranks: tuple[int, ...]) -> None:
        if len(ranks) == self.size:
            return self.broadcast(tensor, src)
        self.check()
        group = self._groups[ranks]
        with _blamed(self.liveness, self.gloo):
            work = dist.broadcast(tensor, group=group, group_src=ranks.index(src), async_op=True)
        self._wait(work)

    def group_all_reduce_max(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        if len(ranks) == self.size:
            return self.all_reduce_max(tensor)
        self.check()
        with _blamed(self.liveness, self.gloo):
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._groups[ranks], async_op=True)
        self._wait(work)


@contextlib.contextmanager
def _blamed(liveness: Liveness | None, gloo: bool):
    """Issuing a gloo operation can raise at once (a send to a peer that died finds its connection
    closed); such an error is pinned on the lost rank as a wait's is (``Liveness.blame``), so that
    every rank raises ``LinkLost`` naming it, whichever call met the dead peer first."""
    try:
        yield
    except RuntimeError as exc:
        if liveness is None or not gloo:
            raise
        raise liveness.blame(exc) from exc


def _wait(work, liveness: Liveness | None, gloo: bool) -> None:
    """Wait for a transport's ``work``. A gloo wait blocks the host: it waits in a thread of its own
    while the caller checks ``liveness`` every beat (``Liveness.wait``). An NCCL wait only orders the
    stream; its host waits end when ``liveness`` aborts the communicators of a link that lost a rank
    (a ``StoreLink``'s; a ``TorchLink`` over the caller's own NCCL group is not aborted, and its next
    operation raises)."""
    if liveness is not None and gloo:
        liveness.wait(work)
    else:
        work.wait()


# One Liveness per torch.distributed group, for the process's life (the key holds the group).
_TORCH_LIVENESS: dict[int, tuple[object, Liveness | None]] = {}


def _torch_liveness(group: dist.ProcessGroup | None, rank: int, size: int) -> Liveness | None:
    """The beat of this process in ``group`` (None: the default group), through the default
    group's store; None where there is no peer or no store to beat in."""
    key = id(group) if group is not None else id(dist.group.WORLD)
    held = _TORCH_LIVENESS.get(key)
    if held is not None and held[0] is (group if group is not None else dist.group.WORLD):
        return held[1]
    liveness = None
    if size > 1:
        try:
            # torch names no public accessor for the default group's store; without it, no beats.
            store = dist.distributed_c10d._get_default_store()
            name = getattr(group, "group_name", None) if group is not None else "default"
            home = dist.get_group_rank(group, 0) if group is not None else 0
        except Exception:  # noqa: BLE001 - a store torch does not expose, or global rank 0 not in the group
            store, name, home = None, None, None
        if store is not None and name is not None:
            liveness = Liveness(store, rank, size, store_rank=home, prefix=f"glm_fp8/alive/{name}/").start()
    _TORCH_LIVENESS[key] = (group if group is not None else dist.group.WORLD, liveness)
    return liveness


def _store_group(store, rank: int, size: int, backend: str, timeout: timedelta):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")


class StoreLink(Link):
    """A process group of its own, built from a TCP store (``host:port``; ``rank`` 0 serves it),
    so that trainer and engine processes that each have their own default group can share it.
    ``backend``: "nccl" for CUDA tensors, "gloo" for CPU ones. Groups are made by their members
    only, each from its own prefix of the store. Every rank beats in the store (``Liveness``):
    ``lease_s`` seconds without a beat and a rank is lost; ``describe(rank)`` names a rank and
    ``advice(rank)`` says what to do, in ``LinkLost``'s message. ``global_ranks``: the first link
    ranks' ranks in the trainer's default group, where the senders' DTensors live (default: the
    same numbers; a Megatron trainer's senders are some of its ranks)."""

    groups_supported = True

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        size: int,
        *,
        backend: str,
        timeout: timedelta = timedelta(minutes=10),
        device: torch.device | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        describe: Callable[[int], str] | None = None,
        advice: Callable[[int | None], str] | None = None,
        global_ranks: Sequence[int] | None = None,
    ):
        store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout)
        self._setup(store, rank, size, backend, timeout, device, lease_s, describe, advice, global_ranks)

    @classmethod
    def over_store(
        cls,
        store: dist.Store,
        rank: int,
        size: int,
        *,
        backend: str,
        timeout: timedelta = timedelta(minutes=10),
        device: torch.device | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        describe: Callable[[int], str] | None = None,
        advice: Callable[[int | None], str] | None = None,
        global_ranks: Sequence[int] | None = None,
    ) -> StoreLink:
        """The link over a store the caller holds (and that outlives the link: e.g. one
        generation's ``PrefixStore`` of a trainer's store), instead of one served at ``host:port``."""
        link = cls.__new__(cls)
        link._setup(store, rank, size, backend, timeout, device, lease_s, describe, advice, global_ranks)
        return link

    def _setup(
        self,
        store,
        rank: int,
        size: int,
        backend: str,
        timeout: timedelta,
        device,
        lease_s: float,
        describe,
        advice,
        global_ranks: Sequence[int] | None = None,
    ) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank: expected 0 <= rank < size={size}, got {rank}")
        self._global = None if global_ranks is None else [int(r) for r in global_ranks]
        self.rank, self.size, self.backend, self.timeout = rank, size, backend, timeout
        self.device = device
        self.store = store
        self._groups: dict[tuple[int, ...], object] = {}
        # Beats before the rendezvous: once the process group exists, every rank's beat does.
        self.liveness = None
        if size > 1:
            self.liveness = Liveness(store, rank, size, lease_s=lease_s, describe=describe, advice=advice)
        try:
            self.pg = _store_group(dist.PrefixStore("glm_fp8/link/", store), rank, size, backend, timeout)
        except BaseException:
            if self.liveness is not None:
                self.liveness.close(leave=False)
            raise
        if self.liveness is not None:
            if backend == "nccl":  # NCCL kernels that wait for a lost rank end only when aborted
                self.liveness.on_lost(self._abort)
            self.liveness.start()

    def _wait(self, work) -> None:
        _wait(work, self.liveness, self.backend == "gloo")

    def global_rank(self, r: int) -> int:
        return self._global[r] if self._global is not None and r < len(self._global) else r

    def _bcast(self, pg, tensor: torch.Tensor, root: int) -> None:
        self.check()
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        with _blamed(self.liveness, self.backend == "gloo"):
            work = pg.broadcast([tensor], opts)
        self._wait(work)

    def _max(self, pg, tensor: torch.Tensor) -> None:
        self.check()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        with _blamed(self.liveness, self.backend == "gloo"):
            work = pg.allreduce([tensor], opts)
        self._wait(work)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._bcast(self.pg, tensor, src)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        self._max(self.pg, tensor)

    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        if not sends and not recvs:
            return
        self.check()
        if self.backend == "nccl":  # one NCCL group call, as torch.distributed.batch_isend_irecv
            device = (sends or recvs)[0][0].device
            self.pg._start_coalescing(device)
            for t, r in sends:
                self.pg.send([t], r, 0)
            for t, r in recvs:
                self.pg.recv([t], r, 0)
            self.pg._end_coalescing(device).wait()
            return
        with _via_host(True, sends, recvs) as (sends, recvs):
            with _blamed(self.liveness, True):
                works = [self.pg.send([t], r, 0) for t, r in sends]
                works += [self.pg.recv([t], r, 0) for t, r in recvs]
            for work in works:
                self._wait(work)

    def make_groups(self, groups: Sequence[tuple[int, ...]]) -> None:
        for g in groups:
            if self.rank in g and len(g) < self.size and g not in self._groups:
                prefix = dist.PrefixStore(f"glm_fp8/group/{'-'.join(map(str, g))}/", self.store)
                self._groups[g] = _store_group(prefix, g.index(self.rank), len(g), self.backend, self.timeout)

    def group_broadcast(self, tensor: torch.Tensor, src: int, ranks: tuple[int, ...]) -> None:
        if len(ranks) == self.size:
            return self.broadcast(tensor, src)
        self._bcast(self._groups[ranks], tensor, ranks.index(src))

    def group_all_reduce_max(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        if len(ranks) == self.size:
            return self.all_reduce_max(tensor)
        self._max(self._groups[ranks], tensor)

    def _abort(self) -> None:
        """Abort the NCCL communicators (kernels waiting for a lost rank end; the link is done)."""
        for pg in [p for p in [getattr(self, "pg", None), *self._groups.values()] if p is not None]:
            try:
                pg.abort() if self.backend == "nccl" else None
            except Exception:  # noqa: BLE001 - tearing down a link that may already be broken
                pass

    def close(self) -> None:
        """This rank leaves the link: its beat stops (the others are told it left, not lost), and
        NCCL communicators are aborted. A link that lost a rank may hold gloo operations that wait
        for it until the transport's timeout, and a gloo process group's destructor waits for them:
        its process groups are dropped in a daemon thread, so that the caller (a ``remove_server``
        rebuilding the link) does not wait ``timeout_s``."""
        lost = self.liveness is not None and self.liveness.lost is not None
        if self.liveness is not None:
            self.liveness.close()
        self._abort()
        if lost and getattr(self, "pg", None) is not None:
            doomed = [self.pg, *self._groups.values()]
            self.pg = None
            self._groups.clear()
            threading.Thread(target=doomed.clear, name="glm_fp8-lost-link", daemon=True).start()
            return
        self._groups.clear()


class _via_host:
    """gloo moves CUDA tensors in collectives but not point to point: there, stage them through
    host memory (tests and demos on one GPU; NCCL links move device memory directly)."""

    def __init__(self, gloo: bool, sends: Sequence[Message], recvs: Sequence[Message]):
        self.staged = gloo and any(t.is_cuda for t, _ in (*sends, *recvs))
        self.sends, self.recvs = sends, recvs
        if self.staged:
            self.host_recvs = [(torch.empty(t.shape, dtype=t.dtype), r) for t, r in recvs]

    def __enter__(self):
        if not self.staged:
            return self.sends, self.recvs
        return [(t.cpu(), r) for t, r in self.sends], self.host_recvs

    def __exit__(self, exc_type, *exc) -> bool:
        if self.staged and exc_type is None:
            for (dst, _), (src, _) in zip(self.recvs, self.host_recvs):
                dst.copy_(src)
        return False


class ObjectLink(Link):
    """An object with vLLM's ``PyNcclCommunicator`` methods: ``broadcast(t, src)``,
    ``all_reduce(t, op=...)`` (returning the result), ``send(t, dst)``, ``recv(t, src)``,
    ``group_start()``, ``group_end()`` and ``rank``, ``world_size``. No groups: a class of replicas
    gets its bytes point to point from a single sender too."""

    def __init__(self, comm: object):
        for attr in ("broadcast", "all_reduce", "rank", "world_size"):
            if not hasattr(comm, attr):
                raise TypeError(
                    f"comm: {type(comm).__name__} has no {attr!r}; expected a torch.distributed "
                    "ProcessGroup, None, a Link, or an object like vLLM's PyNcclCommunicator"
                )
        self.comm = comm
        self.rank, self.size = int(comm.rank), int(comm.world_size)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.comm.broadcast(tensor, src)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        out = self.comm.all_reduce(tensor, op=dist.ReduceOp.MAX)
        if out is not None and out is not tensor:
            tensor.copy_(out)

    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        if not sends and not recvs:
            return
        if not hasattr(self.comm, "send"):
            raise TypeError(f"comm: {type(self.comm).__name__} has no send/recv for point-to-point messages")
        self.comm.group_start()
        try:
            for t, r in sends:
                self.comm.send(t, r)
            for t, r in recvs:
                self.comm.recv(t, r)
        finally:
            self.comm.group_end()


class HostSinkComm(Link):
    """Stand-in link for one-GPU benchmarks and tests: this process plays link rank ``rank`` of
    ``size`` (default 2: itself and one receiver) and every message it sends is a device-to-host
    copy into pinned memory on the current stream, about the speed of one inter-node link. It
    receives nothing and votes alone. ``keep=True`` keeps a copy of every message for checking."""

    groups_supported = True  # a group broadcast is one copy, as it is one send on a real link
    stand_in = True

    def __init__(self, keep: bool = False, rank: int = 0, size: int = 2):
        self.keep, self.rank, self.size = keep, rank, size
        self.sent: list[torch.Tensor] = []
        self._pinned: dict[int, torch.Tensor] = {}

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if src != self.rank:
            raise ValueError(f"HostSinkComm: a sink only sends (it is rank {self.rank}); got src {src}")
        if self.keep:
            dst = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self.sent.append(dst)
        else:
            dst = self._pinned.get(tensor.nbytes)
            if dst is None:
                dst = self._pinned[tensor.nbytes] = torch.empty(
                    tensor.nbytes, dtype=torch.uint8, pin_memory=tensor.is_cuda
                )
            dst = dst.view(tensor.dtype).view(tensor.shape)
        dst.copy_(tensor, non_blocking=True)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        return None  # no one else votes

    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        if recvs:
            raise ValueError("HostSinkComm: a sink only sends; it has nothing to receive")
        for t, _ in sends:
            self.broadcast(t, self.rank)

    def make_groups(self, groups: Sequence[tuple[int, ...]]) -> None:
        return None  # a group broadcast is a send like any other

    def group_broadcast(self, tensor: torch.Tensor, src: int, ranks: tuple[int, ...]) -> None:
        self.broadcast(tensor, src)

    def group_all_reduce_max(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        return None


def as_link(comm: object | None) -> Link:
    """The ``Link`` for ``comm``: a Link as it is, a ProcessGroup or None (``TorchLink``), or an
    object with PyNcclCommunicator's methods (``ObjectLink``)."""
    if isinstance(comm, Link):
        return comm
    if comm is None or isinstance(comm, dist.ProcessGroup):
        return TorchLink(comm)
    return ObjectLink(comm)


__all__ = ["HostSinkComm", "Link", "ObjectLink", "StoreLink", "TorchLink", "as_link"]
