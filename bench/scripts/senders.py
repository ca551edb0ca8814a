"""Many senders on one GPU: one trainer rank's pipeline (convert its own experts and the entries
it owns, pack its segments, send them) through the one-GPU stand-in link, against its link time
alone (the same messages, device-to-host into pinned memory) and its conversion alone; its
peak memory against the transfer plan's prediction; and its bytes against the reference.

    python3 bench/scripts/senders.py [--layers 16] [--senders 32] [--engines 4] [--tp 8] [--ep]
                                     [--sender 0 ...] [--gc freeze] [--repeats 5]

GLM-5 sparse layers from bf16 (Gaussian x 0.02); one layer's tensors are reused for every layer
(each layer is still converted and sent). The sender is link rank ``t`` of ``--senders`` trainer
ranks (it leads, as the stand-in has no peers); it reads the full expert stacks as plain tensors
and uses its own experts in place, so it gathers nothing: its prediction is the plan's ring of
one conversion slot and one send slot, twice.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import defaultdict

import torch
from tabulate import tabulate

from glm_fp8.bench import wall_seconds
from glm_fp8.engine import EngineLayout, take_shard
from glm_fp8.models import PRESETS
from glm_fp8.plan import layer_prefix, plan_from_config, strip_layer
from glm_fp8.reference import convert_layer_ref
from glm_fp8.transfer import Broadcaster, HostSinkComm
from glm_fp8.transfer.gather import collect_own


class _KeepFirst(HostSinkComm):
    """Keeps a host copy of the first ``n`` messages only (layer 0's), so that a whole model's
    count of layers does not fill the host with pinned copies."""

    def __init__(self, rank: int, n: int):
        super().__init__(keep=True, rank=rank)
        self.n = n

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.keep = len(self.sent) < self.n
        super().broadcast(tensor, src)


class _GcPauses:
    """Time spent in Python's garbage collector, by generation, while it is installed."""

    def __init__(self):
        self.seconds: dict[int, list[float]] = defaultdict(list)
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds[info["generation"]].append(time.perf_counter() - self._t0)

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)

    def summary(self) -> str:
        return " ".join(f"g{g}: {len(v)}x {1e3 * sum(v):.1f}" for g, v in sorted(self.seconds.items()))


def _phase_timers(sender: Broadcaster, names: tuple[str, ...]) -> dict[str, list[float]]:
    """Wrap the sender's methods ``names`` with host timers (seconds of each call)."""
    times: dict[str, list[float]] = defaultdict(list)
    for name in names:
        fn = getattr(sender, name)

        def timed(*a, _fn=fn, _name=name, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                times[_name].append(time.perf_counter() - t0)

        setattr(sender, name, timed)
    return times


def _check_bytes(sender: Broadcaster, sink: HostSinkComm, layer: dict) -> tuple[int, int]:
    """Every message of the first layer against the reference conversion cut by each piece's
    shard and experts: (bytes checked, bytes that differ)."""
    routes = sender.routes.layers[0]
    plan = sender.plans[0]
    ref = convert_layer_ref({k.removeprefix(layer_prefix(0)): t for k, t in layer.items()}, 0, plan)
    checked = differ = 0
    msgs = iter(sink.sent[3:])  # after the prelude, the manifest and layer 0's header
    for seg in routes.of_sender(sender.me):
        for _ in routes.classes[seg.cls]:
            got = next(msgs).to(sender.device)
            for p in seg.pieces:
                full = ref[p.name]
                if p.rows is not None:
                    full = full.narrow(0, p.rows[0], p.rows[1] - p.rows[0])
                want = take_shard(full, p.shard).contiguous().view(torch.uint8).flatten()
                have = p.view(got).contiguous().view(torch.uint8).flatten()
                checked += want.numel()
                differ += int((want != have).sum())
    return checked, differ


def _measure(t: int, n: int, config: dict, engines: list, n_senders: int, kind: str, layer: dict,
             stream, gc_mode: str, repeats: int) -> list:  # fmt: skip
    """One sender's row: its pipeline, link alone, conversion alone, memory, bytes checked; the
    pipeline and the link alone timed ``repeats`` times, alternately, the median ratio's run
    shown (and every ratio's range)."""
    torch.cuda.empty_cache()
    check_sink = _KeepFirst(t, 3 + 4 * n_senders)  # the prelude, manifest, header; layer 0
    kw = dict(config=config, engines=engines, senders=range(n_senders), device="cuda")
    checker = Broadcaster(check_sink, t, **kw)
    checker.broadcast_model(stream())
    checked, differ = _check_bytes(checker, check_sink, layer)
    del checker, check_sink
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()  # the inputs
    sink = HostSinkComm(rank=t)
    sender = Broadcaster(sink, t, **kw)
    sender.broadcast_model(stream())  # warm-up; pins the sink's buffers
    if gc_mode == "freeze":
        gc.collect()
        gc.freeze()
    phases = _phase_timers(sender, ("_next_item", "_convert_own", "_post_step", "_settle_step"))
    routes = sender.routes.layers
    me = sender.me
    msgs = [[(sender.pack_ring.slots[0][s.send_offset : s.send_offset + s.nbytes], r)
             for s in lay.of_sender(me) for r in lay.classes[s.cls]] for lay in routes]  # fmt: skip
    runs = []  # (update stats, link alone s), interleaved so that both see the same clocks
    peak = 0
    for _ in range(repeats):
        for ts in phases.values():
            ts.clear()
        with _GcPauses() as pauses:
            stats = sender.broadcast_model(stream())  # resets the peak first
        peak = max(peak, torch.cuda.max_memory_allocated() - base)  # its rings and everything transient
        runs.append((stats, wall_seconds(lambda: [sink.exchange(m, []) for m in msgs])))
    if gc_mode == "freeze":
        gc.unfreeze()
    ratios = sorted(st.seconds / link for st, link in runs)
    stats, t_link = sorted(runs, key=lambda r: r[0].seconds / r[1])[len(runs) // 2]  # the median run
    steps = [s.seconds for s in stats.layers]
    worst = sorted(range(len(steps)), key=steps.__getitem__)[-3:][::-1]
    print(
        f"sender {t}: gc during the update: {pauses.summary() or 'none'}; slowest steps: "
        + ", ".join(f"#{i} {1e3 * steps[i]:.1f} ms" for i in worst)
    )
    for name, ts in phases.items():
        i = max(range(len(ts)), key=ts.__getitem__)
        print(
            f"  {name:17s} calls {len(ts):3d}  sum {1e3 * sum(ts):8.1f} ms  "
            f"max {1e3 * ts[i]:6.2f} ms (call {i})"
        )
    local_buf, send_buf = sender.ring.slots[0], sender.pack_ring.slots[0]

    def convert_only():
        for pos, (i, sd) in enumerate(stream()):
            lay = routes[pos]
            views = collect_own(lay, me, sender.plans[pos], strip_layer(sd, i), local_buf,
                                senders=sender.senders_global, gather_dtype=torch.bfloat16,
                                device=sender.device)  # fmt: skip
            for seg in lay.of_sender(me):
                seg.pack_into(views, send_buf[seg.send_offset : seg.send_offset + seg.nbytes], lay.starts(me))

    convert_only()  # warm-up: the first call in a process can compile
    t_convert = wall_seconds(convert_only)
    local, send = sender.routes.sender_buffers(me)
    predicted = 2 * (local + send)  # ring of 2; plain inputs: nothing gathered
    sent = sum(m.nbytes for ms in msgs for m, _ in ms)
    owned = sum(1 for lay in routes for o in lay.owners.values() if o == me)
    return [kind, t, owned, f"{sent / n / 2**30:.3f}", sum(len(m) for m in msgs) // n,
            f"{stats.seconds:.3f}", f"{t_link:.3f}", f"{t_convert:.3f}",
            f"{stats.seconds / t_link:.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})",
            f"{sent / t_link / 1e9:.1f}", f"{peak / 2**30:.3f}", f"{predicted / 2**30:.3f}",
            f"{peak / predicted:.3f}", f"{checked}/{differ}",
            f"{1e3 * sorted(s.seconds for s in stats.layers)[len(stats.layers) // 2]:.1f}",
            f"{1e3 * max(s.seconds for s in stats.layers):.1f}",
            f"{1e3 * (stats.seconds - sum(s.seconds for s in stats.layers)):.1f}",
            " ".join(f"{1e3 * s.seconds:.1f}" for s in stats.layers[:3]) + " .. "
            + " ".join(f"{1e3 * s.seconds:.1f}" for s in stats.layers[-2:])]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--senders", type=int, default=32)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--ep", action="store_true")
    p.add_argument("--sender", type=int, nargs="+", default=[0, 1])
    p.add_argument("--repeats", type=int, default=5, help="updates timed, each beside a link-alone timing")
    p.add_argument(
        "--gc",
        choices=("on", "freeze"),
        default="on",
        help="freeze: gc.freeze() after the warm-up (the collector skips what exists then)",
    )
    args = p.parse_args()
    n = args.layers
    config = {**PRESETS["glm-5"], "num_hidden_layers": n, "first_k_dense_replace": 0,
              "num_nextn_predict_layers": 0}  # fmt: skip
    plan = plan_from_config(config, 0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = {
        layer_prefix(0) + k: torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        for k, (shape, _) in plan.inputs.items()
    }
    stream = lambda: (  # noqa: E731
        (i, {k.replace("layers.0.", f"layers.{i}."): t for k, t in layer.items()}) for i in range(n)
    )
    engines = [None] * args.senders + EngineLayout.all_ranks(args.tp, 1, args.ep) * args.engines
    kind = f"{args.engines} x {'EP' if args.ep else 'TP'}{args.tp}"
    rows = [_measure(t, n, config, engines, args.senders, kind, layer, stream, args.gc, args.repeats)
            for t in args.sender]  # fmt: skip
    print(f"{n} GLM-5 sparse layers, {args.senders} senders into {kind}; stand-in link: D2H, pinned memory")
    print(tabulate(rows, ["engines", "sender", "entries owned", "sent GiB/layer", "messages/layer", "total s",
                          "link alone s", "convert+pack alone s", "total / link (median, range)", "link GB/s",
                          "peak GiB", "predicted GiB", "peak / predicted", "layer-0 bytes checked/differ",
                          "step ms (median)", "step ms (max)", "outside steps ms",
                          "steps ms (first 3 .. last 2)"]))  # fmt: skip


if __name__ == "__main__":
    main()
