"""One sending trainer rank's pipeline through the one-GPU stand-in link, in every mode of the one
transfer protocol: the whole update against the same messages sent alone (the link's time) and
against its conversion alone; its peak memory against the transfer plan's; its first layer's
bytes against the reference.

    python3 bench/scripts/pipeline.py --mode broadcast|scatter|senders [--layers 80] [--tp 8] [--ep]
        [--engines 1] [--servers 2xEP8 2xTP8] [--senders 32] [--sender 0 1] [--master bf16 fp32]
        [--repeats 3] [--ring 2] [--delta-lr 1e-6 1e-5] [--delta-steps 3] [--delta-graphs on off]

GLM-5 sparse layers (Gaussian x 0.02 in the master dtype); one layer's tensors are reused for every
layer (each layer is still converted and sent). The stand-in link (``HostSinkComm``) copies every
message to pinned host memory, about one inter-node link's speed; it has no peers, so this rank
leads and its votes are its own. ``--mode broadcast``: one sender, one "full" receiver (every entry
whole); ``scatter``: one sender into ``--engines`` engines of TP ``--tp`` (EP with ``--ep``);
``senders``: link rank ``--sender`` of ``--senders`` trainer ranks into the same engines.
``--servers`` replaces ``--engines`` / ``--tp`` / ``--ep`` by a fleet of servers of different
layouts in one link, each ``[Nx]TP<t>`` or ``[Nx]EP<t>`` (TP t with expert parallel), optionally
``xDP<d>``: N replicas of that server. The wire bytes the link carried are compared with what the
update-time model predicts for the sender (``glm_fp8.transfer.pack.update_regions``, scatter; the
transfer plan, many senders): one group broadcast per set of ranks that hold the same region.
``--trainer megatron:tpN,ppN,cpN,epN`` (``--mode senders``): a Megatron-Core trainer's senders
(``glm_fp8.planning.fleet.MegatronTrainer``): ``--senders`` is theirs, each layer is held by its
pipeline stage's senders (``SendOptions.holders``), and the measured sender is handed the layers its
stage holds only (nothing of the others), as ``MegatronSource`` hands them.
``--device cpu --model tiny`` runs a small model on the CPU (a check of the script, no figures).

``--delta-lr`` (issue #33): after the dense row, the same sender (``Sender(delta=DeltaOptions())``)
sends delta updates: one dense update with the delta state attached fills its kept copy, then for
each ``--delta-step`` and learning rate ``--delta-steps`` updates, each after a stand-in trainer
step on the layer's masters (``standin.trainer_step``): ``sign``, ``w32 -= lr * sign(randn)``
(Adam's first step: every weight moves by ``lr``), or ``adam``, ``w32 -= lr * 0.229 * randn``
(Adam's step once warm, for i.i.d. gradients), on an fp32 shadow of the masters (a bf16 master's
fp32 copy, kept across steps so that small steps accumulate as a mixed-precision trainer's fp32
master does; an fp32 master is its own shadow), the masters then copied from it; chunk by chunk
along dim 0 (a seeded generator; no full-size temporary). Both are stand-ins for an optimizer
step: the changed fractions of real AdamW steps are measured by ``bench/scripts/delta_fraction.py``.
Each delta update is timed beside its messages replayed alone, its wire bytes (every message the
link carried) against the dense update's, and the GPU memory of the kept copy (none when it is
kept in host memory) and the delta message buffers (measured on CUDA) against the update-time model's
(``glm_fp8.planning.update_delta.sender_share``). The stand-in link has no peers: its versions exchange
returns this sender's row for every rank (see ``Recorder``). ``--delta-graphs on off`` times each
kept copy with the sender's layers captured as CUDA graphs and without (``DeltaOptions.graphs``);
``--delta-warmup`` untimed delta updates come first (a layer is captured at its second delta
update). Each learning rate also prints its
median update's slowest steps and the time outside the steps, and Python's cycle collections inside
the updates (``send_model`` pauses the collector) and between them.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import re
import statistics
import time

import torch
from standin import STEPS, trainer_step, versions_in_step
from tabulate import tabulate

from glm_fp8.core.vocab import KEPT_COPIES
from glm_fp8.engine import EngineLayout
from glm_fp8.kernels.reference import convert_layer_ref
from glm_fp8.model.plans import plan_from_config
from glm_fp8.model.presets import PRESETS, TINY_GLM5
from glm_fp8.model.trainer_layouts import layer_prefix, strip_layer
from glm_fp8.planning.fleet import MegatronTrainer
from glm_fp8.planning.update_delta import Delta, sender_share
from glm_fp8.testing import sent_layer_mismatches
from glm_fp8.transfer import DeltaOptions, HostSinkComm, Sender
from glm_fp8.transfer.gather import trainer_view
from glm_fp8.transfer.pack import update_regions

GiB = 2**30
# A message of at least this many bytes is data (a segment), not the protocol's own words (headers,
# votes, the manifest): the end of the last one is when a sender's share has left it.
DATA_BYTES = 64 << 10


class Recorder(HostSinkComm):
    """The stand-in link, which also remembers every message of the current update (for the
    link-alone replay) and keeps host copies of the first ``keep_first`` (for the byte check).
    ``in_step`` (delta updates): see ``all_reduce_max``; ``pool``: a pinned buffer that takes every
    message of a size not seen before (a delta's payloads vary in size from layer to layer and step
    to step: a pinned buffer allocated for each would be timed as part of the update)."""

    def __init__(self, rank: int, size: int, keep_first: int = 0):
        super().__init__(rank=rank, size=size)
        self.keep_first, self.log, self.kept = keep_first, [], []
        self.in_step, self.pool = False, None
        self.last_data = None  # on CUDA: an event after the update's last data message so far
        self.shares: list[float] = []  # per timed update: seconds until its last data message ended

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.log.append(tensor)
        if len(self.kept) < self.keep_first:
            self.kept.append(tensor.to("cpu", copy=True))
        self.sink(tensor, src)
        if tensor.is_cuda and tensor.nbytes >= DATA_BYTES:
            self.last_data = torch.cuda.Event(enable_timing=True)
            self.last_data.record()

    def sink(self, tensor: torch.Tensor, src: int) -> None:
        """The message's copy to host memory (the link's work; the replay calls it alone)."""
        if self.pool is None or tensor.nbytes in self._pinned or tensor.nbytes > self.pool.numel():
            super().broadcast(tensor, src)
        else:
            self.pool[: tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor, non_blocking=True)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        if self.in_step:  # the stand-in has no peers: they are taken to be in step
            versions_in_step(tensor, self.rank, self.size)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _check_first_layer(sender: Sender, msgs: list, layer: dict) -> tuple[int, int]:
    """Layer 0's segments as sent (``msgs``: after the prelude, the manifest and its header)
    against the reference conversion of ``layer``, the current masters, cut by each piece's shard
    and rows: (bytes checked, bytes that differ)."""
    lay, plan = sender.routes.layers[0], sender.plans[0]
    # The reference on the layer's device (bit-exact there as on the CPU, and far faster), expert by
    # expert: a whole stack's float32 temporaries (24 GiB) do not fit beside the kept copy.
    ref = convert_layer_ref(
        {k.removeprefix(layer_prefix(0)): t for k, t in layer.items()}, 0, plan, per_expert=True
    )
    checked, differ, _ = sent_layer_mismatches(lay, sender.me, iter(msgs), ref)
    return checked, differ


def _kept_messages(sender: Sender) -> list:
    """The delta state's kept copy of layer 0 as a dense update's messages would carry it (each
    segment's data bytes, once per message, in the order the sender posts them), for
    ``_check_first_layer``: what every engine rank holds of it after the delta updates."""
    lay = sender.routes.layers[0]
    segs = lay.of_sender(sender.me)
    kept = dict(zip(map(id, segs), sender.delta.kept[0]))
    order = [s for s in segs if s.group is not None] + [s for s in segs if s.group is None]
    return [kept[id(s)].to(sender.device) for s in order for _ in range(lay.messages(s))]


def parse_server(text: str) -> tuple[int, int, int, bool]:
    """``[Nx]TP<t>[xDP<d>]`` or ``[Nx]EP<t>[xDP<d>]`` -> (replicas, tp, dp, ep)."""
    m = re.fullmatch(r"(?:(\d+)x)?(TP|EP)(\d+)(?:xDP(\d+))?", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected [Nx]TP<t>[xDP<d>] or [Nx]EP<t>[xDP<d>], got {text!r}")
    return int(m.group(1) or 1), int(m.group(3)), int(m.group(4) or 1), m.group(2) == "EP"


def fleet_layouts(args) -> list[EngineLayout]:
    """Every engine rank of the fleet, server after server (``--servers``, else ``--engines``
    replicas of TP ``--tp``)."""
    servers = args.servers or [(args.engines, args.tp, 1, args.ep)]
    return [lay for n, tp, dp, ep in servers for _ in range(n) for lay in EngineLayout.all_ranks(tp, dp, ep)]


def fleet_name(args) -> str:
    if not args.servers:
        return f"{args.engines} x {'EP' if args.ep else 'TP'}{args.tp}"
    return " + ".join(
        f"{n} x {'EP' if ep else 'TP'}{tp}{f' x DP{dp}' if dp > 1 else ''}" for n, tp, dp, ep in args.servers
    )


def predicted_wire(sender: Sender, config: dict, layouts: list, mode: str) -> int:
    """The bytes the model says this sender puts on its link for the update: every segment once
    per group broadcast or once per receiving rank (``LayerRoutes.sent_nbytes``); for scatter also
    checked against ``update_regions``, the update-time model's own sum. The link carries these
    plus the protocol's own words (prelude, manifest, headers, votes: a few KiB)."""
    routes = sum(lay.sent_nbytes(sender.me) for lay in sender.routes.layers)
    if mode == "scatter":
        u = update_regions(config, layouts, layer_ids=sender.layer_ids, rest=False)
        assert sum(lay.wire_nbytes for lay in u.layers) == routes, "routes and update_regions disagree"
    return routes


# Python's cycle collections (seconds each), inside send_model (which pauses the collector) and
# between updates: the delta rows print them.
_COLLECTIONS: dict[bool, list[float]] = {True: [], False: []}
_COLLECTING = {"inside": False, "t0": 0.0}


def _watch_collections(phase: str, info: dict) -> None:
    if phase == "start":
        _COLLECTING["t0"] = time.perf_counter()
    else:
        _COLLECTIONS[_COLLECTING["inside"]].append(time.perf_counter() - _COLLECTING["t0"])


gc.callbacks.append(_watch_collections)


def _gpu_profile(update, device: torch.device, layers: int, top: int) -> str:
    """One update under torch.profiler: its wall time beside the GPU's own time (kernels and copies,
    summed over streams) and the launches a layer, then the ``top`` costliest GPU operations. A GPU
    time near the wall time says the step is bound by the GPU's work, one well under it by the host."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        update()
        _sync(device)
        wall = time.perf_counter() - t0
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in gpu) / 1e6
    per_layer = len(gpu) / max(layers, 1)
    lines = [
        f"gpu profile (one update; the profiler's own cost inflates the wall time): wall "
        f"{1e3 * wall:.1f} ms, GPU operations {len(gpu)} ({per_layer:.0f} a layer), their time "
        f"{1e3 * busy:.1f} ms ({busy / wall:.2f} of the wall time, summed over streams)"
    ]
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=top)
    lines += ["gprof| " + ln for ln in table.splitlines() if ln.strip()]
    return "\n".join(lines)


def _timed_update(sender: Sender, link: Recorder, stream, src: int) -> tuple:
    """One update and the same messages sent alone, interleaved (the same clocks): (its stats,
    the link-alone seconds, the bytes the link carried). The GPU work queued before it (the
    stand-in trainer step) ends first: the update's time is its own."""
    _sync(sender.device)
    link.log, link.last_data = [], None
    start = torch.cuda.Event(enable_timing=True) if sender.device.type == "cuda" else None
    if start is not None:
        start.record()
    _COLLECTING["inside"] = True
    stats = sender.send_model(stream())
    _COLLECTING["inside"] = False
    _sync(sender.device)
    if start is not None and link.last_data is not None:  # when this sender's share had left it
        link.shares.append(start.elapsed_time(link.last_data) / 1e3)
    msgs, link.log = link.log, []
    t_link = _seconds(lambda: [link.sink(m, src) for m in msgs], sender.device)
    return stats, t_link, sum(m.nbytes for m in msgs)


def _median(xs: list) -> float:
    return statistics.median_low(xs)


def measure_delta(
    args,
    sender: Sender,
    link: Recorder,
    stream,
    state,
    shadow: dict,
    layer: dict,
    dense: tuple,
    head: list,
    last: bool,
) -> list:
    """The delta rows of one (master, sender) (module docstring), after its dense row: ``state``,
    the sender's ``SenderDelta`` (nothing kept yet), attached; one update fills the kept copy
    (every layer dense: nothing was kept), then per learning rate ``--delta-steps`` delta updates,
    each after a stand-in trainer step of ``shadow`` into ``layer``. ``dense``: the dense row's
    (total seconds, link bytes), its median run. ``last``: the last kept variant of this row, which
    frees the shadow and checks layer 0's kept bytes against the reference of the final masters."""
    device, src = sender.device, link.rank
    cuda = device.type == "cuda"
    alloc = lambda: torch.cuda.memory_allocated(device) if cuda else 0  # noqa: E731
    lays = sender.routes.layers
    # Predicted GPU memory (the update-time model, glm_fp8.planning.update_delta.sender_share): the kept copy
    # (in host memory: none of it on the GPU) and the delta message buffers.
    share = sender_share(
        sender.routes,
        sender.me,
        [lay.local_plans[sender.me] for lay in lays],
        Delta(0.0, kept=state.options.kept),
        0.0,
        0.0,
        ring=args.ring,
    )
    kept = 0 if state.host else share.kept
    predicted = kept + share.buffers
    model = share.scratch  # pack_bytes_delta's scratch for the largest piece: part of the transient
    before = alloc()
    sender.delta, link.in_step = state, True
    link.pool = torch.empty(max(state.buf_nbytes, 1), dtype=torch.uint8, pin_memory=cuda)
    _timed_update(sender, link, stream, src)  # dense for every layer: fills the kept copy
    gen = torch.Generator(device=device).manual_seed(1)
    for _ in range(args.delta_warmup):  # untimed: a layer's graph runs once, then is captured
        trainer_step(shadow, layer, args.delta_lr[0], gen, args.delta_step[0])
        _timed_update(sender, link, stream, src)
    dense_s, dense_bytes = dense
    measured, rows = None, []
    for kind, lr in [(k, lr) for k in args.delta_step for lr in args.delta_lr]:
        runs = []
        _COLLECTIONS[True].clear()
        _COLLECTIONS[False].clear()
        for _ in range(args.delta_steps):
            trainer_step(shadow, layer, lr, gen, kind)
            at = alloc()
            stats, t_link, nbytes = _timed_update(sender, link, stream, src)
            measured = alloc() - before if measured is None else measured  # kept + buffers, allocated
            # the update's transient: its peak less what it allocated and kept (the first: buffers)
            transient = None if stats.peak_bytes is None else stats.peak_bytes - (alloc() - at)
            runs.append((stats, t_link, nbytes, sum(state.is_delta), transient))
        secs = [r[0].seconds for r in runs]
        wires = [r[2] / dense_bytes for r in runs]
        stats, t_link, nbytes = sorted(runs, key=lambda r: r[0].seconds)[(len(runs) - 1) // 2][:3]
        steps = sorted(x.seconds for x in stats.layers)
        slow = sorted(range(len(stats.layers)), key=lambda i: -stats.layers[i].seconds)[:4]
        inside, outside = (_COLLECTIONS[k] for k in (True, False))
        print(
            f"Python cycle collections, {kind} lr {lr:g}: {len(inside)} inside the updates "
            f"({1e3 * sum(inside):.1f} ms), {len(outside)} between them "
            f"({1e3 * sum(outside):.1f} ms)"
        )
        print(
            f"steps ({state.options.kept}, {kind} lr {lr:g}, its median update): slowest "
            + ", ".join(f"layer {i}: {1e3 * stats.layers[i].seconds:.1f} ms" for i in slow)
            + f"; outside the steps {1e3 * (stats.seconds - sum(steps)):.1f} ms"
        )
        if args.profile:  # one more step and update, profiled apart from the timed ones
            trainer_step(shadow, layer, lr, gen, kind)
            _sync(device)  # as _timed_update: the step's queued GPU work is not the update's
            prof = cProfile.Profile()
            prof.runcall(sender.send_model, stream())
            _sync(device)
            link.log = []  # its messages (views of the delta buffers) must not outlive this variant
            text = io.StringIO()
            for key in ("tottime", "cumulative"):
                table = pstats.Stats(prof, stream=text).sort_stats(key)
                table.print_stats("glm_fp8|torch|triton", args.profile)
            print(
                f"host profile ({state.options.kept}, {kind} lr {lr:g}, one update; cProfile's own cost "
                "inflates it), each line marked 'prof|':"
            )
            print("\n".join("prof| " + ln for ln in text.getvalue().splitlines() if ln.strip()))
        if args.gpu_profile and device.type == "cuda":
            trainer_step(shadow, layer, lr, gen, kind)
            _sync(device)
            print(
                _gpu_profile(lambda: sender.send_model(stream()), device, len(stats.layers), args.gpu_profile)
            )
            link.log = []
        peaks = [r[4] for r in runs if r[4] is not None]
        rows.append(
            [
                *head,
                state.options.kept,
                (
                    f"{sender.graphs.captures}, {sender.graphs.replays}"
                    if sender.graphs.enabled
                    else ("off" if sender.graphs.failed is None else f"failed: {sender.graphs.failed[:60]}")
                ),
                kind,
                f"{lr:g}",
                f"{_median(secs):.3f} ({min(secs):.3f}-{max(secs):.3f})",
                f"{dense_s:.3f}",
                f"{_median(secs) / dense_s:.4f}",
                f"{nbytes / 2**20:.2f}",
                f"{100 * _median(wires):.3f} ({100 * max(wires):.3f})",
                f"{t_link:.3f}",
                f"{stats.seconds / t_link:.3f}",
                f"{1e3 * steps[len(steps) // 2]:.1f}",
                f"{1e3 * steps[-1]:.1f}",
                f"{min(r[3] for r in runs)} of {len(lays)}",
                f"{measured / GiB:.3f}" if cuda else "-",
                f"{predicted / GiB:.3f} ({kept / GiB:.3f} + {(predicted - kept) / GiB:.3f})",
                f"{model / GiB:.4f}",
                f"{max(peaks) / GiB:.3f}" if peaks else "-",
                "-",
            ]
        )
    if last and shadow is not layer:
        shadow.clear()  # the reference below needs the room (a GLM-5 layer's is ~50 GiB)
    if last and args.check and rows:
        checked, differ = _check_first_layer(sender, _kept_messages(sender), layer)
        rows[-1][-1] = f"{checked}/{differ}"
    return rows


def measure(args, master: torch.dtype, t: int) -> tuple[list, list]:
    device = torch.device(args.device)
    gc.collect()  # what an earlier row left must not count in this one's memory
    n = args.layers
    base_cfg = TINY_GLM5 if args.model == "tiny" else PRESETS["glm-5"]
    config = {**base_cfg, "num_hidden_layers": n, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0}
    plan = plan_from_config(config, 0)
    gen = torch.Generator(device=device).manual_seed(0)
    layer = {
        layer_prefix(0) + k: torch.randn(shape, device=device, generator=gen, dtype=master).mul_(0.02)
        for k, (shape, _) in plan.inputs.items()
    }
    handed = set(range(n))  # the layers this sender is handed (a Megatron stage's: its own)
    stream = lambda: (
        (i, {k.replace("layers.0.", f"layers.{i}."): x for k, x in layer.items()} if i in handed else {})  # noqa: E731
        for i in range(n)
    )
    layouts = fleet_layouts(args)
    kw = dict(config=config, device=device, ring=args.ring, checksum=not args.no_checksum)
    if args.mode == "broadcast":
        size, src = 2, 0
    elif args.mode == "scatter":
        kw["engines"], size, src = [None, *layouts], 1 + len(layouts), 0
    else:
        kw["engines"] = [None] * args.senders + layouts
        kw["senders"], size, src = list(range(args.senders)), args.senders + len(layouts), t
        if args.trainer is not None:  # each stage's senders hold its layers
            holders = args.trainer.holders(config, list(range(n)))
            kw["holders"] = {i: h if isinstance(h, tuple) else dict(h) for i, h in enumerate(holders)}
            handed = {
                i
                for i, h in enumerate(holders)
                if t in (h if isinstance(h, tuple) else {r for v in h.values() for r in v})
            }
    if args.delta_lr:
        kw["delta"] = DeltaOptions(kept=args.delta_kept[0])
    if device.type == "cuda":
        torch.cuda.empty_cache()
    inputs = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    link = Recorder(src, size)
    sender = Sender(link, src, **kw)
    # The dense row is today's dense update: the delta state (nothing allocated until its first
    # update) is attached after it; the manifest, built once, is the delta sender's.
    sender.payload()
    state, sender.delta = sender.delta, None
    lay0 = sender.routes.layers[0]  # keep the prelude, the manifest, layer 0's header and messages
    link.keep_first = 3 + sum(lay0.messages(s) for s in lay0.of_sender(sender.me))
    sender.send_model(stream())  # warm-up (compiles); keeps layer 0's messages for the check
    checked, differ = _check_first_layer(sender, link.kept[3:], layer) if args.check else (0, 0)
    link.kept, link.keep_first = [], 0
    runs = [_timed_update(sender, link, stream, src) for _ in range(args.repeats)]
    wire = predicted_wire(sender, config, layouts, args.mode) if args.mode != "broadcast" else 0

    def convert_only():
        for pos, (i, sd) in enumerate(stream()):
            sender._convert(pos, i, *trainer_view(sender.plans[pos], strip_layer(sd, i), i))

    t_convert = _seconds(convert_only, device)
    ratios = sorted(st.seconds / tl for st, tl, _ in runs)
    stats, t_link, nbytes = sorted(runs, key=lambda r: r[0].seconds / r[1])[len(runs) // 2]
    conv, send = sender.routes.sender_buffers(sender.me)
    predicted = args.ring * (conv + send) + sender.scratch.nbytes  # plain inputs: nothing gathered
    # The rings (allocated at the first update and kept) plus the update's own transient peak.
    held = torch.cuda.memory_allocated(device) - inputs if device.type == "cuda" else 0
    peak = held + (stats.peak_bytes or 0)
    steps = sorted(s.seconds for s in stats.layers)
    head = [args.mode, str(master).removeprefix("torch."), t]
    # Which steps are slow, and what the steps of layers this sender holds nothing of cost (a
    # pipeline stage's sender runs every step of the update: see --trainer).
    slow = sorted(range(len(stats.layers)), key=lambda i: -stats.layers[i].seconds)[:4]
    idle = [x.seconds for x in stats.layers if x.layer not in handed and x.layer >= 0]
    if link.shares and len(handed) < n:
        # A pipeline stage's sender: its share has left it once its last data message has; the
        # steps after it (other stages' layers) take, on a real link, those stages' time.
        share = sorted(x / tl for x, (_, tl, _) in zip(link.shares[-len(runs) :], runs))
        print(
            f"share on the wire ({head[0]}, {head[1]}, sender {t}): from the update's start to its last "
            f"data message's end over the link alone, median {share[(len(share) - 1) // 2]:.4f} "
            f"(range {share[0]:.4f}-{share[-1]:.4f})"
        )
    print(
        f"steps ({head[0]}, {head[1]}, sender {t}, its median update): slowest "
        + ", ".join(f"layer {stats.layers[i].layer}: {1e3 * stats.layers[i].seconds:.1f} ms" for i in slow)
        + f"; {len(idle)} steps of layers it holds nothing of: {1e3 * sum(idle):.1f} ms"
        + f"; outside the steps {1e3 * (stats.seconds - sum(steps)):.1f} ms"
    )
    deltas, shadow = [], None
    if state is not None:
        # The trainer's fp32 masters (a bf16 master's fp32 copy), made after the dense row's
        # measurements and its layer-0 check (whose reference of a whole GLM-5 layer needs the room).
        shadow = layer if master == torch.float32 else {k: x.float() for k, x in layer.items()}
    variants = [(where, g == "on") for where in args.delta_kept for g in args.delta_graphs]
    for k, (where, graphs) in enumerate(variants if state is not None else []):
        sender.delta = state = None  # the previous variant's kept copy and graphs freed first
        sender.graphs.clear()
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
        state = sender.attach_delta(DeltaOptions(kept=where, graphs=graphs))
        sender.delta = None
        last = k == len(variants) - 1
        deltas += measure_delta(
            args, sender, link, stream, state, shadow, layer, (stats.seconds, nbytes), head, last
        )
    # free the kept copy, its buffers and the rings before the next row
    sender.delta = state = shadow = link.pool = None
    sender.conv_ring = sender.send_ring = None
    return [
        *head,
        f"{nbytes / n / 2**30:.3f}",
        f"{stats.seconds:.3f}",
        f"{t_link:.3f}",
        f"{t_convert:.3f}",
        f"{stats.seconds / t_link:.4f} ({ratios[0]:.4f}-{ratios[-1]:.4f})",
        f"{nbytes / t_link / 1e9:.1f}",
        f"{peak / 2**30:.3f}",
        f"{predicted / 2**30:.3f}",
        f"{peak / predicted:.3f}",
        f"{wire / 2**30:.3f}" if wire else "-",
        f"{nbytes / wire:.5f}" if wire else "-",
        f"{checked}/{differ}",
        f"{1e3 * steps[len(steps) // 2]:.1f}",
        f"{1e3 * steps[-1]:.1f}",
    ], deltas


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("broadcast", "scatter", "senders"), default="broadcast")
    p.add_argument("--layers", type=int, default=80, help="GLM-5 sparse layers in the update (default 80)")
    p.add_argument("--tp", type=int, default=8, help="engine tensor-parallel size (default 8)")
    p.add_argument("--ep", action="store_true", help="engines use expert parallelism")
    p.add_argument("--engines", type=int, default=1, help="engine replicas (default 1)")
    p.add_argument(
        "--servers",
        nargs="+",
        type=parse_server,
        default=None,
        help="a fleet instead of --engines: [Nx]TP<t>[xDP<d>] or [Nx]EP<t>[xDP<d>], one per server",
    )
    p.add_argument("--senders", type=int, default=32, help="trainer ranks, --mode senders (default 32)")
    p.add_argument("--sender", type=int, nargs="+", default=[0], help="the link ranks measured (default 0)")
    p.add_argument(
        "--trainer",
        type=MegatronTrainer.parse,
        default=None,
        help="megatron:tpN,ppN,cpN,epN (--mode senders): a Megatron-Core trainer's senders, "
        "each stage its layers",
    )
    p.add_argument("--master", nargs="+", default=["bf16"], choices=("bf16", "fp32"), help="master dtypes")
    p.add_argument("--repeats", type=int, default=3, help="updates timed, each beside a link-alone timing")
    p.add_argument("--ring", type=int, default=2, help="conversion and send slots (default 2)")
    p.add_argument("--no-checksum", action="store_true", help="send no checksums")
    p.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip layer 0's byte check (its reference needs ~50 GiB for a whole GLM-5 layer)",
    )
    p.add_argument(
        "--delta-lr",
        type=float,
        nargs="+",
        default=None,
        metavar="LR",
        help="after the dense row, delta updates after stand-in trainer steps at each of "
        "these learning rates (module docstring)",
    )
    p.add_argument(
        "--delta-step",
        nargs="+",
        default=["sign"],
        choices=STEPS,
        help="the stand-in trainer step, each a variant: sign (Adam's first step) or adam "
        "(Adam's step once warm); bench/scripts/standin.py",
    )
    p.add_argument("--delta-steps", type=int, default=3, help="delta updates per --delta-lr (default 3)")
    p.add_argument(
        "--delta-graphs",
        nargs="+",
        choices=("on", "off"),
        default=["off"],
        help="each a variant: the sender's layers captured as CUDA graphs (DeltaOptions.graphs) or not",
    )
    p.add_argument(
        "--delta-warmup",
        type=int,
        default=2,
        help="untimed delta updates before the timed ones (default 2: a layer's graph is captured "
        "at its second delta update, replayed from its third)",
    )
    p.add_argument(
        "--delta-kept",
        nargs="+",
        default=["gpu"],
        choices=KEPT_COPIES,
        help="where the sender keeps what it last sent, each a variant (default gpu)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after each --delta-lr's timed updates, one more profiled by cProfile: its N "
        "costliest functions (host time, own and cumulative)",
    )
    p.add_argument(
        "--gpu-profile",
        type=int,
        default=0,
        metavar="N",
        help="after each --delta-lr's timed updates, one more under torch.profiler (CUDA): its GPU "
        "time beside its wall time, and its N costliest GPU operations",
    )
    p.add_argument("--device", default="cuda", help="default cuda; cpu checks the script")
    p.add_argument("--model", choices=("glm-5", "tiny"), default="glm-5")
    args = p.parse_args()
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    senders = args.sender if args.mode == "senders" else [0]
    if args.trainer is not None:
        if args.mode != "senders":
            p.error("--trainer: with --mode senders (a Megatron trainer sends from its stages' ranks)")
        args.senders = args.trainer.senders
    if args.delta_steps < 1:
        p.error(f"--delta-steps: expected at least 1, got {args.delta_steps}")
    rows, deltas = [], []
    for m in args.master:
        for t in senders:
            row, d = measure(args, dtypes[m], t)
            rows.append(row)
            deltas += d
    engines = fleet_name(args)
    what = {
        "broadcast": "one sender, one full receiver",
        "scatter": f"one sender into {engines}",
        "senders": f"{args.senders} senders"
        + (f" ({args.trainer.describe()})" if args.trainer is not None else "")
        + f" into {engines}",
    }[args.mode]
    print(
        f"{args.layers} {args.model} sparse layers, {what}, ring {args.ring}, checksum "
        f"{not args.no_checksum}; stand-in link: device-to-host copies into pinned memory"
    )
    print(
        tabulate(
            rows,
            [
                "mode",
                "master",
                "sender",
                "sent GiB/layer",
                "total s",
                "link alone s",
                "convert+pack alone s",
                "total / link (median, range)",
                "link GB/s",
                "peak GiB",
                "predicted GiB",
                "peak / predicted",
                "wire GiB predicted",
                "wire measured / predicted",
                "layer-0 bytes checked/differ",
                "step ms (median)",
                "step ms (max)",
            ],
        )
    )
    if deltas:
        print(
            f"\ndelta updates ({args.delta_steps} per step and lr, each after a stand-in trainer step: "
            "sign, w32 -= lr * sign(randn); adam, w32 -= lr * 0.229 * randn); versions: every engine "
            "rank and sender in step (stand-in link)"
        )
        print(
            tabulate(
                deltas,
                [
                    "mode",
                    "master",
                    "sender",
                    "kept",
                    "graphs (captured, replayed)",
                    "step",
                    "lr",
                    "delta s (median, range)",
                    "dense s",
                    "delta / dense time",
                    "delta wire MiB",
                    "wire delta / dense % (median, max)",
                    "link alone s",
                    "delta total / link",
                    "step ms (median)",
                    "step ms (max)",
                    "layers as delta (min)",
                    "GPU kept+bufs GiB measured",
                    "GPU kept+bufs GiB predicted (kept on the GPU + bufs)",
                    "compare scratch GiB (model)",
                    "delta transient GiB (max)",
                    "kept layer-0 checked/differ",
                ],
            )
        )


if __name__ == "__main__":
    main()
