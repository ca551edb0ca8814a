"""The memory model behind ``glm-fp8 plan``: what each way of converting one layer holds at its
peak on the sender, and the resident master shards per GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from glm_fp8.config import as_config
from glm_fp8.models import layer_shapes
from glm_fp8.plan import LayerPlan


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak transient bytes of converting one layer on the sender, above its
    resident master shards. ``inputs``: the gathered layer in the broadcast dtype."""

    inputs: int
    output: int
    eager: int  # inputs + torch.cat([w1, w3]) + per-expert fp8 lists + torch.stack of them
    preallocated_stack: int  # inputs + output stack + one expert's fp32 working set
    glm_fp8: int  # inputs + output buffer (+ O(blocks))


def estimate_memory(plan: LayerPlan, gather_dtype: torch.dtype = torch.bfloat16) -> MemoryEstimate:
    """The model behind ``glm-fp8 plan``: what each conversion path holds at its peak.

    eager (prime-rl's path): the gathered layer, the concatenated [E, 2I, H] w13 in the gather
    dtype, the per-expert fp8 tensors and their ``torch.stack`` (both alive while stacking).
    Preallocated stack: the gathered layer, the fp8 output, and one expert's [2I, H] concat
    with its float32 upcast and quotient. glm_fp8: the gathered layer and the output buffer.
    """
    inputs = plan.input_bytes(gather_dtype)
    item = gather_dtype.itemsize
    quantized = sum(e.nbytes for e in plan.entries if e.op in ("quantize", "scale"))
    cat = 0
    expert_ws = 0
    for e in plan.entries:
        if e.op == "quantize" and len(e.sources) > 1:
            n = math.prod(e.shape)
            cat += n * item
            per_matrix = n // (e.shape[0] if len(e.shape) == 3 else 1)
            expert_ws = max(expert_ws, per_matrix * (item + 4 + 4))
    return MemoryEstimate(
        inputs=inputs,
        output=plan.nbytes,
        eager=inputs + cat + 2 * quantized,
        preallocated_stack=inputs + plan.nbytes + expert_ws,
        glm_fp8=inputs + plan.nbytes,
    )


def master_bytes_per_gpu(config: object, world_size: int, master_dtype=torch.float32) -> int:
    """Resident master weights of all decoder layers per GPU when sharded over ``world_size``
    (embeddings and lm_head are left out); ``config``: anything ``as_config`` takes."""
    c = as_config(config)
    total = 0
    for i in range(c["num_hidden_layers"]):
        total += sum(math.prod(shape) for shape in layer_shapes(c, i).values())
    return total * master_dtype.itemsize // world_size
