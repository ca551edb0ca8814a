"""Many senders: two trainer ranks holding a tiny GLM-5 as FSDP2 shards (DTensors, each rank half
of the experts) both send, point to point, to a vLLM engine with expert parallelism over two
ranks. Each trainer rank quantizes only the experts it holds; no expert is gathered. Runs on a
CPU over gloo; every byte each engine rank lands is compared with glm_fp8's reference.

    python examples/many_senders.py      # about a minute on a CPU (Triton's interpreter)
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU: the Triton kernels run on the CPU

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh

from glm_fp8 import EngineLayout, Receiver, Sender, engine_param_specs
from glm_fp8.model import REST, TINY_GLM5, model_layer_ids
from glm_fp8.testing import free_port, reference_engine_params, sharded_layer

CONFIG = TINY_GLM5
IDS = model_layer_ids(CONFIG)
TRAINERS = 2  # link ranks 0-1; the engine's ranks follow
ENGINE = EngineLayout.all_ranks(tp_size=1, dp_size=2, enable_expert_parallel=True)  # EP 2 (vLLM's DP 2)


def rank_main(rank: int, port: int) -> None:
    world = TRAINERS + len(ENGINE)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = DeviceMesh("cpu", torch.arange(TRAINERS))  # the trainer's FSDP mesh (every rank builds it)
    kw = dict(
        config=CONFIG,
        layer_ids=IDS,
        rest=True,
        device="cpu",
        engines=[None] * TRAINERS + ENGINE,
        senders=list(range(TRAINERS)),
    )
    if rank < TRAINERS:  # every trainer rank: the same call, with its own shards
        layers = ((i, sharded_layer(CONFIG, i, mesh)) for i in IDS)
        sender = Sender(None, 0, **kw)
        stats = sender.send_model(layers, rest=sharded_layer(CONFIG, REST, mesh))
        whole = sum(layer.layer_nbytes for layer in stats.layers)
        print(
            f"trainer rank {rank}: sent {stats.nbytes / 2**20:.2f} MiB; whole model {whole / 2**20:.2f} MiB"
        )
    else:
        layout = ENGINE[rank - TRAINERS]
        params = {
            n: torch.empty(shape, dtype=dtype)
            for n, (shape, dtype) in engine_param_specs(CONFIG, layout).items()
        }
        Receiver(None, 0, layout=layout, **kw).load_into(params)
        want = reference_engine_params(CONFIG, layout, [*IDS, REST])
        same = all(torch.equal(params[n].view(torch.uint8), w.view(torch.uint8)) for n, w in want.items())
        print(f"engine rank {rank - TRAINERS} (EP rank {layout.ep_rank}): equal to the reference: {same}")
        assert same
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(free_port(),), nprocs=TRAINERS + len(ENGINE))
