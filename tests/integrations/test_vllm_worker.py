"""The vLLM worker extension against a stand-in engine, and the post-load helpers.

Invariants:
- ``swap_w13_halves_`` / ``clamp_scales_`` give the bits of vLLM 0.34's own ops
  (``flashinfer_utils.py::swap_w13_to_w31``, ``clamp_(min=1e-10)``); ``mla_absorbed_ref`` the
  per-head slices of the dequantized ``kv_b_proj``.
- After ``EngineUpdater.update`` on a stand-in vLLM model (target + MTP drafter, vLLM's names
  and shard shapes from ``engine_param_specs``, the drafter's ``embed_tokens`` and
  ``shared_head.head`` shared with the target as vLLM 0.34 shares them), every parameter holds
  the reference conversion cut by the layout and rewritten as the engine's backend would have
  (FlashInfer CUTLASS: [w3; w1], scales >= 1e-10), the shared head holds the target's lm_head,
  and each MLA module's hook ran once and rebuilt ``W_UK_T`` / ``W_UV`` from the new kv_b_proj.
- Refusals known before the transfer (a scale format the engine cannot serve) stop every rank,
  the trainer included, at the manifest vote, with nothing written.

No vLLM import anywhere: the stand-ins carry only the attributes the extension reads.
"""

import sys
from types import SimpleNamespace

import pytest
import torch

from glm_fp8.model.families import REST, model_layer_ids
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.testing import launch, synthetic_layer

MTP = TINY_GLM5["num_hidden_layers"]  # 4
FILL = 0x5A


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


# --- post-load helpers ----------------------------------------------------------------------------


def _vllm_swap_w13_to_w31(x: torch.Tensor) -> torch.Tensor:
    """vLLM 0.34 flashinfer_utils.py::swap_w13_to_w31, on a byte view (flip has no fp8 kernel)."""
    u = x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x
    out = u.reshape(-1, 2, u.shape[-2] // 2, u.shape[-1]).flip(dims=[1]).reshape(u.shape)
    return out.view(x.dtype) if x.dtype == torch.float8_e4m3fn else out


def test_swap_w13_halves_matches_vllm_and_is_an_involution():
    from glm_fp8.engine.postload import swap_w13_halves_

    e, inter, h = 3, 256, 200
    w13 = torch.randint(0, 256, (e, 2 * inter, h), dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.rand(e, 2 * inter // 128, 2)
    want_w, want_s = _vllm_swap_w13_to_w31(w13.clone()), _vllm_swap_w13_to_w31(scale.clone())
    orig_w, orig_s = w13.clone(), scale.clone()
    swap_w13_halves_(w13, scale)
    assert torch.equal(_bytes(w13), _bytes(want_w)) and torch.equal(_bytes(scale), _bytes(want_s))
    swap_w13_halves_(w13, scale)
    assert torch.equal(_bytes(w13), _bytes(orig_w)) and torch.equal(_bytes(scale), _bytes(orig_s))


def test_swap_w13_halves_refuses_halves_that_straddle_a_block_row():
    from glm_fp8.engine.postload import swap_w13_halves_

    w13 = torch.zeros(2, 2 * 192, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="192 rows, not a multiple of 128"):
        swap_w13_halves_(w13, torch.ones(2, 3, 1))
    with pytest.raises(ValueError, match=r"w13_scale_inv: expected \[2, 3, 1\]"):
        swap_w13_halves_(w13, torch.ones(2, 4, 1))
    with pytest.raises(ValueError, match="even row count"):
        swap_w13_halves_(torch.zeros(2, 3, 4))


def test_clamp_scales_is_vllms_clamp_bit_for_bit():
    from glm_fp8.core.numerics import SCALE_FLOOR_BITS
    from glm_fp8.engine.postload import clamp_scales_

    floor = torch.tensor([SCALE_FLOOR_BITS], dtype=torch.int32).view(torch.float32)  # glm_fp8's 1e-12
    s = torch.cat([floor, torch.tensor([0.0, 5e-11, 1e-10, 2e-10, 3.5, float("nan")])])
    orig = s.clone()
    want = orig.clone().clamp_(min=1e-10)  # prepare_fp8_moe_layer_for_fi
    assert clamp_scales_(s) is s
    assert torch.equal(_bytes(s), _bytes(want))
    assert torch.equal(_bytes(s[4:6]), _bytes(orig[4:6])) and s[0] == torch.tensor(1e-10) and s[6].isnan()
    with pytest.raises(ValueError, match="expected float32 block scales"):
        clamp_scales_(torch.ones(2, dtype=torch.bfloat16))


def test_postload_plan_per_backend():
    from glm_fp8.engine.postload import postload_plan

    tri = postload_plan(TINY_GLM5, moe_backend="TRITON")
    assert (tri.scale_fmt, tri.swap_w13, tri.clamp_min, tri.module_hooks) == ("fp32", False, None, True)
    fi = postload_plan(TINY_GLM5, moe_backend=SimpleNamespace(value="FLASHINFER_CUTLASS"))  # the enum
    assert (fi.scale_fmt, fi.swap_w13, fi.clamp_min) == ("fp32", True, 1e-10)
    assert postload_plan(TINY_GLM5, moe_backend="DEEPGEMM").scale_fmt == "ue8m0"
    assert postload_plan(TINY_GLM5, moe_backend="DEEPGEMM", deepgemm_e8m0=False).scale_fmt == "fp32"
    assert postload_plan(TINY_GLM5, moe_backend="TRITON", deepgemm_linears=True).scale_fmt == "ue8m0"
    assert not postload_plan({"model_type": "glm4_moe"}, moe_backend="TRITON").module_hooks
    with pytest.raises(ValueError, match="'FLASHINFER_TRTLLM' rewrites the routed experts"):
        postload_plan(TINY_GLM5, moe_backend="FLASHINFER_TRTLLM")
    assert fi.describe()["after_update"][0].startswith("swap routed-expert w13")


def test_apply_postload_touches_only_the_landed_sparse_layers():
    from glm_fp8.engine import EngineLayout, engine_param_specs
    from glm_fp8.engine.postload import apply_postload_, postload_plan

    specs = engine_param_specs(TINY_GLM5, EngineLayout())
    params = {n: torch.rand(s).to(dt) for n, (s, dt) in specs.items()}
    before = {n: p.clone() for n, p in params.items()}
    plan = postload_plan(TINY_GLM5, moe_backend="FLASHINFER_CUTLASS")
    done = apply_postload_(params, plan, TINY_GLM5, [1, 3, MTP, REST])  # layer 1 is dense
    p3, pm = (
        "model.layers.3.mlp.experts.routed_experts.",
        f"model.layers.{MTP}.mtp_block.mlp.experts.routed_experts.",
    )
    assert set(done) == {
        p + n for p in (p3, pm) for n in ("w13_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")
    }
    changed = {n for n in params if not torch.equal(_bytes(params[n]), _bytes(before[n]))}
    assert changed <= set(done) and p3 + "w13_weight" in changed
    assert torch.equal(
        _bytes(params[p3 + "w13_weight"]), _bytes(_vllm_swap_w13_to_w31(before[p3 + "w13_weight"]))
    )


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("tp", [1, 2])
def test_postload_inverse_gives_back_the_bytes_that_landed(scale_fmt, tp):
    """What a delta update rebuilds from a FlashInfer CUTLASS engine (docs/delta.md): after
    ``apply_postload_`` (w13 halves swapped, scales clamped to >= 1e-10), ``postload_inverse``'s
    copy of each parameter, or of some of its experts (many senders), is the landed bytes, an
    all-zero block's floor scale included (in w1's half and in w3's), on a rank with whole experts
    or with a TP cut of each ([gate part; up part]); a parameter the step leaves alone is not
    written (False). A scale below the clamp that is not the floor (a tiny, not all-zero block)
    is not recovered: the delta's checksum catches it."""
    from glm_fp8.engine import EngineLayout, engine_param_specs
    from glm_fp8.engine.postload import apply_postload_, postload_inverse, postload_plan
    from glm_fp8.kernels.quantize import quantize_blockwise

    specs = engine_param_specs(TINY_GLM5, EngineLayout(tp_size=tp, tp_rank=tp - 1))
    plan = postload_plan(TINY_GLM5, moe_backend="FLASHINFER_CUTLASS")
    p3 = "model.layers.3.mlp.experts.routed_experts."
    landed = {}
    for w in ("w13", "w2"):
        shape = specs[p3 + f"{w}_weight"][0]
        x = torch.randn(shape)
        x[1, :128, :128] = 0  # all-zero blocks: the floor scale, clamped up by FlashInfer
        x[2, -128:, -128:] = 0
        q, scale = quantize_blockwise(x, scale_fmt=scale_fmt)
        landed[p3 + f"{w}_weight"], landed[p3 + f"{w}_weight_scale_inv"] = q, scale
    landed["model.layers.3.self_attn.o_proj.weight_scale_inv"] = torch.full((2, 2), 1e-12)
    params = {n: t.clone() for n, t in landed.items()}
    apply_postload_(params, plan, TINY_GLM5, [3])
    assert not torch.equal(
        _bytes(params[p3 + "w13_weight_scale_inv"]), _bytes(landed[p3 + "w13_weight_scale_inv"])
    )
    copy_back = postload_inverse(plan, TINY_GLM5, [3], scale_fmt)
    for name, want in landed.items():
        for rows in (slice(None), slice(1, 3)):  # the whole parameter, or two of its experts
            got = torch.full_like(want[rows], float("nan"))
            if copy_back(name, got, params[name][rows]):
                assert torch.equal(_bytes(got), _bytes(want[rows])), (name, rows)
            else:  # not rewritten (w2's bytes, a linear's scales): nothing written, copied as it is
                assert name.endswith(("w2_weight", "o_proj.weight_scale_inv")) and got.isnan().all(), name
    assert postload_inverse(postload_plan(TINY_GLM5, moe_backend="TRITON"), TINY_GLM5, [3], scale_fmt) is None
    tiny = torch.tensor([[5e-11]])  # below the clamp, not the floor: clamped, then not recovered
    got = torch.empty_like(tiny)
    assert copy_back(p3 + "w2_weight_scale_inv", got, tiny.clamp(min=1e-10)) and not torch.equal(got, tiny)


def test_mla_absorbed_ref_slices_each_heads_dequantized_rows():
    from glm_fp8.engine import EngineLayout
    from glm_fp8.engine.postload import mla_absorbed_ref

    c, lay = TINY_GLM5, EngineLayout(tp_size=2, tp_rank=1)
    n, p, v, lora = c["num_attention_heads"] // 2, c["qk_nope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    w = torch.randint(0, 126, (n * (p + v), lora), dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(n * (p + v) // 128, lora // 128) + 0.5
    w_uk_t, w_uv = mla_absorbed_ref(w, s, c, lay)
    dq = (w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.bfloat16)
    assert w_uk_t.shape == (n, p, lora) and w_uv.shape == (n, lora, v)
    for head in range(n):
        rows = dq[head * (p + v) : (head + 1) * (p + v)]
        assert torch.equal(w_uk_t[head], rows[:p]) and torch.equal(w_uv[head], rows[p:].T)
    with pytest.raises(ValueError, match="kv_b_proj.weight: expected"):
        mla_absorbed_ref(w, s, c, EngineLayout())


# --- the stand-in engine --------------------------------------------------------------------------


class StandInMLA(torch.nn.Module):
    """vLLM's MLAAttention as far as the update sees it: kv_b_proj below it, W_UK_T / W_UV derived
    by its own post-load hook (recomputed in place, as replace_parameter does)."""

    def __init__(self, config, layout):
        super().__init__()
        self.config, self.layout, self.hook_calls = config, layout, 0

    def add_derived(self):
        n = self.config["num_attention_heads"] // self.layout.tp_size
        p, v, lora = self.config["qk_nope_head_dim"], self.config["v_head_dim"], self.config["kv_lora_rank"]
        for name, shape in (("W_UK_T", (n, p, lora)), ("W_UV", (n, lora, v))):
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), False))

    def process_weights_after_loading(self):
        from glm_fp8.engine.postload import mla_absorbed_ref

        self.hook_calls += 1
        w_uk_t, w_uv = mla_absorbed_ref(
            self.kv_b_proj.weight, self.kv_b_proj.weight_scale_inv, self.config, self.layout
        )
        self.W_UK_T.data.copy_(w_uk_t)
        self.W_UV.data.copy_(w_uv)


def _tree(names, config, layout, root=None) -> torch.nn.Module:
    """A module tree holding ``names`` ({name: (shape, dtype)}) as parameters, poisoned."""
    root = root if root is not None else torch.nn.Module()
    for name, (shape, dtype) in names.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                child = StandInMLA(config, layout) if part == "self_attn" else torch.nn.Module()
                mod.add_module(part, child)
            mod = getattr(mod, part)
        t = torch.empty(shape, dtype=dtype)
        t.view(torch.uint8).fill_(FILL)
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def _engine(layout, backend="FLASHINFER_CUTLASS", deepgemm_linear=False):
    """(target, drafter) with vLLM 0.34's names, shard shapes and sharing, plus the attributes the
    extension reads (quant_method.fp8_backend, moe_config.moe_parallel_config, fp8_linear)."""
    from glm_fp8.engine import engine_param_specs

    specs = engine_param_specs(TINY_GLM5, layout)
    mtp = f"model.layers.{MTP}."
    target = _tree({n: v for n, v in specs.items() if not n.startswith(mtp)}, TINY_GLM5, layout)
    drafter = torch.nn.Module()
    drafter.add_module("model", torch.nn.Module())
    _tree({n: v for n, v in specs.items() if n.startswith(mtp)}, TINY_GLM5, layout, root=drafter)
    drafter.model.embed_tokens = target.model.embed_tokens  # maybe_share_target_embed
    head = getattr(drafter.model.layers, str(MTP)).shared_head
    del head.head  # load_eagle_model: del sh.head; sh.head = draft_head (the target's lm_head)
    head.head = target.lm_head
    drafter.lm_head = target.lm_head
    mpc = SimpleNamespace(
        ep_size=layout.ep_size, ep_rank=layout.ep_rank, tp_size=layout.moe_tp_size, tp_rank=layout.moe_tp_rank
    )
    for model in (target, drafter):
        for name, module in model.named_modules():
            if isinstance(module, StandInMLA):
                module.add_derived()
            if name.endswith("mlp.experts.routed_experts"):
                module.quant_method = SimpleNamespace(fp8_backend=SimpleNamespace(value=backend))
                module.moe_config = SimpleNamespace(moe_parallel_config=mpc)
            if name.endswith("self_attn.q_b_proj"):
                kernel = SimpleNamespace(is_deep_gemm_supported=deepgemm_linear, use_deep_gemm_e8m0=True)
                module.quant_method = SimpleNamespace(fp8_linear=SimpleNamespace(fallback=kernel))
    return target, drafter


def _finalize(model: torch.nn.Module) -> None:
    """finalize_model_weights' traversal: each module's hook after its children's."""
    for module in reversed(list(model.modules())):
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook):
            hook()


def _updater(layout, backend="FLASHINFER_CUTLASS", deepgemm_linear=False):
    from glm_fp8.integrations.vllm.probe import engine_postload_plan
    from glm_fp8.integrations.vllm.updater import EngineUpdater

    target, drafter = _engine(layout, backend, deepgemm_linear)
    plan = engine_postload_plan(TINY_GLM5, target, drafter, deepgemm_e8m0=True)
    return EngineUpdater(target, drafter, TINY_GLM5, layout, plan, finalize=_finalize)


def test_importing_the_integration_needs_no_vllm_and_its_methods_cannot_clash_with_the_worker():
    import glm_fp8.integrations.vllm as integ

    assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
    # WorkerWrapperBase.init_worker asserts that no extension attribute exists on the worker class.
    own = [a for a in vars(integ.GlmFp8WorkerExtension) if not a.startswith("__")]
    assert own and all(a.startswith(("glm_fp8_", "_glm_fp8_")) for a in own), own


def test_collect_params_finds_every_spec_name_in_target_and_drafter():
    from glm_fp8.engine import EngineLayout, engine_param_specs
    from glm_fp8.integrations.vllm.updater import collect_params

    layout = EngineLayout(tp_size=2, tp_rank=1)
    target, drafter = _engine(layout)
    got = collect_params(target, drafter, engine_param_specs(TINY_GLM5, layout))
    assert got.missing == [] and set(got.params) == set(engine_param_specs(TINY_GLM5, layout))
    assert got.aliases == {f"model.layers.{MTP}.shared_head.head.weight": "lm_head.weight"}
    assert got.not_in_specs == 2 * 5  # W_UK_T and W_UV of 4 decoder layers and the MTP layer
    p = got.params[f"model.layers.{MTP}.mtp_block.mlp.experts.routed_experts.w2_weight"]
    p.view(torch.uint8).fill_(7)  # a view of the real parameter: writing it updates the model
    mtp_layer = getattr(drafter.model.layers, str(MTP))
    assert bool((mtp_layer.mtp_block.mlp.experts.routed_experts.w2_weight.view(torch.uint8) == 7).all())
    assert not p.requires_grad


def test_layout_and_moe_parallel_checks():
    from glm_fp8.core.errors import EngineNotSupported
    from glm_fp8.engine import EngineLayout
    from glm_fp8.integrations.vllm.probe import check_moe_parallel, layout_from_parallel_config

    pc = SimpleNamespace(
        tensor_parallel_size=2,
        data_parallel_size=2,
        enable_expert_parallel=True,
        all2all_backend="allgather_reducescatter",
        pipeline_parallel_size=1,
    )
    lay = layout_from_parallel_config(pc, tp_rank=1, dp_rank=1)
    assert lay == EngineLayout(
        tp_size=2, tp_rank=1, dp_size=2, dp_rank=1, ep_size=4, ep_rank=3, sequence_parallel_moe=True
    )
    target, _ = _engine(lay)
    assert check_moe_parallel(lay, target) == 2  # the two sparse decoder layers
    with pytest.raises(EngineNotSupported, match="moe_parallel_config: the engine built"):
        check_moe_parallel(
            EngineLayout(tp_size=2, tp_rank=0, dp_size=2, dp_rank=1, ep_size=4, ep_rank=2), target
        )
    with pytest.raises(EngineNotSupported, match="pipeline_parallel_size=2"):
        layout_from_parallel_config(
            SimpleNamespace(**{**vars(pc), "pipeline_parallel_size": 2}), tp_rank=0, dp_rank=0
        )
    with pytest.raises(EngineNotSupported, match="enable_eplb"):
        layout_from_parallel_config(SimpleNamespace(**vars(pc), enable_eplb=True), tp_rank=0, dp_rank=0)


def test_backend_detection_and_the_plan_it_gives():
    from glm_fp8.core.errors import EngineNotSupported
    from glm_fp8.engine import EngineLayout
    from glm_fp8.integrations.vllm.probe import (
        deepgemm_requantized_linears,
        engine_postload_plan,
        moe_backends,
    )

    lay = EngineLayout()
    target, drafter = _engine(lay, "TRITON")
    assert (
        set(moe_backends(target, drafter).values()) == {"TRITON"} and len(moe_backends(target, drafter)) == 3
    )
    assert deepgemm_requantized_linears(target, drafter) == []
    assert engine_postload_plan(TINY_GLM5, target, drafter, deepgemm_e8m0=True).scale_fmt == "fp32"
    target, drafter = _engine(lay, "TRITON", deepgemm_linear=True)
    assert len(deepgemm_requantized_linears(target, drafter)) == 5  # q_b_proj of layers 0-3 and MTP
    assert engine_postload_plan(TINY_GLM5, target, drafter, deepgemm_e8m0=True).scale_fmt == "ue8m0"
    getattr(target.model.layers, "2").mlp.experts.routed_experts.quant_method.fp8_backend = "DEEPGEMM"
    with pytest.raises(EngineNotSupported, match="several fused-MoE backends"):
        engine_postload_plan(TINY_GLM5, target, drafter, deepgemm_e8m0=True)


def test_packed_scales_are_refused_with_their_name():
    from glm_fp8.core.errors import EngineNotSupported
    from glm_fp8.engine import EngineLayout
    from glm_fp8.integrations.vllm.probe import engine_postload_plan
    from glm_fp8.integrations.vllm.updater import EngineUpdater

    target, drafter = _engine(EngineLayout(), "DEEPGEMM")
    proj = getattr(target.model.layers, "0").self_attn.q_b_proj
    proj.weight_scale_inv = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.int32), requires_grad=False)
    plan = engine_postload_plan(TINY_GLM5, target, drafter, deepgemm_e8m0=True)
    with pytest.raises(EngineNotSupported, match="q_b_proj.weight_scale_inv: the engine holds torch.int32"):
        EngineUpdater(target, drafter, TINY_GLM5, EngineLayout(), plan)


# --- a real transfer ------------------------------------------------------------------------------


def _layouts(world):
    from glm_fp8.engine import EngineLayout

    return [EngineLayout(dp_size=2, dp_rank=r, ep_size=2, ep_rank=r) for r in range(world - 1)]


def _rank(rank, world, case):
    import glm_fp8
    from glm_fp8.engine import engine_params, take_shard
    from glm_fp8.engine.postload import mla_absorbed_ref
    from glm_fp8.kernels.reference import convert_layer_ref
    from glm_fp8.model.plans import plan_from_config
    from glm_fp8.model.trainer_layouts import strip_layer
    from glm_fp8.transfer import Sender

    whole = model_layer_ids(TINY_GLM5)
    glm_fp8.set_default_backend("torch")
    if rank == 0:
        sender = Sender(None, 0, config=TINY_GLM5, layer_ids=whole, rest=True, device="cpu")
        stats = sender.send_model(
            ((i, synthetic_layer(TINY_GLM5, i)) for i in whole), rest=synthetic_layer(TINY_GLM5, REST)
        )
        return stats.nbytes
    layout = _layouts(world)[rank - 1]
    upd = _updater(layout, deepgemm_linear=case == "deepgemm")
    if case == "deepgemm":  # the engine needs ue8m0, the trainer sends fp32
        try:
            upd.update(None, 0, scale_fmt="fp32", device="cpu")
        finally:
            assert all(bool((_bytes(p) == FILL).all()) for p in upd.engine.params.values())  # nothing written
    out = upd.update(None, 0, device="cpu")
    targets = {p.kernel_name: p for p in engine_params(TINY_GLM5, layout).values()}
    want = {}
    for i in [*whole, REST]:
        layer = strip_layer(synthetic_layer(TINY_GLM5, i), i)
        for kernel_name, full in convert_layer_ref(layer, i, plan_from_config(TINY_GLM5, i)).items():
            t = targets[kernel_name]
            want[t.name] = take_shard(full, t.shard).to(t.dtype)
    head = f"model.layers.{MTP}.shared_head.head.weight"
    assert not torch.equal(_bytes(want[head]), _bytes(want["lm_head.weight"]))
    want[head] = want["lm_head.weight"]  # one tensor; the target's lm_head lands last and stays
    for name, w in want.items():
        if "routed_experts.w13_weight" in name:
            w = _vllm_swap_w13_to_w31(w)
        if "routed_experts.w" in name and name.endswith("_scale_inv"):
            w = w.clamp(min=1e-10)
        assert torch.equal(_bytes(upd.engine.params[name]), _bytes(w)), f"{name}: bytes differ"
    mla = [m for model in (upd.target, upd.drafter) for m in model.modules() if isinstance(m, StandInMLA)]
    for m in mla:
        assert m.hook_calls == 1
        w_uk_t, w_uv = mla_absorbed_ref(m.kv_b_proj.weight, m.kv_b_proj.weight_scale_inv, TINY_GLM5, layout)
        assert torch.equal(m.W_UK_T, w_uk_t) and torch.equal(m.W_UV, w_uv) and m.W_UV.abs().sum() > 0
    return out, len(mla), len(want)


def test_an_update_lands_runtime_format_in_target_and_drafter_and_rebuilds_mla():
    results = launch(3, _rank, ("ok",), timeout_s=120)
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    for r in (1, 2):
        out, n_mla, n_params = results[r][1]
        assert n_mla == 5 and n_params > 100
        assert (
            out["layers"] == MTP + 2 and out["hooks"] == ["target", "drafter"] and out["scale_fmt"] == "fp32"
        )
        assert out["rewritten"] == 3 * 3  # w13, its scales and w2's scales of 2 sparse layers + MTP


def test_a_scale_format_the_engine_cannot_serve_stops_every_rank_at_the_manifest():
    results = launch(3, _rank, ("deepgemm",), timeout_s=60)
    assert results[0][0] == "ManifestMismatch" and "refused its parameters" in results[0][1], results[0]
    msgs = {r: f"{results[r][0]}: {results[r][1]}" for r in (1, 2)}
    assert any(
        "EngineNotSupported: scale_fmt='fp32'" in m and "must send scale_fmt='ue8m0'" in m
        for m in msgs.values()
    ), msgs
    assert all(m.startswith(("EngineNotSupported", "UpdateAborted")) for m in msgs.values()), msgs
