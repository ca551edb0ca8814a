"""A Megatron-Core trainer sends through glm_fp8: four trainer ranks hold a tiny GLM-5 that
Megatron-Core built over TP 2 x EP 2 (DP 2); the ranks of expert-data-parallel rank 0 each send
their own share (their experts, their part of the rest: no gather onto one rank, no Hugging Face
names in between) to the two ranks of a vLLM server at TP 2, which land their shards. Runs on a
CPU over gloo, in a venv with Megatron-Core 0.19:

    bash scripts/install_vllm_cpu.sh && bash scripts/install_megatron_cpu.sh   # .venv-vllm
    .venv-vllm/bin/python examples/megatron_update.py     # a few minutes (Triton's interpreter)

On a GPU cluster the trainer passes its own model (Transformer Engine's modules included) and
the link runs over NCCL; the calls are the same. Every engine parameter starts as NaN bytes and
must hold finite values after the update.
"""

import importlib.util
import json
import os
import sys
import time
from datetime import timedelta

os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU: the Triton kernels run on the CPU

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm_fp8 import EngineLayout, Receiver, Sender
from glm_fp8.model import TINY_GLM5
from glm_fp8.testing import free_ports, poisoned_engine_params
from glm_fp8.transfer.link import StoreLink

CONFIG = TINY_GLM5
TRAINERS = 4  # Megatron's world: TP 2 x EP 2, so DP 2 (two replicas of the attention)
ENGINE = EngineLayout.all_ranks(tp_size=2)  # the vLLM server's ranks


def leave(store: dist.TCPStore, serves: bool) -> None:
    """Trainer rank 0 serves the stores (the plan's here, the link's heartbeats): it ends last, once
    every rank has left the link, so that no rank's link loses its store while it closes."""
    store.add("left", 1)
    while serves and store.add("left", 0) < TRAINERS + len(ENGINE):
        time.sleep(0.05)


def trainer(rank: int, ports: list[int]) -> None:
    from glm_fp8.integrations.megatron import MegatronSource
    from glm_fp8.integrations.megatron_cpu import tiny_glm5_gpt_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=TRAINERS)
    model = tiny_glm5_gpt_model(CONFIG, tp=2, ep=2)  # on a GPU: the trainer's own model
    source = MegatronSource(model, CONFIG)  # every trainer rank: collective over the default group
    store = dist.TCPStore("127.0.0.1", ports[1], TRAINERS + len(ENGINE), rank == 0, timedelta(seconds=300))
    if rank == 0:  # what the engine ranks must agree on (vLLM's backend carries it in its init info)
        plan = {
            "senders": source.senders,
            "layer_ids": source.layer_ids,
            "holders": list(source.holders.items()),
        }
        store.set("plan", json.dumps(plan))
    if not source.is_sender:  # a DP replica: its part of its TP group's gathers, nothing to send
        list(source.layers()), source.rest()
        print(f"trainer rank {rank}: a replica, sends nothing")
        leave(store, rank == 0)
        return
    n = len(source.senders)
    link = StoreLink(
        "127.0.0.1",
        ports[2],
        source.link_rank,
        n + len(ENGINE),
        backend="gloo",  # "nccl" on GPUs
        timeout=timedelta(seconds=300),
        global_ranks=source.senders,  # the senders' trainer ranks, where their TP groups' tensors live
    )
    sender = Sender(
        link,
        0,
        config=CONFIG,
        layer_ids=source.layer_ids,
        rest=True,
        device="cpu",
        engines=[None] * n + ENGINE,
        senders=list(range(n)),
        holders=source.holders,
    )
    stats = sender.send_model(source.layers(), rest=source.rest())
    print(f"trainer rank {rank}: sender {source.link_rank} of {n}, sent {stats.nbytes / 2**20:.2f} MiB")
    link.close()
    leave(store, rank == 0)


def engine(k: int, ports: list[int]) -> None:
    store = dist.TCPStore("127.0.0.1", ports[1], TRAINERS + len(ENGINE), False, timedelta(seconds=300))
    plan = json.loads(store.get("plan"))
    senders, holders = plan["senders"], {int(i): h for i, h in plan["holders"]}
    n = len(senders)
    link = StoreLink(
        "127.0.0.1", ports[2], n + k, n + len(ENGINE), backend="gloo", timeout=timedelta(seconds=300)
    )
    layout = ENGINE[k]
    params = poisoned_engine_params(CONFIG, layout)  # the engine's tensors, NaN bytes until written
    receiver = Receiver(
        link,
        0,
        config=CONFIG,
        layer_ids=plan["layer_ids"],
        rest=True,
        device="cpu",
        engines=[None] * n + ENGINE,
        senders=list(range(n)),
        holders=holders,
        layout=layout,
    )
    stats = receiver.load_into(params)
    unwritten = [name for name, t in params.items() if torch.isnan(t.float()).any()]
    print(
        f"engine rank {k} (TP rank {layout.tp_rank}): received {stats.nbytes / 2**20:.2f} MiB into "
        f"{len(params)} parameters; unwritten: {unwritten or 'none'}"
    )
    link.close()
    leave(store, False)
    assert not unwritten


def rank_main(rank: int, ports: list[int]) -> None:
    if rank < TRAINERS:
        trainer(rank, ports)
    else:
        engine(rank - TRAINERS, ports)


if __name__ == "__main__":
    if importlib.util.find_spec("megatron") is None:
        sys.exit("examples/megatron_update.py needs Megatron-Core: bash scripts/install_megatron_cpu.sh")
    mp.spawn(rank_main, args=(free_ports(3),), nprocs=TRAINERS + len(ENGINE))
