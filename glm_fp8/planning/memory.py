"""The memory model behind ``glm-fp8 plan``: what each way of converting one layer holds at its
peak on the sender, and the resident master shards per GPU."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from glm_fp8.model.config import as_config
from glm_fp8.model.families import layer_shapes
from glm_fp8.model.layer_plan import LayerPlan


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak transient bytes of one sender converting one whole layer, above its resident
    master shards (optimizer state, gradients, activations and the allocator's cache are not
    counted). ``inputs``: the gathered layer, each tensor in the dtype it travels in."""

    inputs: int
    output: int
    eager: int  # inputs + torch.cat([w1, w3]) + per-expert fp8 lists + torch.stack of them
    preallocated_stack: int  # inputs + output stack + one expert's fp32 working set
    glm_fp8: int  # inputs + one kernel-format output buffer (the kernels allocate nothing more)


# What each figure counts, for labels (``glm-fp8 plan`` prints these).
COUNTS = {
    "inputs": "the layer's trainer tensors gathered on the sender, each in the dtype it travels in",
    "eager": "gathered layer + torch.cat(w1, w3) + the per-expert fp8 tensors + their torch.stack "
    "(prime-rl's path)",
    "preallocated_stack": "gathered layer + the fp8 output stack + one expert's concat, fp32 upcast "
    "and quotient",
    "glm_fp8": "gathered layer + one kernel-format output buffer; the kernels allocate nothing else",
}


def estimate_memory(plan: LayerPlan, gather_dtype: torch.dtype | None = None) -> MemoryEstimate:
    """The model behind ``glm-fp8 plan``: what each conversion path holds at its peak.

    ``gather_dtype``: None (default, as the library gathers: no cast, each tensor in its own
    dtype, the one ``plan.inputs`` gives, bf16 where it gives none; ``travel_plan`` sets them
    for a trainer's masters) or a dtype every input is cast to before it travels.

    eager (prime-rl's path): the gathered layer, the concatenated [E, 2I, H] w13 in its gathered
    dtype, the per-expert fp8 tensors and their ``torch.stack`` (both alive while stacking).
    Preallocated stack: the gathered layer, the fp8 output, and one expert's [2I, H] concat
    with its float32 upcast and quotient. glm_fp8: the gathered layer and the output buffer.
    """

    def itemsize(source: str) -> int:
        return (gather_dtype or plan.inputs[source][1] or torch.bfloat16).itemsize

    inputs = plan.input_bytes(gather_dtype)
    quantized = sum(e.nbytes for e in plan.entries if e.op in ("quantize", "scale"))
    cat = 0
    expert_ws = 0
    for e in plan.entries:
        if e.op == "quantize" and len(e.sources) > 1:
            n = math.prod(e.shape)
            item = max(itemsize(s) for s in e.sources)
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


def travel_plan(
    plan: LayerPlan, master_dtype: torch.dtype = torch.float32, gather_dtype: torch.dtype | None = None
) -> LayerPlan:
    """``plan`` with each input in the dtype it travels in when a trainer holding ``master_dtype``
    masters gathers it (what ``glm_fp8.transfer.gather.travel_dtypes`` does): with
    ``gather_dtype`` None (the library's default, no cast) as held, that is ``master_dtype``,
    float32 where the plan's input is float32 (a routing bias the model keeps in float32); with
    a ``gather_dtype``, the sources of quantized entries in it and a passthrough entry's sources
    in that entry's dtype. Only ``inputs`` changes; the entries and their bytes are the same."""
    travel: dict[str, torch.dtype] = {}
    for e in plan.entries:
        for s in e.sources:
            if gather_dtype is None:
                held = plan.inputs[s][1]
                travel[s] = torch.float32 if held == torch.float32 else master_dtype
            else:
                travel[s] = gather_dtype if e.op == "quantize" else e.dtype
    inputs = {k: (shape, travel.get(k, dt or master_dtype)) for k, (shape, dt) in plan.inputs.items()}
    return dataclasses.replace(plan, inputs=inputs)


def master_bytes_per_gpu(config: object, world_size: int, master_dtype: torch.dtype = torch.float32) -> int:
    """Resident master weights of all decoder layers per GPU when sharded over ``world_size``
    (embeddings and lm_head are left out); ``config``: anything ``as_config`` takes."""
    c = as_config(config)
    total = 0
    for i in range(c["num_hidden_layers"]):
        total += sum(math.prod(shape) for shape in layer_shapes(c, i).values())
    return total * master_dtype.itemsize // world_size


__all__ = ["COUNTS", "MemoryEstimate", "estimate_memory", "master_bytes_per_gpu", "travel_plan"]
