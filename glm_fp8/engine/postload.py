"""What a vLLM 0.34 engine derives or rewrites after loading, and how an in-place update gets the
same result (docs/layouts.md#post-load-rewrites, docs/vllm.md).

An update lands the load format (what ``glm_fp8.engine.engine_param_specs`` lists). What the
engine's post-load step would have changed afterwards is either sent directly in its runtime
format, or redone here / by a hook after the update:

- DeepGEMM's power-of-two (UE8M0) scales: sent directly (``scale_fmt="ue8m0"`` on both ends).
- FlashInfer CUTLASS MoE: w13 halves swapped to [w3; w1] (``swap_w13_halves_``) and the expert
  block scales clamped to >= 1e-10 (``clamp_scales_``), in place after the update.
- MLA's absorbed ``W_UK_T`` / ``W_UV``: rebuilt by vLLM's own module hook (the engine
  integration runs it); ``mla_absorbed_ref`` is the pure-torch statement of what it computes.

A delta update rebuilds each layer's last wire bytes from the parameters (docs/delta.md), so the
FlashInfer CUTLASS rewrites are undone on the rebuilt copy first (``postload_inverse``).

Only torch and glm_fp8's own engine, numerics and reference modules are imported: nothing here
needs vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from glm_fp8.core.numerics import BLOCK, ceil_blocks
from glm_fp8.engine.layout import EngineLayout
from glm_fp8.engine.specs import engine_name
from glm_fp8.kernels.reference import block_scales_ref

# quantization/utils/flashinfer_utils.py::prepare_fp8_moe_layer_for_fi (_FI_CUTLASS_MIN_BLOCK_SCALE)
FI_CUTLASS_MIN_BLOCK_SCALE = 1e-10

# vLLM 0.34 Fp8MoeBackend values (fused_moe/oracle/fp8.py) by what their load-time conversion
# (convert_to_fp8_moe_kernel_format) does to block-FP8 expert weights.
MOE_BACKENDS_AS_LOADED = frozenset({"TRITON", "BATCHED_TRITON", "VLLM_CUTLASS", "BATCHED_VLLM_CUTLASS"})
MOE_BACKENDS_FI_CUTLASS = frozenset({"FLASHINFER_CUTLASS"})
MOE_BACKENDS_DEEPGEMM = frozenset({"DEEPGEMM", "BATCHED_DEEPGEMM"})
MOE_BACKENDS = MOE_BACKENDS_AS_LOADED | MOE_BACKENDS_FI_CUTLASS | MOE_BACKENDS_DEEPGEMM
# Not supported: FLASHINFER_TRTLLM (shuffles the bytes to BlockMajorK), MARLIN, HUMMING, AITER*
# (repack the weights), CPU*, XPU, HPC, EMULATION, TRITON_MXFP8 (other platforms or formats).


@dataclass(frozen=True)
class PostLoadPlan:
    """What an update must do so a vLLM 0.34 engine holds what its own load would have produced.

    Attributes:
        scale_fmt: the block-scale format the sender must use ("fp32" or "ue8m0"); "ue8m0"
            when DeepGEMM re-quantized the engine's weights to power-of-two scales.
        swap_w13: after the update, swap every landed routed-expert w13 (and its scales) from
            [w1; w3] to [w3; w1] (FlashInfer CUTLASS / TRT-LLM order).
        clamp_min: after the update, clamp every landed routed-expert block scale to at least
            this (FlashInfer CUTLASS), or None.
        module_hooks: after the update, run the engine's own module hooks (MLA ``W_UK_T`` /
            ``W_UV``), not its quantization transforms.
        moe_backend: the vLLM ``Fp8MoeBackend`` value the plan was made for.
    """

    scale_fmt: str
    swap_w13: bool
    clamp_min: float | None
    module_hooks: bool
    moe_backend: str

    def describe(self) -> dict[str, object]:
        """The plan as plain data (what the engine integration reports to the trainer)."""
        direct = ["load-format bytes and scales under vLLM's names and shards"]
        if self.scale_fmt == "ue8m0":
            direct.append("power-of-two (UE8M0) block scales for DeepGEMM (scale_fmt='ue8m0')")
        hooks = []
        if self.swap_w13:
            hooks.append("swap routed-expert w13 halves to [w3; w1] (FlashInfer)")
        if self.clamp_min is not None:
            hooks.append(f"clamp routed-expert block scales to >= {self.clamp_min:g} (FlashInfer CUTLASS)")
        if self.module_hooks:
            hooks.append("module hooks: MLA W_UK_T / W_UV from kv_b_proj")
        return {
            "scale_fmt": self.scale_fmt,
            "moe_backend": self.moe_backend,
            "written_directly": direct,
            "after_update": hooks,
        }


def postload_plan(
    config: Mapping,
    *,
    moe_backend: str,
    deepgemm_linears: bool = False,
    deepgemm_e8m0: bool = True,
) -> PostLoadPlan:
    """The post-load steps an update needs on a vLLM 0.34 engine of this model whose routed
    experts run on ``moe_backend`` (a ``Fp8MoeBackend`` value, e.g. "TRITON", or the enum) and
    whose block-FP8 linears were re-quantized by DeepGEMM (``deepgemm_linears``).

    Rules, from vLLM 0.34 (docs/layouts.md#post-load-rewrites):

    - ``fused_moe/oracle/fp8.py::convert_to_fp8_moe_kernel_format``: TRITON / VLLM_CUTLASS (and
      their BATCHED forms) keep the loaded bytes; FLASHINFER_CUTLASS runs
      ``quantization/utils/flashinfer_utils.py::prepare_fp8_moe_layer_for_fi`` (``swap_w13_to_w31``
      on weights and block scales, then ``clamp_(min=1e-10)`` on both scales); DEEPGEMM runs
      ``quantization/utils/fp8_utils.py::prepare_fp8_moe_layer_for_deepgemm`` (UE8M0 requant when
      ``utils/deep_gemm.py::is_deep_gemm_e8m0_used``, passed here as ``deepgemm_e8m0``).
    - ``kernels/linear/scaled_mm/deep_gemm.py::DeepGemmFp8BlockScaledMMKernel.
      process_weights_after_loading``: UE8M0 requant of the linears it serves.
    - ``layers/attention/mla_attention.py::MLAAttention.process_weights_after_loading``: the
      absorbed MLA weights, for MLA models (``glm_moe_dsa``).

    Raises ValueError naming the backend when vLLM rewrites the experts in a way no update can
    reproduce here (FLASHINFER_TRTLLM's BlockMajorK shuffle, Marlin / Humming / AITER repacking,
    other platforms).
    """
    backend = str(getattr(moe_backend, "value", moe_backend)).upper()
    if backend not in MOE_BACKENDS:
        raise ValueError(
            f"moe_backend: vLLM's fused-MoE backend {backend!r} rewrites the routed experts into a layout "
            f"glm_fp8 cannot land (supported: {sorted(MOE_BACKENDS)}); start the engine with "
            "--moe-backend triton (or flashinfer_cutlass / deep_gemm)"
        )
    deepgemm_moe = backend in MOE_BACKENDS_DEEPGEMM and deepgemm_e8m0
    fi = backend in MOE_BACKENDS_FI_CUTLASS
    return PostLoadPlan(
        scale_fmt="ue8m0" if (deepgemm_linears or deepgemm_moe) else "fp32",
        swap_w13=fi,
        clamp_min=FI_CUTLASS_MIN_BLOCK_SCALE if fi else None,
        module_hooks=config.get("model_type") == "glm_moe_dsa",
        moe_backend=backend,
    )


def check_w13_halves(w13: torch.Tensor, w13_scale_inv: torch.Tensor | None = None) -> int:
    """The row count of each half of ``w13`` [E, 2I, H], checked as ``swap_w13_halves_`` needs it
    (with its block scales [E, 2I/128, nb(H)]: halves of whole 128-row blocks); ValueError naming
    the tensor otherwise. Reads no element."""
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13: expected [E, 2I, H] with an even row count, got {list(w13.shape)}")
    half = w13.shape[1] // 2
    if w13_scale_inv is not None:
        want = (w13.shape[0], ceil_blocks(w13.shape[1]), ceil_blocks(w13.shape[2]))
        if tuple(w13_scale_inv.shape) != want:
            raise ValueError(
                f"w13_scale_inv: expected {list(want)} for w13 {list(w13.shape)}, got "
                f"{list(w13_scale_inv.shape)}"
            )
        if half % BLOCK:
            raise ValueError(
                f"w13: each half has {half} rows, not a multiple of {BLOCK}: a block row of the scales "
                "would straddle w1 and w3, so the scale halves cannot be swapped"
            )
    return half


def swap_w13_halves_(w13: torch.Tensor, w13_scale_inv: torch.Tensor | None = None) -> None:
    """Swap the two row halves of every expert of ``w13`` [E, 2I, H] in place: [w1; w3] <->
    [w3; w1], and likewise the block-scale halves of ``w13_scale_inv`` [E, 2I/128, nb(H)]
    (an involution: a second call restores the input). Same result as vLLM 0.34's
    ``quantization/utils/flashinfer_utils.py::swap_w13_to_w31`` (``reshape(-1, 2, I, H).flip(1)``),
    which builds a full-size copy; this goes one expert at a time.

    Allocates one half of one expert, [I, H] in w13's dtype (GLM-5 at EP: 12 MiB), and [I/128,
    nb(H)] float32 for the scales, each once per call. Raises ValueError naming the tensor when
    the shapes do not have two halves of whole 128-row blocks (``check_w13_halves``).
    """
    half = check_w13_halves(w13, w13_scale_inv)
    _swap_halves(w13, half)
    if w13_scale_inv is not None:
        _swap_halves(w13_scale_inv, half // BLOCK)


def _swap_halves(t: torch.Tensor, half: int) -> None:
    tmp = torch.empty_like(t[0, :half])
    for e in range(t.shape[0]):
        top, bottom = t[e, :half], t[e, half:]
        tmp.copy_(top)
        top.copy_(bottom)
        bottom.copy_(tmp)


def clamp_scales_(scale: torch.Tensor, minimum: float = FI_CUTLASS_MIN_BLOCK_SCALE) -> torch.Tensor:
    """``scale.clamp_(min=minimum)`` in place, as vLLM 0.34's
    ``flashinfer_utils.py::prepare_fp8_moe_layer_for_fi`` does to FlashInfer CUTLASS expert scales
    (the same op, so the same bits; NaN stays NaN). Needed after an update because glm_fp8's
    scale floor is 1e-12 (docs/numerics.md#scale): an all-zero block gets a scale below 1e-10."""
    if scale.dtype != torch.float32:
        raise ValueError(f"scale: expected float32 block scales, got {scale.dtype}")
    return scale.clamp_(min=minimum)


def expert_param_names(config: Mapping, layer_ids: Iterable[int]) -> list[tuple[str, str, str, str]]:
    """(w13, w13 scale, w2, w2 scale) vLLM names of the routed experts of the sparse layers among
    ``layer_ids`` (the MTP layer included: its experts live under ``mtp_block.``)."""
    first = config.get("first_k_dense_replace", 0)
    out = []
    for i in layer_ids:
        if i < 0 or i < first:
            continue
        p = f"model.layers.{i}.mlp.experts."
        names = [
            engine_name(p + n, config)
            for n in ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")
        ]
        out.append(tuple(names))
    return out


def apply_postload_(
    params: Mapping[str, torch.Tensor], plan: PostLoadPlan, config: Mapping, layer_ids: Iterable[int]
) -> list[str]:
    """Run the tensor steps of ``plan`` (w13 swap, scale clamp) on the experts of the landed
    ``layer_ids``, in place, in vLLM's order (swap, then clamp). Returns the names rewritten.
    Call once per completed update: the swap is an involution, a second call undoes it."""
    done: dict[str, None] = {}  # ordered set
    if not (plan.swap_w13 or plan.clamp_min is not None):
        return []
    for w13, s13, w2, s2 in expert_param_names(config, layer_ids):
        for n in (w13, s13, w2, s2):
            if n not in params:
                raise KeyError(f"params: missing {n!r}, needed by the post-load step ({plan.moe_backend})")
        if plan.swap_w13:
            swap_w13_halves_(params[w13], params[s13])
            done.update(dict.fromkeys((w13, s13)))
        if plan.clamp_min is not None:
            clamp_scales_(params[s13], plan.clamp_min)
            clamp_scales_(params[s2], plan.clamp_min)
            done.update(dict.fromkeys((s13, s2)))
    return list(done)


def postload_inverse(
    plan: PostLoadPlan, config: Mapping, layer_ids: Iterable[int], scale_fmt: str
) -> Callable[[str, torch.Tensor, torch.Tensor], bool] | None:
    """What undoes ``apply_postload_`` (None when the plan rewrites nothing):
    ``copy_back(name, dst, src)`` writes into ``dst`` the bytes that landed where ``src`` now holds
    them rewritten, ``src`` a region of parameter ``name`` (vLLM's name) of the routed experts of
    ``layer_ids`` that holds whole experts (all of its rows and columns: the parameter, or some of
    its experts), and returns True; False, writing nothing, for a parameter the step leaves alone.
    One pass: w13's halves copied back crosswise (the swap is an involution), then a scale at
    ``plan.clamp_min`` back to the floor an all-zero block gets in ``scale_fmt``
    (``block_scales_ref``). A block whose scale was at or below the clamp yet not the floor (not all
    zero, magnitudes under 448 x 1e-10) is not recovered: the delta's checksum then differs and the
    layer is resent dense (docs/delta.md). Allocates a bool mask the size of a scale tensor."""
    if not (plan.swap_w13 or plan.clamp_min is not None):
        return None
    kinds: dict[str, str] = {}
    for w13, s13, _, s2 in expert_param_names(config, layer_ids):
        kinds.update({w13: "w13", s13: "w13 scale", s2: "scale"})
    floor = block_scales_ref(torch.zeros(1, 1), scale_fmt).item()

    def copy_back(name: str, dst: torch.Tensor, src: torch.Tensor) -> bool:
        kind = kinds.get(name)
        if kind is None:
            return False
        if plan.swap_w13 and kind != "scale":
            half = src.shape[1] // 2
            dst[:, :half].copy_(src[:, half:])
            dst[:, half:].copy_(src[:, :half])
        else:
            dst.copy_(src)
        if plan.clamp_min is not None and kind != "w13":
            dst.masked_fill_(dst == plan.clamp_min, floor)  # a Python float: no host-device copy
        return True

    return copy_back


def mla_absorbed_ref(
    kv_b_weight: torch.Tensor,
    kv_b_scale_inv: torch.Tensor | None,
    config: Mapping,
    layout: EngineLayout,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``W_UK_T`` [N, P, L], ``W_UV`` [N, L, V]) of one rank's ``kv_b_proj`` shard (N = heads/tp,
    P = qk_nope_head_dim, V = v_head_dim, L = kv_lora_rank), as vLLM 0.34 computes them:
    ``mla_attention.py::split_kv_b_proj`` dequantizes with ``quant_utils.py::scaled_dequantize``
    (``(q.float() * s).to(dtype)``, s broadcast over 128x128 blocks), transposes to [L, N*(P+V)],
    splits P | V per head; ``MLAAttention.process_weights_after_loading`` stores
    ``W_UV.transpose(0, 1)`` and ``W_UK.permute(1, 2, 0)``. A reference for checks, not a
    replacement for the engine's hook."""
    heads = config["num_attention_heads"] // layout.tp_size
    p, v, lora = config["qk_nope_head_dim"], config["v_head_dim"], config["kv_lora_rank"]
    if tuple(kv_b_weight.shape) != (heads * (p + v), lora):
        raise ValueError(
            f"kv_b_proj.weight: expected {[heads * (p + v), lora]} for {heads} heads per rank, "
            f"got {list(kv_b_weight.shape)}"
        )
    w = kv_b_weight.to(torch.float32)
    if kv_b_scale_inv is not None:
        s = kv_b_scale_inv.to(torch.float32).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        w = w * s[: w.shape[0], : w.shape[1]]
    w = w.to(dtype).T.reshape(lora, heads, p + v)
    w_uk, w_uv = w.split([p, v], dim=-1)
    return w_uk.permute(1, 2, 0).contiguous(), w_uv.transpose(0, 1).contiguous()


__all__ = [
    "FI_CUTLASS_MIN_BLOCK_SCALE",
    "MOE_BACKENDS",
    "PostLoadPlan",
    "apply_postload_",
    "check_w13_halves",
    "clamp_scales_",
    "expert_param_names",
    "mla_absorbed_ref",
    "postload_inverse",
    "postload_plan",
    "swap_w13_halves_",
]
