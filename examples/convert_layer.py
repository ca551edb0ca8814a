"""The kernels on their own, in one process: a layer's routed experts into vLLM's fused-MoE fp8
tensors, a whole trainer layer into one preallocated buffer, both compared bit for bit with
glm_fp8's PyTorch reference. On a GPU when there is one, else on the CPU.

    python examples/convert_layer.py     # a few seconds on a CPU (Triton's interpreter)
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # set before glm_fp8's kernels load

from glm_fp8 import ExpertsFP8, convert_layer, plan_from_config, quantize_experts
from glm_fp8.kernels.reference import convert_layer_ref, quantize_experts_ref
from glm_fp8.model import TINY_GLM5, strip_layer
from glm_fp8.testing import synthetic_layer

device = "cuda" if torch.cuda.is_available() else "cpu"
bits = lambda t: t.view(torch.uint8)  # noqa: E731 - compare bytes, not values (NaN != NaN)

# Routed experts as prime-rl holds them: w1, w3 [E, I, H], w2 [E, H, I] (any dtype, any strides).
g = torch.Generator().manual_seed(0)
experts, hidden, inter = 4, 256, 512
w1, w3 = (torch.randn(experts, inter, hidden, generator=g).to(device, torch.bfloat16) for _ in range(2))
w2 = torch.randn(experts, hidden, inter, generator=g).to(device, torch.bfloat16)
out = ExpertsFP8.empty(experts, hidden, inter, device=device)  # vLLM's four fused-MoE tensors
quantize_experts(w1, w3, w2, out=out)  # w13 = [w1; w3] per expert, never built; allocates nothing
for (name, got), want in zip(out.items(), quantize_experts_ref(w1, w3, w2)):
    assert torch.equal(bits(got), bits(want)), name
print("experts:", ", ".join(f"{n} {tuple(t.shape)}" for n, t in out.items()))

# A whole sparse layer (attention, indexer, shared and routed experts) into one byte buffer.
layer_idx = 2
plan = plan_from_config(TINY_GLM5, layer_idx)  # entries and byte offsets: build once, reuse
slot = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
state_dict = {k: t.to(device) for k, t in synthetic_layer(TINY_GLM5, layer_idx).items()}
views = convert_layer(state_dict, layer_idx, out=slot, plan=plan)  # {kernel-format name: view of slot}
want = convert_layer_ref(strip_layer(state_dict, layer_idx), layer_idx, plan)
assert all(torch.equal(bits(views[n]), bits(w.to(device))) for n, w in want.items())
print(f"layer {layer_idx}: {len(views)} entries in one {plan.nbytes / 2**20:.2f} MiB buffer, bit-exact")
