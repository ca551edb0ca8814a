"""Quick start: one trainer rank sends a whole tiny GLM-5 in FP8 to an engine of two ranks (vLLM's
tensor parallel 2), three CPU processes over gloo. Each engine rank receives only its shard and
lands it in tensors named and shaped as vLLM 0.34's; every byte is compared with the reference.

    python examples/quickstart.py        # about a minute on a CPU (Triton's interpreter)
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU: the Triton kernels run on the CPU

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm_fp8 import EngineLayout, Receiver, Sender, engine_param_specs
from glm_fp8.model import REST, TINY_GLM5, model_layer_ids
from glm_fp8.testing import free_port, reference_engine_params, synthetic_layer

CONFIG = TINY_GLM5  # GLM-5's architecture, hidden 256, 4 experts; or a config.json path / HF config
IDS = model_layer_ids(CONFIG)  # every decoder layer, then the MTP layer
ENGINE = [EngineLayout(tp_size=2, tp_rank=r) for r in range(2)]  # link ranks 1 and 2


def rank_main(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    # The same arguments on every rank: rank 0 sends, ranks 1-2 receive their shard (scatter).
    kw = dict(config=CONFIG, layer_ids=IDS, rest=True, engines=[None, *ENGINE], device="cpu")
    if rank == 0:  # the trainer: (layer_idx, state_dict) in order, then embeddings, norm, lm_head
        layers = ((i, synthetic_layer(CONFIG, i)) for i in IDS)
        stats = Sender(None, 0, **kw).send_model(layers, rest=synthetic_layer(CONFIG, REST))
        print(f"sent {stats.nbytes / 2**20:.1f} MiB in {len(stats.layers)} steps, {stats.seconds:.1f} s")
    else:  # an engine rank: its parameters, by vLLM's names (a real worker passes its model's)
        layout = ENGINE[rank - 1]
        params = {
            n: torch.empty(shape, dtype=dtype)
            for n, (shape, dtype) in engine_param_specs(CONFIG, layout).items()
        }
        Receiver(None, 0, layout=layout, **kw).load_into(params)
        want = reference_engine_params(CONFIG, layout, [*IDS, REST])
        same = all(torch.equal(params[n].view(torch.uint8), w.view(torch.uint8)) for n, w in want.items())
        print(f"engine rank {rank - 1}: {len(params)} parameters, equal to the reference: {same}")
        assert same
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(free_port(),), nprocs=3)
