"""One engine rank landing an update through the one-GPU stand-in link: its time per layer against
the link alone (the same bytes copied host-to-device) and against a device-to-device copy of the
same bytes, and the extra GPU memory the update takes on the rank against the transfer plan's
prediction (what ``glm-fp8 plan`` reports).

    python3 bench/scripts/engine_rank.py [--layers 16] [--tp 8] [--ep] [--rank 0] [--ring 2]
        [--delta] [--delta-lr 1e-5]

GLM-5 sparse layers (Gaussian x 0.02, bf16); a single sender scatters each layer (the rank
receives only its shard: its segments of each layer, one per class of ranks it belongs to). The
sender's segments for this rank are recorded once, on the GPU; every layer carries the same bytes,
so the replay link hands the rank those segments from pinned host memory for every layer, and the
leader's prelude, manifest and headers as an agreeing leader sends them. The rank's parameters are
vLLM's (``engine_params``), checked against the reference after the update. ``--device cpu
--model tiny`` checks the script.

``--delta`` (issue #33): a second table, the rank's delta updates. The sender
(``Sender(delta=DeltaOptions())``) sends two updates of the layer, recorded alike: the first dense
(weights W0), the second a delta after a stand-in trainer step (W1: ``w32 -= lr * sign(randn)``
on an fp32 copy of W0, seeded, cast back to bf16; ``--delta-lr``). The stand-in link has no peers:
its versions exchange answers as if every engine rank held what the sender last sent. The rank
(``Receiver(delta=True)``) lands the dense updates of the first table, then delta updates: the
replay link answers the versions exchange as a sender in step with this rank (every layer a delta:
its kept versions are the ones this rank holds) and hands it the recorded counts messages and
payloads for every layer (each layer holds W0, so each becomes W1). Each delta update is timed
against the link alone (the same delta messages copied host-to-device) and the dense update; its
extra GPU memory against the update-time model's (``glm_fp8.planning.update_delta.receiver_bytes``); every
parameter is checked against the reference conversion of W1.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from standin import trainer_step, versions_in_step
from tabulate import tabulate

from glm_fp8.engine import EngineLayout, engine_params, take_shard
from glm_fp8.kernels.reference import convert_layer_ref
from glm_fp8.model.plans import plan_from_config
from glm_fp8.model.presets import PRESETS, TINY_GLM5
from glm_fp8.model.trainer_layouts import layer_prefix
from glm_fp8.planning.update_delta import receiver_bytes as delta_receiver_bytes
from glm_fp8.transfer import DeltaOptions, HostSinkComm, Receiver, Sender
from glm_fp8.transfer.delta.versions import NONE
from glm_fp8.transfer.link import Link
from glm_fp8.transfer.wire import MAGIC, PROTOCOL_VERSION

GiB = 2**30


class SegmentRecorder(HostSinkComm):
    """The sender's stand-in link, keeping a host copy of what it sends link rank ``peer``, in the
    order it sends it."""

    def __init__(self, size: int, peer: int):
        super().__init__(rank=0, size=size)
        self.peer, self.kept = peer, []

    def exchange(self, sends, recvs) -> None:
        self.kept += [t.to("cpu", copy=True) for t, r in sends if r == self.peer]
        super().exchange(sends, recvs)

    def group_broadcast(self, tensor, src, ranks) -> None:
        if self.peer in ranks:
            self.kept.append(tensor.to("cpu", copy=True))
        super().group_broadcast(tensor, src, ranks)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        # No peers: in step (standin.py). Its first update kept nothing, so it goes dense; the
        # next one goes as a delta.
        versions_in_step(tensor, self.rank, self.size)


class Replay(Link):
    """The engine rank's stand-in link: the leader's prelude, manifest and headers as an agreeing
    leader sends them (the receiver's own), and ``segments`` (pinned host memory: the one layer's
    messages for this rank, in the order the sender sent them: a dense update's segments, or a
    delta update's counts messages and payloads) for every layer, copied to the device on the
    current stream. ``delta``: how the versions exchange is answered (``all_reduce_max``)."""

    groups_supported = True

    def __init__(self, rank: int, size: int, segments: list[torch.Tensor]):
        self.rank, self.size, self.segments = rank, size, segments
        self.receiver: Receiver | None = None
        self.calls = 0
        self.copies: list[torch.Tensor] = []  # the destinations of the segments, for the link-alone replay
        self.delta = False

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        r, payload = self.receiver, self.receiver.payload()
        if self.calls == 0:
            tensor.copy_(torch.tensor([MAGIC, PROTOCOL_VERSION, len(payload), 0], dtype=torch.int64))
        elif self.calls == 1:
            tensor.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        else:
            tensor.copy_(r._headers[self.calls - 2], non_blocking=True)
        self.calls += 1

    def _segment(self, tensor: torch.Tensor) -> None:
        # In the receiver's order, which is the sender's: each message lands in a destination of its
        # size (a delta payload's is sized from the counts message before it).
        tensor.copy_(self.segments[len(self.copies) % len(self.segments)], non_blocking=True)
        self.copies.append(tensor)

    def group_broadcast(self, tensor, src, ranks) -> None:
        self._segment(tensor)

    def exchange(self, sends, recvs) -> None:
        for t, _ in recvs:
            self._segment(t)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        if tensor.dim() != 2:
            return None  # a vote: this rank's own
        # The versions table (ReceiverDelta.begin: this rank's held versions in its row, NONE
        # elsewhere). Every engine rank holds what this one does (its row in each); the sender keeps
        # those versions (``delta``: every layer a delta, glm_fp8.transfer.delta.segments.delta_layers)
        # or none (every layer dense), and proposes the next update number.
        mine = tensor[self.rank].cpu()
        held = mine[:-1]
        table = mine.expand(self.size, -1).clone()
        for s in self.receiver.senders:
            table[s, :-1] = held if self.delta else NONE
            table[s, -1] = int(held.max()) + 1
        tensor.copy_(table.to(tensor.device))

    def make_groups(self, groups) -> None:
        return None


def _seconds(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _reference(layer: dict, plan, targets: dict) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter of the layer converted by the reference (on the
    layer's device: the same bits, far faster), owned: the full conversion is freed on return.
    Expert by expert (``per_expert``): a GLM-5 stack's float32 temporaries do not fit beside it."""
    full = convert_layer_ref(layer, 0, plan, per_expert=True)
    return {
        targets[k].name: take_shard(x, targets[k].shard).to(targets[k].dtype).clone() for k, x in full.items()
    }


def _same(params: dict, ref: dict, n: int) -> int:
    """The parameters of every layer whose bytes equal the reference's (each layer got the same)."""
    return sum(
        torch.equal(
            params[k.replace(layer_prefix(0), layer_prefix(i), 1)].view(torch.uint8), want.view(torch.uint8)
        )
        for k, want in ref.items()
        for i in range(n)
    )


def _loads(link: Replay, receiver: Receiver, params: dict, device: torch.device, repeats: int) -> list:
    """``repeats`` updates, each beside the link alone (the same messages copied to the same
    destinations): (seconds, link seconds, stats) each."""
    runs = []
    for _ in range(repeats):
        link.calls, link.copies = 0, []
        stats = receiver.load_into(params)
        dsts = list(link.copies)
        srcs = [link.segments[k % len(link.segments)] for k in range(len(dsts))]
        t_link = _seconds(lambda: [d.copy_(s, non_blocking=True) for d, s in zip(dsts, srcs)], device)
        runs.append((stats.seconds, t_link, stats))
    return runs


def measure(args, ep: bool) -> tuple[list, list | None]:
    """The dense row and, with ``--delta``, the delta row (None without)."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    gc.collect()  # what an earlier row left must not count in this one's memory
    n = args.layers
    base = TINY_GLM5 if args.model == "tiny" else PRESETS["glm-5"]
    config = {**base, "num_hidden_layers": n, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0}
    layouts = EngineLayout.all_ranks(args.tp, 1, ep)
    layout, me = layouts[args.rank], 1 + args.rank
    engines = [None, *layouts]
    gen = torch.Generator(device=device).manual_seed(0)
    plan = plan_from_config(config, 0)
    layer = {
        k: torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16).mul_(0.02)
        for k, (shape, _) in plan.inputs.items()
    }
    pin = lambda msgs: [m.pin_memory() for m in msgs] if cuda else msgs  # noqa: E731
    rec = SegmentRecorder(len(engines), me)
    sender = Sender(
        rec,
        0,
        config=config,
        layer_ids=[0],
        engines=engines,
        device=device,
        delta=DeltaOptions() if args.delta else None,
    )
    sender.send_model([(0, layer)])
    segments, rec.kept = pin(rec.kept), []
    if args.delta:
        layer1 = {k: w.clone() for k, w in layer.items()}  # W1: bf16 masters, their own shadow
        trainer_step(layer1, layer1, args.delta_lr, torch.Generator(device=device).manual_seed(1))
        sender.send_model([(0, layer1)])
        if not all(sender.delta.is_delta):
            raise RuntimeError(
                f"the sender's second update went dense (is_delta {sender.delta.is_delta}), "
                "expected every layer a delta (SegmentRecorder.all_reduce_max)"
            )
        messages = pin(rec.kept)
    del rec, sender  # free the sender's rings and kept copy before the reference's temporaries
    if cuda:
        torch.cuda.empty_cache()
    targets = {p.kernel_name: p for p in engine_params(config, layout).values()}
    ref = _reference(layer, plan, targets)
    del layer
    if args.delta:
        ref1 = _reference(layer1, plan, targets)
        del layer1
    if cuda:
        torch.cuda.empty_cache()
    specs = {k: p for k, p in engine_params(config, layout).items() if k.startswith("model.layers.")}
    params = {k: torch.empty(p.shape, dtype=p.dtype, device=device) for k, p in specs.items()}
    for p in params.values():
        p.view(torch.uint8).fill_(0x5A)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    link = Replay(me, len(engines), segments)
    receiver = Receiver(
        link,
        0,
        config=config,
        layout=layout,
        engines=engines,
        ring=args.ring,
        device=device,
        delta=args.delta,
    )
    link.receiver = receiver
    receiver.load_into(params)  # warm-up
    runs = _loads(link, receiver, params, device, args.repeats)
    peak = torch.cuda.max_memory_allocated(device) - before if cuda else 0
    predicted = receiver.routes.receiver_bytes(me, args.ring, device.type)
    same = _same(params, ref, n)
    total, t_link, _ = sorted(runs, key=lambda r: r[0] / r[1])[len(runs) // 2]
    nbytes = sum(s.nbytes for s in segments)  # one layer's, for this rank
    slots = [torch.empty(s.nbytes, dtype=torch.uint8, device=device) for s in segments]
    firsts = link.copies[: len(segments)]
    t_copy = _seconds(lambda: [d.copy_(c) for _ in range(n) for d, c in zip(slots, firsts)], device)
    name = f"{'EP' if ep else 'TP'}{args.tp} rank {args.rank}"
    row = [
        name,
        f"{nbytes / GiB:.3f}",
        f"{1e3 * total / n:.2f}",
        f"{1e3 * t_link / n:.2f}",
        f"{total / t_link:.4f}",
        f"{1e3 * t_copy / n:.3f}",
        f"{(total - t_link) / t_copy:.2f}",
        f"{peak / GiB:.4f}",
        f"{predicted / GiB:.4f}",
        f"{peak / predicted if predicted else 0:.4f}",
        f"{same}/{len(ref) * n}",
    ]
    if not args.delta:
        return row, None
    slots.clear()  # the device-to-device copy's room, freed before the delta updates
    # The delta updates: every layer rebuilt from the parameters (W0), changed to W1 and checked.
    link.segments, link.delta = messages, True
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    link.calls, link.copies = 0, []
    receiver.load_into(params)  # warm-up: allocates the delta buffers (counted: kept across updates)
    druns = _loads(link, receiver, params, device, args.repeats)
    dpeak = torch.cuda.max_memory_allocated(device) - before if cuda else 0
    dpredicted = delta_receiver_bytes(receiver.routes, me, args.ring)
    as_delta = sum(receiver.delta.is_delta)
    dsame = _same(params, ref1, n)
    dtotal, dt_link, dstats = sorted(druns, key=lambda r: r[0] / r[1])[len(druns) // 2]
    dbytes = sum(x.nbytes for x in dstats.layers) / n  # what arrived per layer: counts messages and payloads
    as_bytes = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    changed = sum(int((as_bytes(x) != as_bytes(ref1[k])).sum()) for k, x in ref.items())
    drow = [
        name,
        f"{as_delta} of {n}",
        f"{100 * changed / sum(x.nbytes for x in ref.values()):.3f}",
        f"{dbytes / 2**20:.4f}",
        f"{dbytes / nbytes:.5f}",
        f"{1e3 * dtotal / n:.2f}",
        f"{1e3 * dt_link / n:.2f}",
        f"{dtotal / dt_link:.4f}",
        f"{1e3 * total / n:.2f}",
        f"{dtotal / total:.4f}",
        f"{dpeak / GiB:.4f}",
        f"{dpredicted / GiB:.4f}",
        f"{dpeak / dpredicted if dpredicted else 0:.4f}",
        f"{dsame}/{len(ref1) * n}",
    ]
    return row, drow


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16, help="GLM-5 sparse layers (default 16)")
    p.add_argument("--tp", type=int, default=8, help="engine tensor-parallel size (default 8)")
    p.add_argument("--ep", nargs="+", default=["off", "on"], choices=("off", "on"), help="expert parallelism")
    p.add_argument("--rank", type=int, default=0, help="the engine rank measured (default 0)")
    p.add_argument("--ring", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--delta", action="store_true", help="also delta updates: a second table (docstring)")
    p.add_argument(
        "--delta-lr",
        type=float,
        default=1e-5,
        help="--delta: the stand-in trainer step's learning rate (default 1e-5)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", choices=("glm-5", "tiny"), default="glm-5")
    args = p.parse_args()
    measured = [measure(args, ep == "on") for ep in args.ep]
    rows = [row for row, _ in measured]
    print(
        f"{args.layers} {args.model} sparse layers scattered by one sender; stand-in link: host-to-device "
        "copies from pinned memory"
    )
    print(
        tabulate(
            rows,
            [
                "engine rank",
                "GiB/layer",
                "ms/layer",
                "link alone ms/layer",
                "total / link",
                "D2D copy of the bytes ms/layer",
                "(total - link) / copy",
                "extra GiB",
                "predicted GiB",
                "extra / predicted",
                "params equal to the reference",
            ],
        )
    )
    if args.delta:
        print(
            f"\ndelta updates after a stand-in trainer step (w32 -= {args.delta_lr:g} * sign(randn), bf16 "
            "weights); versions: the sender in step with this rank (stand-in link)"
        )
        print(
            tabulate(
                [d for _, d in measured],
                [
                    "engine rank",
                    "layers as delta",
                    "bytes changed % (W0 -> W1, this rank's)",
                    "received MiB/layer",
                    "received delta / dense",
                    "ms/layer",
                    "link alone ms/layer",
                    "total / link",
                    "dense ms/layer",
                    "delta / dense time",
                    "extra GiB",
                    "predicted GiB",
                    "extra / predicted",
                    "params equal to W1's reference",
                ],
            )
        )


if __name__ == "__main__":
    main()
