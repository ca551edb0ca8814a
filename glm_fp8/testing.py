"""What tests, the demo and the benchmarks share: a multi-process launcher (gloo or NCCL, one
process per rank, bounded in time), deterministic synthetic trainer layers (plain or as
FSDP2-style DTensors) and the reference of what an engine rank must hold after an update. The
small model configs live in ``glm_fp8.model.families`` (``SMALL_GLM5``, ``SMALL_CONFIGS``)."""

from __future__ import annotations

import random
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta

import torch

from glm_fp8.engine.layout import EngineLayout, take_shard
from glm_fp8.engine.specs import engine_params
from glm_fp8.kernels.reference import convert_layer_ref, quantize_blockwise_ref
from glm_fp8.model.config import FAMILY_TRAITS, as_config
from glm_fp8.model.families import (
    EXPERT,
    PRIME_RL,
    REST,
    TRAINER_LAYOUTS,
    expert_sources,
    is_sparse_layer,
    layer_shapes,
    model_layer_ids,
)
from glm_fp8.model.indexer import has_indexer, indexer_shapes
from glm_fp8.model.plans import plan_from_config
from glm_fp8.model.trainer_layouts import LAYOUTS, layer_prefix, strip_layer

_BIAS = "mlp.gate.e_score_correction_bias"


def synthetic_layer(
    config: object,
    layer_idx: int,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = PRIME_RL,
    bias_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Deterministic trainer tensors of one layer (prefixed names), the same in every process
    and, value for value, in every trainer ``layout`` (docs/trainers.md#trainer-layouts):
    "prime_rl" stacks, "hf" (transformers' modules) or "hf_checkpoint" (per-expert names), so
    that one reference serves them all. Every tensor is in ``dtype``, the routing bias in
    ``bias_dtype`` (default: float32 for the Hugging Face layouts, whose router keeps it so,
    ``dtype`` for prime-rl's). As trainers hold them, a sparse layer of a family with a routing
    bias has one whatever the config's ``topk_method``, and a Hugging Face layer has an indexer
    on every layer of an indexer family, the layers the schedule shares included (as some
    transformers versions build it): the converter leaves those out."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    c = as_config(config)
    gen = torch.Generator().manual_seed(1000 + layer_idx)
    shapes = layer_shapes(c, layer_idx)
    traits = FAMILY_TRAITS[c["model_type"]]
    decoder = layer_idx != REST and layer_idx < c["num_hidden_layers"]
    if layer_idx != REST and is_sparse_layer(c, layer_idx) and traits.routing_bias:
        shapes.setdefault("mlp.expert_bias", (c[traits.experts],))
    if layout != PRIME_RL and decoder and traits.indexer and not has_indexer(c, layer_idx):
        shapes.update(indexer_shapes(c))
    values = {k: torch.randn(shape, generator=gen) * 0.02 for k, shape in shapes.items()}
    if layout != PRIME_RL:
        values = _in_layout(values, layout)
    bias = TRAINER_LAYOUTS[layout][_BIAS][0]
    bias_dtype = bias_dtype or (dtype if layout == PRIME_RL else torch.float32)
    prefix = layer_prefix(layer_idx)
    return {prefix + k: v.to(bias_dtype if k == bias else dtype) for k, v in values.items()}


def _in_layout(values: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """prime-rl's tensors under ``layout``'s names: each entry's rows split among its sources."""
    out = dict(values)
    for entry, ours in TRAINER_LAYOUTS[PRIME_RL].items():
        if not all(s in out for s in ours):
            continue
        parts = [out.pop(s) for s in ours]
        if entry.startswith("mlp.shared_experts."):
            parts = [p[0] if p.dim() == 3 and p.shape[0] == 1 else p for p in parts]  # prime-rl's [1, I, H]
        whole = torch.cat(parts, dim=-2 if parts[0].dim() >= 2 else 0)
        theirs = TRAINER_LAYOUTS[layout][entry]
        if any(EXPERT in s for s in theirs):
            for j in range(whole.shape[0]):
                out.update(zip(expert_sources(theirs, j), whole[j].chunk(len(theirs), dim=-2)))
        else:
            out.update(zip(theirs, whole.chunk(len(theirs), dim=-2 if whole.dim() >= 2 else 0)))
    return out


def sharded_layer(
    config: object, layer_idx: int, mesh, dtype: torch.dtype = torch.bfloat16, layout: str = PRIME_RL
) -> dict[str, torch.Tensor]:
    """``synthetic_layer`` as FSDP2 holds it on a 1-D ``mesh``: every tensor of two or more dims
    ``Shard(0)`` (an expert stack so holds whole experts), 1-D tensors replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {
        k: distribute_tensor(t, mesh, [Shard(0) if t.dim() >= 2 else Replicate()])
        for k, t in synthetic_layer(config, layer_idx, dtype, layout).items()
    }


def moved_layer(
    config: object, layer_idx: int, step: int, dtype: torch.dtype = torch.bfloat16, layout: str = PRIME_RL
) -> dict[str, torch.Tensor]:
    """``synthetic_layer`` at a trainer step (the delta tests): 0.2 % of each tensor's elements (a
    set drawn per ``step``) scaled by 0.7, which changes their fp8 bytes and rarely a block's
    scale; the MTP layer's ``shared_head.head`` is that step's ``lm_head``, tied as trainers hold
    them (vLLM's drafter holds the target's ``lm_head`` there)."""
    sd = synthetic_layer(config, layer_idx, dtype, layout)
    g = torch.Generator().manual_seed(1000 * step + (layer_idx if layer_idx != REST else 999))
    for t in sd.values():
        flat = t.view(-1)
        idx = torch.randint(flat.numel(), (max(1, flat.numel() // 500),), generator=g)
        flat[idx] = flat[idx] * 0.7
    head = f"{layer_prefix(layer_idx)}shared_head.head.weight"
    if head in sd:
        sd[head] = moved_layer(config, REST, step, dtype, layout)["lm_head.weight"]
    return sd


# Checkpoint tensors stored in block FP8 (the rest travel in their own dtype), as GLM-5's FP8
# checkpoint holds them (docs/layouts.md#glm-5-layer-map).
FP8_IN_CHECKPOINT = (
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "q_b_proj",
    "kv_b_proj",
    "o_proj",
    "wq_b",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def block_fp8_checkpoint(
    config: object,
    dtype: torch.dtype = torch.bfloat16,
    weights: Callable[[int], Mapping[str, torch.Tensor]] | None = None,
    fp8: tuple[str, ...] = FP8_IN_CHECKPOINT,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model as a block-FP8 checkpoint holds it, for an engine's own ``load_weights``: the same
    values a trainer source sends (``synthetic_layer``, or ``weights(layer_idx)`` in Hugging Face's
    module names: a trainer's step), under Hugging Face's per-expert names, each FP8 weight
    quantized alone by glm_fp8's reference, its scales beside it as ``weight_scale_inv``; the MTP
    layer under ``model.layers.{num_hidden_layers}``; ``fp8``: the module names stored in block FP8.
    The expected side of an engine test: nothing in it goes through glm_fp8's transfer."""
    c = as_config(config)
    for i in [*model_layer_ids(c), REST]:
        layer = _per_expert(weights(i)) if weights else synthetic_layer(c, i, dtype, "hf_checkpoint")
        for name, t in layer.items():
            short = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
            if short in fp8 and t.dim() == 2:
                q, s = quantize_blockwise_ref(t)
                yield name, q
                yield name.removesuffix("weight") + "weight_scale_inv", s
            else:
                yield name, t


def _per_expert(layer: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer in Hugging Face's module names (stacked ``experts.gate_up_proj`` [E, 2I, H] and
    ``experts.down_proj`` [E, H, I]) under a checkpoint's per-expert names, value for value as
    ``synthetic_layer``'s "hf_checkpoint" layout splits them."""
    out = {}
    for name, t in layer.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            for j, w in enumerate(t):
                at = name.removesuffix("gate_up_proj") + f"{j}."
                out[at + "gate_proj.weight"], out[at + "up_proj.weight"] = w.chunk(2, dim=0)
        elif name.endswith(".mlp.experts.down_proj"):
            for j, w in enumerate(t):
                out[name.removesuffix("down_proj") + f"{j}.down_proj.weight"] = w
        else:
            out[name] = t
    return out


def poisoned_engine_params(config: object, layout: EngineLayout, fill: int = 0xFF) -> dict[str, torch.Tensor]:
    """An engine rank's parameters at ``layout`` (``engine_params``: names, shapes, dtypes), every
    byte ``fill`` (0xFF: NaN in every float dtype), so that a byte no update wrote shows."""
    params = {}
    for name, p in engine_params(as_config(config), layout).items():
        params[name] = torch.empty(p.shape, dtype=p.dtype)
        params[name].view(torch.uint8).fill_(fill)
    return params


def reference_engine_params(
    config: object,
    layout: EngineLayout,
    layer_ids,
    *,
    scale_fmt: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    bias_dtype: torch.dtype | None = None,
    gathered_dtype: torch.dtype | None = None,
    layer: Callable[[int], dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """What an engine rank at ``layout`` must hold after an update of ``layer_ids`` (``REST``
    included when listed) from ``synthetic_layer`` tensors of ``dtype`` (the routing bias of
    ``bias_dtype``; every trainer layout holds the same values), or from ``layer(i)`` (e.g.
    ``moved_layer``): the reference conversion
    (``glm_fp8.kernels.reference``) cut by the rank's shard, in vLLM's dtype, by vLLM's name. Tensors
    the engine has no parameter for are left out, as the converter does.

    Every tensor is read in the trainer's own dtype, never cast first: what every mode of an
    update with the default ``gather_dtype=None`` must land (docs/numerics.md#inputs).
    ``gathered_dtype`` models the explicit ``gather_dtype`` opt-in only, never the default: the
    sources of quantized entries other than the routed-expert stacks are cast to it (what a
    sharded layer's gathers then carry, while each rank quantizes the experts it holds in their
    own dtype: many senders, ``gather="quantize_then_gather"``)."""
    c = as_config(config)
    targets = {p.kernel_name: p for p in engine_params(c, layout).values()}
    out = {}
    for i in layer_ids:
        plan = plan_from_config(c, i, scale_fmt=scale_fmt, indexer_form=layout.indexer_form(c))
        sd = synthetic_layer(c, i, dtype, bias_dtype=bias_dtype) if layer is None else layer(i)
        sd = {k: t for k, t in strip_layer(sd, i).items() if k in plan.inputs}
        if gathered_dtype is not None:
            for e in plan.entries:
                if e.op == "quantize" and len(e.shape) != 3:
                    sd.update({s: sd[s].to(gathered_dtype) for s in e.sources})
        for kernel_name, full in convert_layer_ref(sd, i, plan).items():
            if not layout.holds(c, kernel_name):  # e.g. an SGLang rank's MTP layer: its drafter's
                continue
            t = targets[kernel_name]
            out[t.name] = take_shard(full, t.shard).to(t.dtype)
    return out


def sent_layer_mismatches(
    lay, me: int, msgs: Iterator[torch.Tensor], ref: Mapping[str, torch.Tensor]
) -> tuple[int, int, list[str]]:
    """Read from ``msgs`` the segments sender ``me`` put on the link for one layer (``lay``: the
    layer's ``LayerRoutes``; a segment once per group broadcast, else once per receiving rank, in
    the order the sender posts them: group broadcasts, then point-to-point messages; its header
    already read) and compare every piece with ``ref`` (the reference conversion of the layer, by
    prefixed name) cut by the piece's rows and shard, on the CPU. Returns (bytes checked, bytes
    that differ, the names of the pieces that differ)."""
    checked = differ = 0
    bad: list[str] = []
    mine = lay.of_sender(me)
    # in the order the sender posts them: its group broadcasts, then its point-to-point messages
    for seg in [s for s in mine if s.group is not None] + [s for s in mine if s.group is None]:
        for _ in range(lay.messages(seg)):
            got = next(msgs)
            pairs = []
            for p in seg.pieces:
                full = ref[p.name]
                if p.rows is not None:
                    full = full.narrow(0, p.rows[0], p.rows[1] - p.rows[0])
                pairs.append((p.name, take_shard(full, p.shard), p.view(got)))
            for name, want, have in pairs:
                want, have = (x.cpu().contiguous().view(torch.uint8).flatten() for x in (want, have))
                checked += want.numel()
                n = int((want != have).sum())
                differ += n
                bad += [name] if n else []
    return checked, differ, bad


# Ports are drawn below the kernel's ephemeral range (Linux's default 32768-60999): the OS never
# hands those out as the local end of a connection or to a listener bound to port 0 (gloo's
# full-mesh listeners, a client's socket), so a port drawn here cannot be taken between the draw
# and the store that listens on it, which a port the OS chose (bind to 0) can.
_PORT_RANGE = (20000, 32768)


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Every port this process has handed out: never handed out again, so that a test's own ports and
# its launcher's (``launch`` draws one after the test drew its own, all free at their draw) cannot
# be the same port, and a port whose last store may still linger is not reused.
_HANDED: set[int] = set()


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now, for rendezvous addresses: drawn at random
    below the ephemeral range (no listener of another process group's mesh or client socket is
    given one by the OS meanwhile), none handed out before by this process."""
    low, high = _PORT_RANGE[0], min(_PORT_RANGE[1], _ephemeral_floor())
    rng = random.SystemRandom()
    out: list[int] = []
    for _ in range(200 * max(n, 1)):
        if len(out) == n:
            break
        port = rng.randrange(low, high)
        if port in out or port in _HANDED:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
    if len(out) == n:
        _HANDED.update(out)
        return out
    raise RuntimeError(f"free_ports: found {len(out)} of {n} free ports in [{low}, {high})")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous address), as ``free_ports`` draws them."""
    return free_ports(1)[0]


def _worker(rank, world, port, backend, timeout_s, fn, args, queue):
    import torch.distributed as dist

    store = None
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        _all_joined(store, rank, world, timeout)
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        queue.put((rank, type(exc).__name__, f"{exc}\n{traceback.format_exc(limit=3)}"))
    finally:
        if store is not None:
            _leave_last(store, rank, world)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a dead peer can make this fail too
                pass


def _all_joined(store, rank: int, world: int, timeout: timedelta) -> None:
    """Return once every rank's ``init_process_group`` has returned. A rank returns from gloo's
    full-mesh connection as soon as its own side of every pair is up, while a peer may still be
    reading the handshake on its side; a rank that then went straight on to close the group (a
    test that destroys the launcher's world to build its own) failed that peer's connection
    ("Gloo connectFullMesh failed ... Connection closed by peer", about 1 start in 30 of 14
    ranks on two cores)."""
    store.set(f"glm_fp8/testing/joined/{rank}", "1")
    store.wait([f"glm_fp8/testing/joined/{r}" for r in range(world)], timeout)


# How long rank 0 waits for the other ranks to finish before its process ends.
LEAVE_WAIT_S = 10.0


def _leave_last(store, rank: int, world: int) -> None:
    """Rank 0's process serves the launcher's store (the default group's, unless the test built its
    own), where every link over that group beats (``glm_fp8.transfer.liveness``): it ends only after
    every other rank finished (or after ``LEAVE_WAIT_S``, for a rank that died), so that a rank still
    reading the outcome of a failed update is not told "rank 0 is lost" by the store going away."""
    try:
        store.add("glm_fp8/testing/done", 1)
        if rank != 0:
            return
        deadline = time.monotonic() + LEAVE_WAIT_S
        while store.add("glm_fp8/testing/done", 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - a store that is gone already: nothing to wait for
        pass


def launch(
    world: int, fn: Callable, args: tuple = (), *, backend: str = "gloo", timeout_s: float = 30.0
) -> dict[int, tuple[str, object]]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; ``{rank: (status, result)}``.

    status is "ok" or the exception's class name. A rank that reports nothing within
    ``timeout_s`` plus a margin is killed and reported as "killed": nothing waits forever.
    """
    import torch.multiprocessing as mp

    # forkserver, not spawn: each rank forks from one server that imported torch and glm_fp8 once,
    # instead of importing them anew (seconds of CPU per rank: most of a small test's time). The
    # server never runs an op, so no thread pool or CUDA context is forked.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "glm_fp8.transfer", "glm_fp8.testing"])
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, backend, timeout_s, fn, args, queue), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout_s + 60
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, status, result = queue.get(timeout=1.0)
            results[rank] = (status, result)
        except Exception:  # noqa: BLE001 - queue.Empty: check for dead processes
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
            if dead and all(not p.is_alive() for p in procs):
                break
    for r, p in enumerate(procs):
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
        results.setdefault(r, ("killed" if p.exitcode is None else f"exit {p.exitcode}", None))
    return results
