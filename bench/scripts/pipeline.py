"""One sending trainer rank's pipeline through the one-GPU stand-in link, in every mode of the one
transfer protocol: the whole update against the same messages sent alone (the link's time) and
against its conversion alone; its peak memory against the transfer plan's; its first layer's
bytes against the reference.

    python3 bench/scripts/pipeline.py --mode broadcast|scatter|senders [--layers 80] [--tp 8] [--ep]
        [--engines 1] [--servers 2xEP8 2xTP8] [--senders 32] [--sender 0 1] [--master bf16 fp32]
        [--repeats 3] [--ring 2]

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
``--device cpu --model tiny`` runs a small model on the CPU (a check of the script, no figures).
"""

from __future__ import annotations

import argparse
import gc
import re
import time

import torch
from tabulate import tabulate

from glm_fp8.engine import EngineLayout
from glm_fp8.models import PRESETS, TINY_GLM5
from glm_fp8.plan import layer_prefix, plan_from_config, strip_layer
from glm_fp8.reference import convert_layer_ref
from glm_fp8.testing import sent_layer_mismatches
from glm_fp8.transfer import HostSinkComm, Sender
from glm_fp8.transfer.gather import trainer_view
from glm_fp8.transfer.pack import update_regions


class Recorder(HostSinkComm):
    """The stand-in link, which also remembers every message of the current update (for the
    link-alone replay) and keeps host copies of the first ``keep_first`` (for the byte check)."""

    def __init__(self, rank: int, size: int, keep_first: int = 0):
        super().__init__(rank=rank, size=size)
        self.keep_first, self.log, self.kept = keep_first, [], []

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.log.append(tensor)
        if len(self.kept) < self.keep_first:
            self.kept.append(tensor.to("cpu", copy=True))
        super().broadcast(tensor, src)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _check_first_layer(sender: Sender, kept: list, layer: dict) -> tuple[int, int]:
    """Layer 0's messages (after the prelude, the manifest and its header) against the reference
    conversion cut by each piece's shard and rows: (bytes checked, bytes that differ)."""
    lay, plan = sender.routes.layers[0], sender.plans[0]
    # The reference on the layer's device (bit-exact there as on the CPU, and far faster).
    ref = convert_layer_ref({k.removeprefix(layer_prefix(0)): t for k, t in layer.items()}, 0, plan)
    checked, differ, _ = sent_layer_mismatches(lay, sender.me, iter(kept[3:]), ref, plan, 0)
    return checked, differ


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
    return " + ".join(f"{n} x {'EP' if ep else 'TP'}{tp}{f' x DP{dp}' if dp > 1 else ''}"
                      for n, tp, dp, ep in args.servers)  # fmt: skip


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


def measure(args, master: torch.dtype, t: int) -> list:
    device = torch.device(args.device)
    gc.collect()  # what an earlier row left must not count in this one's memory
    n = args.layers
    base_cfg = TINY_GLM5 if args.model == "tiny" else PRESETS["glm-5"]
    config = {**base_cfg, "num_hidden_layers": n, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0}
    plan = plan_from_config(config, 0)
    gen = torch.Generator(device=device).manual_seed(0)
    layer = {layer_prefix(0) + k: torch.randn(shape, device=device, generator=gen, dtype=master).mul_(0.02)
             for k, (shape, _) in plan.inputs.items()}  # fmt: skip
    stream = lambda: ((i, {k.replace("layers.0.", f"layers.{i}."): x for k, x in layer.items()})  # noqa: E731
                      for i in range(n))  # fmt: skip
    layouts = fleet_layouts(args)
    kw = dict(config=config, device=device, ring=args.ring, checksum=not args.no_checksum)
    if args.mode == "broadcast":
        size, src = 2, 0
    elif args.mode == "scatter":
        kw["engines"], size, src = [None, *layouts], 1 + len(layouts), 0
    else:
        kw["engines"] = [None] * args.senders + layouts
        kw["senders"], size, src = list(range(args.senders)), args.senders + len(layouts), t
    if device.type == "cuda":
        torch.cuda.empty_cache()
    inputs = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    link = Recorder(src, size)
    sender = Sender(link, src, **kw)
    lay0 = sender.routes.layers[0]  # keep the prelude, the manifest, layer 0's header and messages
    link.keep_first = 3 + sum(lay0.messages(s) for s in lay0.of_sender(sender.me))
    sender.send_model(stream())  # warm-up (compiles); keeps layer 0's messages for the check
    checked, differ = _check_first_layer(sender, link.kept, layer) if args.check else (0, 0)
    link.kept, link.keep_first = [], 0
    runs = []
    for _ in range(args.repeats):  # the update and the link alone, interleaved: the same clocks
        link.log = []
        stats = sender.send_model(stream())
        msgs = list(link.log)
        t_link = _seconds(lambda: [HostSinkComm.broadcast(link, m, src) for m in msgs], device)
        runs.append((stats, t_link, sum(m.nbytes for m in msgs)))
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
    sender.conv_ring = sender.send_ring = None  # free the rings before the next row
    return [args.mode, str(master).removeprefix("torch."), t, f"{nbytes / n / 2**30:.3f}",
            f"{stats.seconds:.3f}", f"{t_link:.3f}", f"{t_convert:.3f}",
            f"{stats.seconds / t_link:.4f} ({ratios[0]:.4f}-{ratios[-1]:.4f})",
            f"{nbytes / t_link / 1e9:.1f}", f"{peak / 2**30:.3f}", f"{predicted / 2**30:.3f}",
            f"{peak / predicted:.3f}", f"{wire / 2**30:.3f}" if wire else "-",
            f"{nbytes / wire:.5f}" if wire else "-", f"{checked}/{differ}",
            f"{1e3 * steps[len(steps) // 2]:.1f}", f"{1e3 * steps[-1]:.1f}"]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("broadcast", "scatter", "senders"), default="broadcast")
    p.add_argument("--layers", type=int, default=80, help="GLM-5 sparse layers in the update (default 80)")
    p.add_argument("--tp", type=int, default=8, help="engine tensor-parallel size (default 8)")
    p.add_argument("--ep", action="store_true", help="engines use expert parallelism")
    p.add_argument("--engines", type=int, default=1, help="engine replicas (default 1)")
    p.add_argument("--servers", nargs="+", type=parse_server, default=None,
                   help="a fleet instead of --engines: [Nx]TP<t>[xDP<d>] or [Nx]EP<t>[xDP<d>], "
                   "one per server")  # fmt: skip
    p.add_argument("--senders", type=int, default=32, help="trainer ranks, --mode senders (default 32)")
    p.add_argument("--sender", type=int, nargs="+", default=[0], help="the link ranks measured (default 0)")
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
    p.add_argument("--device", default="cuda", help="default cuda; cpu checks the script")
    p.add_argument("--model", choices=("glm-5", "tiny"), default="glm-5")
    args = p.parse_args()
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    senders = args.sender if args.mode == "senders" else [0]
    rows = [measure(args, dtypes[m], t) for m in args.master for t in senders]
    engines = fleet_name(args)
    what = {"broadcast": "one sender, one full receiver", "scatter": f"one sender into {engines}",
            "senders": f"{args.senders} senders into {engines}"}[args.mode]  # fmt: skip
    print(f"{args.layers} {args.model} sparse layers, {what}, ring {args.ring}, checksum "
          f"{not args.no_checksum}; stand-in link: device-to-host copies into pinned memory")  # fmt: skip
    print(tabulate(rows, ["mode", "master", "sender", "sent GiB/layer", "total s", "link alone s",
                          "convert+pack alone s", "total / link (median, range)", "link GB/s", "peak GiB",
                          "predicted GiB", "peak / predicted", "wire GiB predicted",
                          "wire measured / predicted", "layer-0 bytes checked/differ",
                          "step ms (median)", "step ms (max)"]))  # fmt: skip


if __name__ == "__main__":
    main()
