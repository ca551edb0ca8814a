"""Pipelined weight broadcast: a sender that converts layer i+1 while layer i is on the wire,
and a receiver that lands layer buffers in the inference engine's parameters.

Wire protocol (version 1), all broadcasts from ``src``:

1. ``int64[1]`` manifest length, then the manifest as UTF-8 JSON bytes (data only, no pickle):
   ``{"format": "glm_fp8", "version": 1, "mode": "fp8" | "bf16",
   "layers": [{"layer": i, "nbytes": n, "entries": [{name, dtype, shape, offset, nbytes}]}]}``,
   then an ``int64[1]`` all-reduce (sum) in which each receiver puts 1 if it refuses the
   manifest: then every rank stops with an error before any parameter is touched.
2. Per layer: ``int64[2]`` header ``[status, layer position]`` and, when status is DATA, the
   layer buffer (``uint8[nbytes]``) as ``glm_fp8.convert`` laid it out.
3. A last header: COMPLETE, or ABORT at any point (the sender hit an error). A receiver that
   sees ABORT, a timeout or a dead peer raises ``UpdateAborted``: an update is complete only
   when COMPLETE arrived.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from glm_fp8.convert import _check_layer, convert_layer, fill_layer, layer_prefix, strip_layer
from glm_fp8.gather import full_value
from glm_fp8.plan import LayerPlan, plan_from_config
from glm_fp8.quantize import NonFiniteError, quantize_blockwise
from glm_fp8.reference import ceil_blocks

PROTOCOL_VERSION = 1
DATA, COMPLETE, ABORT = 1, 2, 3


class HostSinkComm:
    """Stand-in communicator for one-GPU benchmarks and tests: a "broadcast" from this rank is
    a device-to-host copy into pinned memory on the current stream, about the speed of one
    inter-node link. ``keep=True`` keeps a copy of every message for checking."""

    def __init__(self, keep: bool = False):
        self.keep = keep
        self.sent: list[torch.Tensor] = []
        self._pinned: dict[int, torch.Tensor] = {}

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
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

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        return None  # no receivers to refuse


class UpdateAborted(RuntimeError):
    """The weight update did not complete; parameters may hold a mix of old and new layers."""


class ManifestMismatch(ValueError):
    """The sender's manifest differs from what this receiver expects; nothing was touched."""


class Comm:
    """Adapter over a ``torch.distributed`` ProcessGroup (or the default group: None), or any
    object with ``broadcast(tensor, src)`` such as vLLM's PyNcclCommunicator."""

    def __init__(self, comm: object | None):
        self.comm = comm
        if hasattr(comm, "all_reduce_sum"):
            self.all_reduce_sum = comm.all_reduce_sum  # type: ignore[method-assign]

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.comm is None or _is_process_group(self.comm):
            import torch.distributed as dist

            dist.broadcast(tensor, src, group=self.comm)
        else:
            self.comm.broadcast(tensor, src)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Every rank's flags summed in place (the manifest acknowledgement)."""
        if self.comm is None or _is_process_group(self.comm):
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.comm)
        elif hasattr(self.comm, "all_reduce"):
            out = self.comm.all_reduce(tensor)
            if out is not None and out is not tensor:
                tensor.copy_(out)
        else:
            raise TypeError(f"comm: {type(self.comm).__name__} has no all_reduce for the manifest check")


def _is_process_group(obj: object) -> bool:
    import torch.distributed as dist

    return isinstance(obj, dist.ProcessGroup)


def plans_for(config: Mapping, mode: str = "fp8", target: str = "hopper") -> list[LayerPlan]:
    """One plan per decoder layer of a model config (dense and sparse layers differ)."""
    cache: dict[bool, LayerPlan] = {}
    dense_until = config.get("first_k_dense_replace", 0)
    out = []
    for i in range(config["num_hidden_layers"]):
        sparse = i >= dense_until
        if sparse not in cache:
            cache[sparse] = plan_from_config(config, i, target=target, quantize=mode == "fp8")
        out.append(cache[sparse])
    return out


def manifest_of(plans: Sequence[LayerPlan], layer_ids: Sequence[int], mode: str) -> dict:
    return {
        "format": "glm_fp8",
        "version": PROTOCOL_VERSION,
        "mode": mode,
        "layers": [
            {"layer": i, "nbytes": p.nbytes, "entries": p.manifest()} for i, p in zip(layer_ids, plans)
        ],
    }


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


class _Ring:
    """Preallocated layer buffers; a slot is reused only once its last broadcast finished."""

    def __init__(self, size: int, nbytes: int, device: torch.device):
        if size < 1:
            raise ValueError(f"ring: expected at least 1 slot, got {size}")
        self.slots = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(size)]
        cuda = device.type == "cuda"
        self.free = [torch.cuda.Event() if cuda else None for _ in range(size)]
        self.used = [False] * size

    def slot(self, k: int, nbytes: int) -> tuple[torch.Tensor, object]:
        i = k % len(self.slots)
        return self.slots[i][:nbytes], i


def _setup_endpoint(obj, comm, src, config, plans, ring, mode, device) -> None:
    """What sender and receiver share: the link, the per-layer plans, the device and the ring."""
    if mode not in ("fp8", "bf16"):
        raise ValueError(f"mode: expected 'fp8' or 'bf16', got {mode!r}")
    if (config is None) == (plans is None):
        raise ValueError("config / plans: pass exactly one of them")
    obj.comm, obj.src, obj.mode = Comm(comm), src, mode
    obj.plans = list(plans) if plans is not None else plans_for(config, mode)
    obj.device = torch.device(device) if device else _default_device()
    obj.ring = _Ring(ring, max(p.nbytes for p in obj.plans), obj.device)


class Broadcaster:
    """Sender: converts layers into a ring of buffers and broadcasts them, pipelined.

    Args:
        comm: ProcessGroup, None (default group) or an object with ``broadcast(tensor, src)``.
        src: rank that sends (this process).
        config / plans: the model config (plans for every layer are built from it) or one
            ``LayerPlan`` per layer; the manifest needs them before the first layer is sent.
        ring: layer buffers (default 2: convert i+1 while i is sent; 1 serializes).
        mode: "fp8" ships kernel-format fp8 entries; "bf16" ships unquantized kernel-format
            entries for receivers that quantize on receive (half the sender's work, twice the
            bytes).
        gather: how DTensor inputs are collected: "auto", "full", "chunked" or
            "quantize_then_gather" (see ``collect_layer``). The other trainer ranks run
            ``contribute_shards`` with the same arguments.
        chunk_experts: experts per chunk for "chunked".
        gather_dtype: DTensor inputs are cast to this dtype before they travel (None: keep
            theirs).
        device: where conversion runs (default: the current CUDA device, else CPU).
    """

    def __init__(
        self,
        comm: object | None,
        src: int = 0,
        *,
        config: Mapping | None = None,
        plans: Sequence[LayerPlan] | None = None,
        ring: int = 2,
        mode: str = "fp8",
        gather: str = "auto",
        chunk_experts: int = 8,
        gather_dtype: torch.dtype | None = torch.bfloat16,
        device: torch.device | str | None = None,
    ):
        _setup_endpoint(self, comm, src, config, plans, ring, mode, device)
        if gather not in GATHERS:
            raise ValueError(f"gather: expected one of {GATHERS}, got {gather!r}")
        if chunk_experts < 1:
            raise ValueError(f"chunk_experts: expected at least 1, got {chunk_experts}")
        sender = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.collect_args = dict(mode=mode, gather=gather, chunk_experts=chunk_experts,
                                 gather_dtype=gather_dtype, sender=sender, device=self.device)  # fmt: skip
        cuda = self.device.type == "cuda"
        self.convert_stream = torch.cuda.Stream(self.device) if cuda else None
        self.comm_stream = torch.cuda.Stream(self.device) if cuda else None

    def broadcast_model(self, layers: Iterable[tuple[int, Mapping[str, torch.Tensor]]]) -> UpdateStats:
        """Send every layer of ``layers`` (``(layer_idx, state_dict)`` in order); returns stats.

        On any error (non-finite weights, a bad state dict) receivers get ABORT and this raises.
        """
        stats = UpdateStats()
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        self._send_manifest()
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        try:
            count = 0
            for pos, (layer_idx, sd) in enumerate(layers):
                if pos >= len(self.plans):
                    raise ValueError(f"layers: more than the {len(self.plans)} in the manifest")
                t_layer = time.perf_counter()
                self._send_layer(pos, layer_idx, sd, header)
                stats.layers.append(
                    LayerStats(layer_idx, self.plans[pos].nbytes, time.perf_counter() - t_layer)
                )
                count += 1
            if count != len(self.plans):
                raise ValueError(f"layers: got {count}, the manifest announced {len(self.plans)}")
        except BaseException:
            self._send_header(header, ABORT, -1)
            raise
        self._send_header(header, COMPLETE, len(self.plans))
        self._sync()
        stats.seconds = time.perf_counter() - t0
        if self.device.type == "cuda":
            stats.peak_bytes = torch.cuda.max_memory_allocated(self.device) - base
        return stats

    def _send_manifest(self) -> None:
        ids = list(range(len(self.plans)))
        payload = json.dumps(manifest_of(self.plans, ids, self.mode)).encode()
        n = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self.comm.broadcast(n, self.src)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        self.comm.broadcast(data, self.src)
        refused = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.comm.all_reduce_sum(refused)
        if int(refused.item()):
            raise ManifestMismatch(
                f"{int(refused.item())} receiver(s) refused the manifest; nothing was sent"
            )

    def _send_header(self, header: torch.Tensor, status: int, pos: int) -> None:
        with _on(self.comm_stream):
            header.copy_(torch.tensor([status, pos], dtype=torch.int64))
            self.comm.broadcast(header, self.src)

    def _send_layer(self, pos: int, layer_idx: int, sd: Mapping[str, torch.Tensor], header) -> None:
        plan = self.plans[pos]
        buf, slot = self.ring.slot(pos, plan.nbytes)
        caller = torch.cuda.current_stream(self.device) if self.convert_stream is not None else None
        with _on(self.convert_stream):
            if caller is not None:
                # The layer may have just been written on the caller's stream.
                self.convert_stream.wait_stream(caller)
            if self.ring.used[slot] and self.ring.free[slot] is not None:
                # The slot's previous broadcast must finish before we overwrite it.
                self.convert_stream.wait_event(self.ring.free[slot])
            # The finite check is this loop's only host wait per layer; the previous layer keeps
            # the wire busy meanwhile.
            collect_layer(plan, strip_layer(sd, layer_idx), layer_idx, buf, **self.collect_args)
            ready = None
            if self.convert_stream is not None:
                ready = torch.cuda.Event()
                ready.record(self.convert_stream)
        if caller is not None:
            # The caller may free or overwrite its tensors once we move on: order that after
            # the kernels that read them (the wire, on its own stream, is not waited for).
            caller.wait_event(ready)
        with _on(self.comm_stream):
            if ready is not None:
                self.comm_stream.wait_event(ready)
            header.copy_(torch.tensor([DATA, pos], dtype=torch.int64))
            self.comm.broadcast(header, self.src)
            self.comm.broadcast(buf, self.src)
            if self.ring.free[slot] is not None:
                self.ring.free[slot].record(self.comm_stream)
        self.ring.used[slot] = True

    def _sync(self) -> None:
        if self.comm_stream is not None:
            self.comm_stream.synchronize()


GATHERS = ("auto", "full", "chunked", "quantize_then_gather")


def contribute_shards(
    layers: Iterable[tuple[int, Mapping[str, torch.Tensor]]],
    *,
    config: Mapping | None = None,
    plans: Sequence[LayerPlan] | None = None,
    sender: int = 0,
    gather: str = "auto",
    chunk_experts: int = 8,
    gather_dtype: torch.dtype | None = torch.bfloat16,
    device: torch.device | str | None = None,
) -> None:
    """What every trainer rank except the sender runs, with the same arguments as the sender's
    ``Broadcaster``: its part of each layer's DTensor gathers (collective over the mesh)."""
    if (config is None) == (plans is None):
        raise ValueError("config / plans: pass exactly one of them")
    plans = list(plans) if plans is not None else plans_for(config)
    dev = torch.device(device) if device else _default_device()
    for pos, (layer_idx, sd) in enumerate(layers):
        collect_layer(
            plans[pos], strip_layer(sd, layer_idx), layer_idx, None, mode="fp8", gather=gather,
            chunk_experts=chunk_experts, gather_dtype=gather_dtype, sender=sender, device=dev,
        )  # fmt: skip


def collect_layer(
    plan: LayerPlan,
    layer: Mapping[str, torch.Tensor],
    layer_idx: int,
    buf: torch.Tensor | None,
    *,
    mode: str,
    gather: str,
    chunk_experts: int,
    gather_dtype: torch.dtype | None,
    sender: int,
    device: torch.device,
) -> None:
    """Gather (if sharded) and convert one layer into ``buf`` on the sender (``buf`` given);
    on the other trainer ranks only take part in the gathers. Every trainer rank calls it with
    the same layer, so the collectives match.

    gather: "full" (``full_tensor()`` per tensor, as prime-rl), "chunked" (expert stacks
    ``chunk_experts`` at a time into a reusable buffer: the whole gathered stack never exists),
    "quantize_then_gather" (each rank quantizes the experts it holds; only fp8 bytes and scales
    travel), or "auto" (the last that the sharding allows). Plain tensors are used as they are.
    """
    from glm_fp8.gather import gather_rows, move, shard_layout

    sending = buf is not None
    prefix = layer_prefix(layer_idx)
    strategy = _choose_gather(plan, layer, gather, mode, prefix)
    if strategy == "full":
        gathered = {k: full_value(t, gather_dtype) for k, t in layer.items()}
        if sending:
            gathered = {k: t.to(device) for k, t in gathered.items()}
            convert_layer(gathered, layer_idx, out=buf, plan=plan, check_finite=mode == "fp8")
            if mode == "bf16":
                _check_finite_entries(plan, buf, layer_idx, ("copy", "concat"))
        return
    stacks = [e for e in plan.entries if e.op == "quantize" and len(e.shape) == 3]
    stacked = {s for e in stacks for s in e.sources}
    rest = {k: full_value(t, gather_dtype) for k, t in layer.items() if k not in stacked}
    views: dict[str, torch.Tensor] = {}
    if sending:
        rest = {k: t.to(device) for k, t in rest.items()}
        _check_layer(plan, {**rest, **{k: layer[k] for k in stacked}}, prefix)
        names = {e.name for e in plan.entries if e.op != "scale" and e not in stacks}
        views = fill_layer(rest, plan, buf, "", check_finite=False, only=names)
    me = torch.distributed.get_rank()
    for e in stacks:
        srcs = [layer[s] for s in e.sources]
        q, sc = (views[e.name], views[e.name + "_scale_inv"]) if sending else (None, None)
        if strategy == "chunked":
            n = e.shape[0]
            size = min(chunk_experts, n)
            chunks = [
                torch.empty((size, *t.shape[1:]), dtype=gather_dtype or t.dtype, device=device)
                if sending
                else None
                for t in srcs
            ]
            for a in range(0, n, chunk_experts):
                b = min(n, a + chunk_experts)
                got = [gather_rows(t, a, b, sender, c[: b - a] if sending else None, gather_dtype)
                       for t, c in zip(srcs, chunks)]  # fmt: skip
                if sending:
                    quantize_blockwise(got, out=q[a:b], scale_out=sc[a:b], check_finite=False)
            continue
        layout = shard_layout(srcs[0])
        lo, hi = layout.owned(me)
        local = [t.to_local() if gather_dtype is None else t.to_local().to(gather_dtype) for t in srcs]
        q_own = s_own = None
        if hi > lo:
            if sending:
                quantize_blockwise(local, out=q[lo:hi], scale_out=sc[lo:hi], check_finite=False)
            else:
                q_own, s_own = quantize_blockwise(local, check_finite=False)
        for owner, (olo, ohi) in zip(layout.ranks, layout.bounds):
            if ohi > olo and owner != sender:  # the sender quantized its own in place
                mine = me == owner
                q_to = q[olo:ohi].view(torch.uint8) if sending else None
                move(q_own.view(torch.uint8) if mine else None, q_to, owner, sender, layout.group)
                move(s_own if mine else None, sc[olo:ohi] if sending else None, owner, sender, layout.group)
    if sending:
        _check_finite_entries(plan, buf, layer_idx, ("scale",))


def _choose_gather(
    plan: LayerPlan, layer: Mapping[str, torch.Tensor], gather: str, mode: str, prefix: str
) -> str:
    from torch.distributed.tensor import DTensor

    from glm_fp8.gather import shard_layout

    if gather not in GATHERS:
        raise ValueError(f"gather: expected one of {GATHERS}, got {gather!r}")
    sharded = any(isinstance(t, DTensor) for t in layer.values())
    stacks = [e for e in plan.entries if e.op == "quantize" and len(e.shape) == 3]
    if gather == "full" or not sharded or not stacks:
        return "full"
    why = None
    if mode != "fp8" or plan.target != "hopper":
        why = f"mode {mode!r} / target {plan.target!r} (piecewise gathers need fp8 for Hopper)"
    layouts = {s: shard_layout(layer[s]) for e in stacks for s in e.sources}
    bad = [s for s, lay in layouts.items() if lay is None]
    if why is None and bad:
        why = f"{prefix}{bad[0]} is not a DTensor on a 1-D mesh with one Shard/Replicate placement"
    if why is not None:
        if gather == "auto":
            return "full"
        raise ValueError(f"gather={gather!r}: {why}")
    whole = [lay for lay in layouts.values()]
    can_qtg = all(lay.dim == 0 and lay.bounds == whole[0].bounds and lay.ranks == whole[0].ranks
                  for lay in whole)  # fmt: skip
    if gather == "quantize_then_gather" and not can_qtg:
        raise ValueError(
            "gather='quantize_then_gather': the expert stacks must be sharded on the expert dim "
            "(Shard(0)) alike, so that every rank holds whole experts"
        )
    if gather == "auto":
        return "quantize_then_gather" if can_qtg else "chunked"
    return gather


def _check_finite_entries(plan: LayerPlan, buf: torch.Tensor, layer_idx: int, ops: tuple[str, ...]) -> None:
    """Raise if an entry whose op is in ``ops`` holds NaN/Inf: max |x| of every such entry in one
    multi-tensor reduction, one host read; no temporary beyond a float per entry."""
    floating = [(e.name, e.view(buf)) for e in plan.entries if e.op in ops and e.dtype.is_floating_point]
    norms = torch._foreach_norm([v for _, v in floating], float("inf")) if floating else []
    if norms and not bool(torch.isfinite(torch.stack(norms)).all()):
        bad = next(n for (n, _), m in zip(floating, norms) if not torch.isfinite(m))
        bad = bad.removesuffix("_scale_inv")
        raise NonFiniteError(
            f"{layer_prefix(layer_idx)}{bad}: NaN or Inf in its sources; the update was aborted",
            source=layer_prefix(layer_idx) + bad, expert=None, block=(-1, -1),
        )  # fmt: skip


class Receiver:
    """Inference side: receives layer buffers into its own ring and hands out named views.

    Args:
        comm, src: as for ``Broadcaster``.
        config / plans: what this engine expects; a manifest that differs is refused before any
            parameter is touched.
        ring: receive buffers (2: receive layer i+1 while layer i is copied out).
        mode: must match the sender's. "bf16" quantizes on receive (``load_into``).
    """

    def __init__(
        self,
        comm: object | None,
        src: int = 0,
        *,
        config: Mapping | None = None,
        plans: Sequence[LayerPlan] | None = None,
        ring: int = 2,
        mode: str = "fp8",
        device: torch.device | str | None = None,
    ):
        _setup_endpoint(self, comm, src, config, plans, ring, mode, device)
        self.recv_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.expected = manifest_of(self.plans, list(range(len(self.plans))), mode)

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, view)`` for every entry of every layer. A view stays valid until the
        layer after the next one is received (ring of 2). Raises ``UpdateAborted`` when the
        sender aborts or the link fails, ``ManifestMismatch`` before anything is yielded."""
        for _, views in self.receive_layers():
            yield from views

    def receive_layers(self) -> Iterator[tuple[int, list[tuple[str, torch.Tensor]]]]:
        try:
            manifest = self._recv_manifest()
            mismatch = None
            try:
                self._check_manifest(manifest)
            except ManifestMismatch as exc:
                mismatch = exc
            refused = torch.tensor([int(mismatch is not None)], dtype=torch.int64, device=self.device)
            self.comm.all_reduce_sum(refused)  # every rank learns whether anyone refused
        except Exception as exc:
            raise UpdateAborted(f"receiving the manifest failed: {exc}") from exc
        if mismatch is not None:
            raise mismatch
        if int(refused.item()):
            raise UpdateAborted("another receiver refused the manifest; nothing was sent")
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        for pos, plan in enumerate(self.plans):
            status = self._recv_header(header)
            if status != DATA:
                raise UpdateAborted(f"the sender aborted the update before layer {pos}")
            buf, slot = self.ring.slot(pos, plan.nbytes)
            try:
                with _on(self.recv_stream):
                    if self.ring.used[slot] and self.ring.free[slot] is not None:
                        # Wait until what the consumer queued on this slot's last layer is done.
                        self.recv_stream.wait_event(self.ring.free[slot])
                    self.comm.broadcast(buf, self.src)
                if self.recv_stream is not None:
                    torch.cuda.current_stream(self.device).wait_stream(self.recv_stream)
            except Exception as exc:
                raise UpdateAborted(f"receiving layer {pos} failed: {exc}") from exc
            prefix = layer_prefix(pos)
            yield pos, [(prefix + name, view) for name, view in plan.views(buf)]
            if self.ring.free[slot] is not None:
                self.ring.free[slot].record(torch.cuda.current_stream(self.device))
            self.ring.used[slot] = True
        if self._recv_header(header) != COMPLETE:
            raise UpdateAborted("the sender aborted the update after the last layer")

    def load_into(self, params: Mapping[str, torch.Tensor]) -> UpdateStats:
        """Copy (fp8 mode) or quantize (bf16 mode) every received entry into ``params``.

        Every name, shape and dtype is checked against ``params`` before the first byte is
        received. Raises ``UpdateAborted`` if the update did not complete (``params`` then hold
        a mix of layers and must not be served as the new weights).
        """
        self._check_params(params)
        stats = UpdateStats()
        t0 = time.perf_counter()
        for pos, views in self.receive_layers():
            t = time.perf_counter()
            for name, view in views:
                if self.mode == "bf16" and name + "_scale_inv" in params:
                    quantize_blockwise(view, out=params[name], scale_out=params[name + "_scale_inv"],
                                       check_finite=False)  # fmt: skip
                else:
                    params[name].copy_(view, non_blocking=True)
            stats.layers.append(LayerStats(pos, self.plans[pos].nbytes, time.perf_counter() - t))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _check_params(self, params: Mapping[str, torch.Tensor]) -> None:
        for pos, plan in enumerate(self.plans):
            prefix = layer_prefix(pos)
            for e in plan.entries:
                name = prefix + e.name
                if name not in params:
                    raise KeyError(f"params: missing {name!r} ({e.dtype}, {tuple(e.shape)})")
                p = params[name]
                want_dtype = e.dtype if self.mode == "fp8" else _quantized_dtype(e, params, name)
                _check_param(name, p, want_dtype, tuple(e.shape))
                if want_dtype == torch.float8_e4m3fn and self.mode == "bf16":
                    nb = tuple(e.shape[:-2]) + (ceil_blocks(e.shape[-2]), ceil_blocks(e.shape[-1]))
                    _check_param(name + "_scale_inv", params[name + "_scale_inv"], torch.float32, nb)

    def _recv_manifest(self) -> dict:
        n = torch.empty(1, dtype=torch.int64, device=self.device)
        self.comm.broadcast(n, self.src)
        data = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        self.comm.broadcast(data, self.src)
        return json.loads(bytes(data.cpu().numpy()).decode())

    def _check_manifest(self, got: dict) -> None:
        want = self.expected
        for key in ("format", "version", "mode"):
            if got.get(key) != want[key]:
                raise ManifestMismatch(f"manifest: expected {key}={want[key]!r}, got {got.get(key)!r}")
        if len(got["layers"]) != len(want["layers"]):
            raise ManifestMismatch(
                f"manifest: expected {len(want['layers'])} layers, got {len(got['layers'])}"
            )
        for g, w in zip(got["layers"], want["layers"]):
            if g != w:
                ge = {e["name"]: e for e in g["entries"]}
                for e in w["entries"]:
                    if ge.get(e["name"]) != e:
                        raise ManifestMismatch(
                            f"manifest: layer {w['layer']} entry {e['name']}: expected {e}, "
                            f"got {ge.get(e['name'])}"
                        )
                raise ManifestMismatch(f"manifest: layer {w['layer']}: expected {w}, got {g}")

    def _recv_header(self, header: torch.Tensor) -> int:
        try:
            with _on(self.recv_stream):  # read it on the stream that received it
                self.comm.broadcast(header, self.src)
                return int(header[0].item())
        except Exception as exc:
            raise UpdateAborted(f"the link to the sender failed: {exc}") from exc


def _check_param(name: str, p: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if tuple(p.shape) != shape or p.dtype != dtype:
        raise ValueError(f"params[{name!r}]: expected {dtype} {shape}, got {p.dtype} {tuple(p.shape)}")


def _quantized_dtype(e, params: Mapping[str, torch.Tensor], name: str) -> torch.dtype:
    """bf16 mode: a quantizable entry lands in an fp8 parameter that has a scale beside it."""
    if name + "_scale_inv" in params:
        return torch.float8_e4m3fn
    return e.dtype


class _on:
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


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
