"""One engine rank landing an update through the one-GPU stand-in link: its time per layer against
the link alone (the same bytes copied host-to-device) and against a device-to-device copy of the
same bytes, and the extra GPU memory the update takes on the rank against the transfer plan's
prediction (what ``glm-fp8 plan`` reports).

    python3 bench/scripts/engine_rank.py [--layers 16] [--tp 8] [--ep] [--rank 0] [--ring 2]

GLM-5 sparse layers (Gaussian x 0.02, bf16); a single sender scatters each layer (the rank
receives only its shard: its segments of each layer, one per class of ranks it belongs to). The
sender's segments for this rank are recorded once, on the GPU; every layer carries the same bytes,
so the replay link hands the rank those segments from pinned host memory for every layer, and the
leader's prelude, manifest and headers as an agreeing leader sends them. The rank's parameters are
vLLM's (``engine_params``), checked against the reference after the update. ``--device cpu
--model tiny`` checks the script.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from tabulate import tabulate

from glm_fp8.engine import EngineLayout, engine_params, take_shard
from glm_fp8.models import PRESETS, TINY_GLM5
from glm_fp8.plan import layer_prefix, plan_from_config
from glm_fp8.reference import convert_layer_ref
from glm_fp8.transfer import HostSinkComm, Receiver, Sender
from glm_fp8.transfer.link import Link
from glm_fp8.transfer.wire import MAGIC, PROTOCOL_VERSION


class SegmentRecorder(HostSinkComm):
    """The sender's stand-in link, keeping a host copy of what it sends link rank ``peer``."""

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


class Replay(Link):
    """The engine rank's stand-in link: the leader's prelude, manifest and headers as an agreeing
    leader sends them (the receiver's own), and ``segments`` (pinned host memory: the one layer's
    segments for this rank, in the order the sender sent them) for every layer, copied to the
    device on the current stream."""

    groups_supported = True

    def __init__(self, rank: int, size: int, segments: list[torch.Tensor]):
        self.rank, self.size, self.segments = rank, size, segments
        self.receiver: Receiver | None = None
        self.calls = 0
        self.copies: list[torch.Tensor] = []  # the destinations of the segments, for the link-alone replay

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
        tensor.copy_(self.segments[len(self.copies) % len(self.segments)], non_blocking=True)
        self.copies.append(tensor)

    def group_broadcast(self, tensor, src, ranks) -> None:
        self._segment(tensor)

    def exchange(self, sends, recvs) -> None:
        for t, _ in recvs:
            self._segment(t)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        return None

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


def measure(args, ep: bool) -> list:
    device = torch.device(args.device)
    gc.collect()  # what an earlier row left must not count in this one's memory
    n = args.layers
    base = TINY_GLM5 if args.model == "tiny" else PRESETS["glm-5"]
    config = {**base, "num_hidden_layers": n, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0}
    layouts = EngineLayout.all_ranks(args.tp, 1, ep)
    layout, me = layouts[args.rank], 1 + args.rank
    engines = [None, *layouts]
    gen = torch.Generator(device=device).manual_seed(0)
    plan = plan_from_config(config, 0)
    layer = {k: torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16).mul_(0.02)
             for k, (shape, _) in plan.inputs.items()}  # fmt: skip
    rec = SegmentRecorder(len(engines), me)
    sender = Sender(rec, 0, config=config, layer_ids=[0], engines=engines, device=device)
    sender.send_model([(0, layer)])
    segments = [s.pin_memory() if device.type == "cuda" else s for s in rec.kept]
    del rec, sender  # free the sender's rings before the reference's temporaries
    if device.type == "cuda":
        torch.cuda.empty_cache()
    targets = {p.kernel_name: p for p in engine_params(config, layout).values()}
    full = convert_layer_ref(layer, 0, plan)  # on the layer's device: the same bits, far faster
    ref = {
        targets[k].name: take_shard(x, targets[k].shard).to(targets[k].dtype).clone() for k, x in full.items()
    }  # owned, so that the full reference is freed below
    del layer, full
    if device.type == "cuda":
        torch.cuda.empty_cache()
    specs = {k: p for k, p in engine_params(config, layout).items() if k.startswith("model.layers.")}
    params = {k: torch.empty(p.shape, dtype=p.dtype, device=device) for k, p in specs.items()}
    for p in params.values():
        p.view(torch.uint8).fill_(0x5A)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    link = Replay(me, len(engines), segments)
    receiver = Receiver(link, 0, config=config, layout=layout, engines=engines, ring=args.ring, device=device)
    link.receiver = receiver
    receiver.load_into(params)  # warm-up
    runs = []
    for _ in range(args.repeats):
        link.calls, link.copies = 0, []
        stats = receiver.load_into(params)
        dsts = list(link.copies)
        srcs = [segments[k % len(segments)] for k in range(len(dsts))]
        t_link = _seconds(lambda: [d.copy_(s, non_blocking=True) for d, s in zip(dsts, srcs)], device)
        runs.append((stats.seconds, t_link))
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
    predicted = receiver.routes.receiver_bytes(me, args.ring, device.type)
    same = sum(torch.equal(params[k.replace(layer_prefix(0), layer_prefix(i), 1)].view(torch.uint8),
                           want.view(torch.uint8)) for k, want in ref.items() for i in range(n))  # fmt: skip
    total, t_link = sorted(runs, key=lambda r: r[0] / r[1])[len(runs) // 2]
    nbytes = sum(s.nbytes for s in segments)  # one layer's, for this rank
    slots = [torch.empty(s.nbytes, dtype=torch.uint8, device=device) for s in segments]
    firsts = link.copies[: len(segments)]
    t_copy = _seconds(lambda: [d.copy_(c) for _ in range(n) for d, c in zip(slots, firsts)], device)
    return [f"{'EP' if ep else 'TP'}{args.tp} rank {args.rank}", f"{nbytes / 2**30:.3f}",
            f"{1e3 * total / n:.2f}", f"{1e3 * t_link / n:.2f}", f"{total / t_link:.4f}",
            f"{1e3 * t_copy / n:.3f}", f"{(total - t_link) / t_copy:.2f}", f"{peak / 2**30:.4f}",
            f"{predicted / 2**30:.4f}", f"{peak / predicted if predicted else 0:.4f}",
            f"{same}/{len(ref) * n}"]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16, help="GLM-5 sparse layers (default 16)")
    p.add_argument("--tp", type=int, default=8, help="engine tensor-parallel size (default 8)")
    p.add_argument("--ep", nargs="+", default=["off", "on"], choices=("off", "on"), help="expert parallelism")
    p.add_argument("--rank", type=int, default=0, help="the engine rank measured (default 0)")
    p.add_argument("--ring", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", choices=("glm-5", "tiny"), default="glm-5")
    args = p.parse_args()
    rows = [measure(args, ep == "on") for ep in args.ep]
    print(f"{args.layers} {args.model} sparse layers scattered by one sender; stand-in link: host-to-device "
          "copies from pinned memory")  # fmt: skip
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


if __name__ == "__main__":
    main()
