"""An update lands in SGLang 0.5.23's own GLM-5 model exactly as SGLang's own ``load_weights``
loads the same weights (skipped without SGLang 0.5.23; scripts/install_sglang_cpu.sh installs it).

Invariant: on every rank of an SGLang server at TP 2, TP 2 with EP 2, and attention DP 2 with EP 2,
every parameter of SGLang's ``GlmMoeDsaForCausalLM`` (its layers, fused-MoE and block-FP8 linear
parameters, in SGLang's shards) and MLA's derived ``w_kc`` / ``w_vc``, after glm_fp8 updates
(each rank receives its shard, ``SGLangLayout``: from one sender scattering, by broadcast (every
rank cuts its shard from whole entries), from two senders that
each hold half the experts as FSDP2 DTensors, or as three updates of which the last two are deltas;
and in one update with the two ranks of a vLLM server at DP 2 with EP 2, each of which then holds
glm_fp8's reference of vLLM's shards; for GLM-5's own config, whose indexer SGLang holds split;
and into a model whose shared expert SGLang fused into the routed experts' stacks) framed as
SGLang's weight-update
session frames a direct write (``begin_weight_update``: ``restore_weights_before_loading``; then
``end_weight_update`` with no ``load_weights`` run: ``post_load_weights`` and
``postprocess_weights``), holds the bytes that SGLang's ``load_weights`` of the same weights as a
block-FP8 checkpoint (per-expert names, ``weight_scale_inv``, each weight quantized alone by
glm_fp8's reference; of the last update's weights) followed by ``postprocess_weights`` gives it; a
delta update sends and receives under a tenth of the first, dense one. On Blackwell (SGLang's
DeepGEMM switches set: its own load requantizes to UE8M0 and packs the scales; or its experts in
FlashInfer TRT-LLM's order) the same holds of a server that loaded another checkpoint at start,
and a delta is refused at once. No session moves a parameter or ``w_kc`` / ``w_vc`` (SGLang's CUDA
graphs read them where they were captured). Both models start poisoned (0xFF),
so a byte either path leaves unwritten shows as a difference, and none is left unwritten by
SGLang's own load (the KV cache's ``k_scale`` / ``v_scale``, which no checkpoint here holds, keep
SGLang's defaults: its KV-cache method checks them). And ``engine_param_specs`` for the rank's
``SGLangLayout`` lists exactly the names, shapes and dtypes of the parameters SGLang built. Driven
by SGLang's own session code (its scheduler's ``SchedulerWeightUpdaterManager`` over the model
runner's ``WeightUpdater``, glm_fp8's loader as ``load_format``), every call succeeds and records
the update's weight version.

Real: SGLang's model classes, layers, weight loaders, post-load steps, parallel groups (gloo over
the server's ranks, placed from its published ``ServerArgs`` as SGLang's bootstrap places them).
Stood in: the device, and on Blackwell DeepGEMM's scale packing (``_blackwell``). The ranks are
CPU processes; SGLang's DSA indexer is built as on CUDA
(``dsa_indexer._is_cuda``, so that ``wk`` and ``weights_proj`` are fused into the bf16
``wk_weights_proj`` a GPU server holds), the rotary embedding takes its CPU path, and MLA's
``post_load_weights`` its CUDA (Hopper) branch (``deepseek_weight_loader._is_cuda``: bf16
``w_kc`` / ``w_vc`` from the block-FP8 ``kv_b_proj``).
"""

import contextlib
import importlib.metadata
import importlib.util
import io
import time
from datetime import timedelta

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang_cpu.sh)", allow_module_level=True)
if importlib.metadata.version("sglang") != "0.5.23":
    pytest.skip(
        f"written against SGLang 0.5.23's model classes, found {importlib.metadata.version('sglang')}",
        allow_module_level=True,
    )

from glm_fp8.integrations.sglang import KV_SCALES  # the KV cache's scales: no checkpoint holds them
from glm_fp8.model.families import REST
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.testing import free_ports, launch, synthetic_layer

# The tiny GLM-5 as a checkpoint's config.json: what SGLang reads beyond glm_fp8's keys.
CONFIG = {
    **TINY_GLM5,
    "num_nextn_predict_layers": 0,
    "indexer_rope_interleave": True,  # SGLang fuses the indexer's wk and weights_proj (GLM-5.2's config)
    "architectures": ["GlmMoeDsaForCausalLM"],
    "num_key_value_heads": TINY_GLM5["num_attention_heads"],
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "moe_layer_freq": 1,
    "index_topk": 64,
    # deepseek_yarn: SGLang's CPU rotary path for it needs no compiled op
    "rope_scaling": {
        "rope_type": "deepseek_yarn",
        "type": "deepseek_yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "rope_theta": 10000.0,
    },
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    },
}
# GLM-5's own config says nothing of the indexer's rotary: SGLang then holds its wk block-FP8 beside a
# bf16 weights_proj ("split"), which glm_fp8 sends so to SGLang ranks.
GLM5 = {k: v for k, v in CONFIG.items() if k != "indexer_rope_interleave"}
CONFIGS = {"glm-5.2": CONFIG, "glm-5": GLM5}
SERVERS = {
    "tp2": dict(tp_size=2),
    "tp2-ep2": dict(tp_size=2, ep_size=2),
    "attn-dp2-ep2": dict(tp_size=2, attn_dp_size=2, ep_size=2),
}


def _sglang_world(
    rank: int, server: dict, port: int, speculative: bool = False, blackwell: str | None = None
):
    """This process as TP rank ``rank`` of an SGLang server: its ServerArgs published, its groups
    over gloo, attention DP placed (distributed/bootstrap.py::_init_parallel_groups' order);
    ``speculative``: the server decodes with GLM-5's MTP layer as its EAGLE drafter; ``blackwell``:
    on an SM100 GPU with DeepGEMM, its MoE runner ``--moe-runner-backend`` (``_blackwell``)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    tp, dp = server["tp_size"], server.get("attn_dp_size", 1)
    init_distributed_environment(
        world_size=tp,
        rank=rank,
        local_rank=rank,
        backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )
    reset_context()
    args = ServerArgs(
        model_path="dummy",  # no checkpoint: the model is built from CONFIG
        tp_size=tp,
        ep_size=server.get("ep_size", 1),
        dp_size=dp,
        enable_dp_attention=dp > 1,
        pp_size=1,
        device="cpu",
        **(SPECULATIVE if speculative else {}),
        **({"moe_runner_backend": blackwell} if blackwell else {}),
    )
    publish(args, role="test", ranks=SpawnRanks(world_rank=rank))
    if blackwell:
        from sglang.srt.layers.moe.utils import initialize_moe_config

        _blackwell()
        initialize_moe_config()  # as the scheduler does after publishing: the runner every FusedMoE reads
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    set_global_server_args_for_scheduler(args)
    initialize_dp_attention(args)


def _model(cfg: dict, fused: int = 0, cls=None):
    """SGLang's GLM-5 model as its loader builds it (bf16 default dtype, block-FP8 quant config;
    ``fused``: the shared experts fused into the routed experts' stacks, as its loader decides on an
    NVIDIA GPU without EP), every byte poisoned but the KV cache's scales; ``cls``: another of
    SGLang's classes for it (its MTP drafter)."""
    import sglang.srt.layers.attention.dsa.dsa_indexer as dsa_indexer
    import sglang.srt.layers.rotary_embedding.base as rotary
    import sglang.srt.models.deepseek_common.deepseek_weight_loader as mla_loader
    import transformers
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.models.glm4_moe import GlmMoeDsaForCausalLM
    from sglang.srt.runtime_context import get_model

    rotary._is_cpu = True
    dsa_indexer._is_cuda, dsa_indexer.resolve_num_sms = True, lambda: 132
    mla_loader._is_cuda = True
    keys = {k: v for k, v in cfg.items() if k not in ("model_type", "quantization_config")}
    config = transformers.GlmMoeDsaConfig(**keys)
    config.rope_scaling = cfg["rope_scaling"]
    for k in ("moe_layer_freq", "topk_method", "indexer_rope_interleave", "n_group", "topk_group"):
        if k in cfg:
            setattr(config, k, cfg[k])
    config.quantization_config = cfg["quantization_config"]
    quant = Fp8Config(
        is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128]
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    shared = SharedExpertsConfig(num_fused_shared_experts=fused)
    try:
        with get_model().override(shared_experts=shared):  # as model_loader/loader.py builds it
            model = (cls or GlmMoeDsaForCausalLM)(config, quant_config=quant)
    finally:
        torch.set_default_dtype(default)
    model.shared_experts_config = shared
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(KV_SCALES):  # SGLang's own defaults: its KV-cache method checks them
                p.data.reshape(-1).view(torch.uint8).fill_(0xFF)
    return model


def _blackwell():
    """SGLang on an SM100 GPU with DeepGEMM (its default there), stood in on the CPU: SGLang's own
    switches (``deep_gemm_wrapper``: DeepGEMM enabled, UE8M0 scales, Blackwell; the device's SM for
    ``should_deepgemm_weight_requant_ue8m0``), so that SGLang's own dispatch picks DeepGEMM for its
    block-FP8 linears and its own ``process_weights_after_loading`` requantizes. DeepGEMM itself is
    not installed on a CPU: its packing of the scales (``get_mn_major_tma_aligned_packed_ue8m0_tensor``)
    is SGLang's own copy of DeepGEMM's torch reference
    (``fp8_utils._get_mn_major_tma_aligned_packed_ue8m0_tensor_torch_impl``), which imports two of
    DeepGEMM's helpers, given here as DeepGEMM defines them (csrc/utils/math.hpp: ``align``, and
    ``get_tma_aligned_size``, 16-byte alignment)."""
    import sys
    import types

    import sglang.srt.model_loader.utils as loader_utils
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.quantization import fp8_utils

    utils, layout = types.ModuleType("deep_gemm.utils"), types.ModuleType("deep_gemm.utils.layout")
    utils.align = lambda x, y: -(-x // y) * y
    utils.get_tma_aligned_size = lambda x, element_size: utils.align(x, 16 // element_size)
    layout.get_mn_major_tma_aligned_packed_ue8m0_tensor = (
        fp8_utils._get_mn_major_tma_aligned_packed_ue8m0_tensor_torch_impl
    )
    utils.layout = layout
    package = types.ModuleType("deep_gemm")
    package.utils = utils
    sys.modules.update({"deep_gemm": package, "deep_gemm.utils": utils, "deep_gemm.utils.layout": layout})
    deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = True
    deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0 = True
    deep_gemm_wrapper.DEEPGEMM_BLACKWELL = True
    loader_utils.get_device_sm = lambda: 100


def _started(model, config: dict) -> None:
    """``model`` as a running server holds it: SGLang's own load of another checkpoint than any update
    sends (``moved_layer``'s step 7), then its post-load step (on Blackwell: the requantization)."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from glm_fp8.testing import moved_layer

    model.load_weights(_checkpoint(config, lambda i: moved_layer(config, i, 7, layout="hf")))
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))


def _storage(model) -> dict[str, int]:
    """Where each parameter and MLA's derived ``w_kc`` / ``w_vc`` live: an update must leave them there
    (SGLang's decode CUDA graphs read them where they were captured; ``w_kc`` / ``w_vc`` exist once a
    load derived them)."""
    out = {n: p.data_ptr() for n, p in model.named_parameters()}
    return out | {n: t.data_ptr() for n, t in _derived(model).items()}


def _derived(model) -> dict[str, torch.Tensor]:
    """MLA's tensors ``post_load_weights`` derives (not parameters): every layer's ``w_kc``, ``w_vc``
    (the drafter's one decoder layer's)."""
    out = {}
    drafter = hasattr(model.model, "decoder")
    layers = (
        {"model.decoder": model.model.decoder}
        if drafter
        else {f"model.layers.{i}": layer for i, layer in enumerate(model.model.layers)}
    )
    for at, layer in layers.items():
        for name in ("w_kc", "w_vc"):
            t = getattr(layer.self_attn, name, None)
            if t is not None:
                out[f"{at}.self_attn.{name}"] = t
    return out


# The server decodes speculatively with the model's own MTP layer (SGLang's EAGLE on a NextN drafter).
SPECULATIVE = dict(
    speculative_algorithm="EAGLE",
    speculative_num_steps=1,
    speculative_eagle_topk=1,
    speculative_num_draft_tokens=2,
)


def _drafter(cfg: dict, target, fused: int = 0):
    """SGLang's MTP drafter (``GlmMoeDsaForCausalLMNextN``) as its draft worker builds it (inside the
    draft scopes of ``EagleDraftWorker``), every byte poisoned, then given ``target``'s embeddings and
    ``lm_head`` as the draft worker gives them (``set_embed_and_head``)."""
    from sglang.srt.layers.moe.utils import (
        draft_model_build_scope,
        speculative_moe_a2a_backend_context,
        speculative_moe_backend_context,
    )
    from sglang.srt.models.glm4_moe import GlmMoeDsaForCausalLMNextN
    from sglang.srt.speculative.draft_parallel import model_draft_parallel_spec, resolve_draft_parallel_layout
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_utils import draft_pp_context, draft_tp_context

    layout = resolve_draft_parallel_layout(
        model_draft_parallel_spec(None, spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE"))
    )
    scopes = (
        draft_tp_context(layout),
        draft_pp_context(),
        speculative_moe_backend_context(),
        speculative_moe_a2a_backend_context(),
        draft_model_build_scope(),
    )
    with contextlib.ExitStack() as stack:
        for scope in scopes:
            stack.enter_context(scope)
        model = _model(cfg, fused, cls=GlmMoeDsaForCausalLMNextN)
    torch.cuda.synchronize = torch.cuda.empty_cache = lambda *a, **k: None  # set_embed_and_head's, CPU
    model.set_embed_and_head(*target.get_embed_and_head())
    return model


def _compare(ours, theirs) -> dict:
    bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    same = lambda a, b: torch.equal(bits(a), bits(b))  # noqa: E731
    want = dict(theirs.named_parameters())
    differ = [n for n, p in ours.named_parameters() if not same(p, want[n])]
    derived_theirs = _derived(theirs)
    derived = _derived(ours)
    differ += [n for n in derived_theirs if n not in derived or not same(derived[n], derived_theirs[n])]
    poisoned = [n for n, p in want.items() if bool((bits(p) == 0xFF).all())]
    return {"differ": differ, "params": len(want), "derived": len(derived_theirs), "poisoned": poisoned}


# The non-layer tensors of two pipeline stages (link ranks 0 and 1): the embeddings on the first,
# the final norm and the head on the last, as Megatron-Core places them.
STAGE_REST = {"model.embed_tokens.weight": [0], "model.norm.weight": [1], "lm_head.weight": [1]}


def _senders_world(rank: int, senders: int, port: int):
    """Two or more senders: their own default group (FSDP2's mesh of the trainer), whose DTensors
    hold whole experts (``Shard(0)``) and replicated 1-D tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=senders)
    return DeviceMesh("cpu", torch.arange(senders))


def _layer(case: dict, i: int, step: int, mesh):
    """The trainer's tensors of layer ``i`` at ``step`` (0: ``synthetic_layer``; later: ``moved_layer``),
    in Hugging Face's module names, as DTensors over ``mesh`` when there are several senders."""
    from glm_fp8.testing import moved_layer

    sd = (
        synthetic_layer(case["config"], i, torch.bfloat16, "hf")
        if step == 0
        else moved_layer(case["config"], i, step, layout="hf")
    )
    if mesh is None:
        return sd
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {k: distribute_tensor(t, mesh, [Shard(0) if t.dim() >= 2 else Replicate()]) for k, t in sd.items()}


def _rank(rank, world, case, ports):
    import torch.distributed as dist

    from glm_fp8.engine import SGLangLayout, engine_param_specs, engine_params
    from glm_fp8.engine.sglang import sglang_params
    from glm_fp8.integrations.sglang import sglang_landing
    from glm_fp8.testing import moved_layer, reference_engine_params
    from glm_fp8.transfer import DeltaOptions, Receiver, Sender
    from glm_fp8.transfer.link import StoreLink
    from glm_fp8.transfer.pack import FULL

    dist.destroy_process_group()  # the launcher's world holds every rank: SGLang's holds its own
    server, n_senders, steps, delta = case["server"], case["senders"], case["steps"], case["delta"]
    config = case["config"]
    tp = server["tp_size"]
    layouts = SGLangLayout.all_sglang_ranks(
        tp, **{k: v for k, v in server.items() if k in ("attn_dp_size", "ep_size")}
    )
    vllm = case["vllm"]
    announced = layouts  # what the trainer says the server's ranks hold
    if case.get("announce") is not None:
        announced = SGLangLayout.all_sglang_ranks(tp, **case["announce"])
    kw = dict(
        config=config,
        layer_ids=list(range(config["num_hidden_layers"])),
        rest=True,
        device="cpu",
        # broadcast: every SGLang rank receives every entry whole and cuts its shard
        engines=[None] * n_senders + ([FULL] * tp if case["broadcast"] else announced) + vllm,
        senders=list(range(n_senders)),
    )
    stages = case.get("stages", False)
    if stages:  # two pipeline stages of one sender each: even layers and odd, a step of each
        kw.update(holders={**{i: [i % 2] for i in kw["layer_ids"]}, REST: STAGE_REST}, step_layers=2)
    many = n_senders > 1 and not stages
    mesh = _senders_world(rank, n_senders, ports[2]) if rank < n_senders and many else None
    if case["api"] and n_senders <= rank < n_senders + tp:  # the link is opened by glm_fp8's loader
        return _through_sessions(rank - n_senders, case, layouts, kw, ports)
    if case["api"] == "http" and rank == 0:
        return _through_http(case, layouts, kw, ports, mesh)
    link = StoreLink(
        "127.0.0.1",
        ports[0],
        rank,
        world,
        backend="gloo",
        timeout=timedelta(seconds=120),
        global_ranks=list(range(n_senders)),
    )
    if rank < n_senders:
        sender = Sender(link, 0, delta=DeltaOptions() if delta else None, **kw)
        sent = []
        for step in range(steps):
            mine = lambda i: not stages or i % 2 == rank  # noqa: E731 - this stage's layers
            layers = ((i, _layer(case, i, step, mesh) if mine(i) else {}) for i in kw["layer_ids"])
            rest = _layer(case, REST, step, mesh)
            if stages:
                rest = {k: t for k, t in rest.items() if rank in STAGE_REST[k]}
            sent.append(sender.send_model(layers, rest=rest).nbytes)
        if stages:
            assert max(map(len, sender.routes.steps)) == 2, sender.routes.steps
        return {"sent": sent}
    last = steps - 1
    weights = None if last == 0 else (lambda i: moved_layer(config, i, last, layout="hf"))
    if rank >= n_senders + tp:  # a vLLM rank in the same update: glm_fp8's reference of vLLM's shards
        layout = vllm[rank - n_senders - tp]
        params = {
            n: torch.full(p.shape, float("nan")).to(p.dtype) for n, p in engine_params(config, layout).items()
        }
        receiver = Receiver(link, 0, layout=layout, delta=delta, **kw)
        for _ in range(steps):
            receiver.load_into(params)
        ids = [*kw["layer_ids"], REST]
        # the same values in prime-rl's names, which the reference reads (the routing bias float32, as
        # Hugging Face's router holds it); one update: moved_layer has prime-rl's bf16 bias
        assert steps == 1
        layer = lambda i: synthetic_layer(config, i, bias_dtype=torch.float32)  # noqa: E731
        want = reference_engine_params(config, layout, ids, layer=layer)
        bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        differ = sorted(n for n, t in want.items() if not torch.equal(bits(params[n]), bits(t)))
        return {"layout": str(layout), "differ": differ, "params": len(want)}
    from sglang.srt.model_loader.loader import DefaultModelLoader, post_load_weights

    engine_rank = rank - n_senders
    _sglang_world(engine_rank, server, ports[1])
    layout = layouts[engine_rank]
    cpu = torch.device("cpu")
    theirs = _model(config, case["fused"])
    theirs.load_weights(_checkpoint(config, weights))
    DefaultModelLoader.postprocess_weights(theirs, cpu)

    ours = _model(config, case["fused"])
    receiver = Receiver(link, 0, layout=layout, delta=delta, **kw)
    received = []
    for _ in range(steps):  # each update in a session, as SGLang frames a direct write
        DefaultModelLoader.restore_weights_before_loading(ours, cpu)  # begin_weight_update
        stats = receiver.load_into(sglang_landing(ours, config, layout).params)
        post_load_weights(ours)  # end_weight_update, no load_weights having run
        DefaultModelLoader.postprocess_weights(ours, cpu)
        received.append(stats.nbytes)

    held = {n: p.data for n, p in theirs.named_parameters() if not n.endswith(KV_SCALES)}
    built = {n: (tuple(t.shape), t.dtype) for n, t in sglang_params(held, layout, case["fused"]).items()}
    specs = engine_param_specs(config, layout)
    out = _compare(ours, theirs)
    out.update(
        layout=str(layout),
        received=received,
        specs_differ=sorted(n for n in set(specs) | set(built) if specs.get(n) != built.get(n)),
    )
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _through_sessions(engine_rank: int, case: dict, layouts, kw: dict, ports) -> bytes:
    """An SGLang rank driven by SGLang's own weight-update session code: the scheduler's
    ``SchedulerWeightUpdaterManager`` (begin, ``update_weights_from_tensor`` with glm_fp8's loader as
    ``load_format`` and the payload serialized per TP rank as SGLang's clients send it, end) over the
    model runner's ``WeightUpdater``, as many times as the case has updates."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsFromTensorReqInput,
    )
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.utils import MultiprocessingSerializer

    from glm_fp8.integrations.sglang import LOADER
    from glm_fp8.integrations.sglang.loader import held_receive_bytes
    from glm_fp8.testing import moved_layer

    server, steps, config = case["server"], case["steps"], case["config"]
    blackwell = case.get("blackwell")
    _sglang_world(engine_rank, server, ports[1], blackwell=blackwell)
    cpu = torch.device("cpu")
    last = steps - 1
    weights = None if last == 0 else (lambda i: moved_layer(config, i, last, layout="hf"))
    theirs = _model(config, case["fused"])
    theirs.load_weights(_checkpoint(config, weights))
    from sglang.srt.model_loader.loader import DefaultModelLoader

    DefaultModelLoader.postprocess_weights(theirs, cpu)
    ours = _model(config, case["fused"])
    if blackwell:
        _started(ours, config)
        ue8m0 = sorted(n for n, p in ours.named_parameters() if getattr(p, "format_ue8m0", False))
        trtllm = [n for n, m in ours.named_modules() if getattr(m, "use_flashinfer_trtllm_moe", False)]
    runner = _runner(ours, engine_rank)
    where = _storage(ours)

    class Worker:  # the TP worker's two members the manager reads; deserialization is SGLang's own
        model_runner = runner
        deserialize_own_rank = TpModelWorker.deserialize_own_rank

        def weight_update_runners(self):
            return [("target", runner)]

    versions: list = []
    manager = SchedulerWeightUpdaterManager(
        tp_worker=Worker(),
        draft_worker=None,
        memory_saver_adapter=None,
        flush_cache=lambda **_: True,
        is_fully_idle=lambda: True,
        scheduler=SimpleNamespace(
            record_weight_version_change=lambda new_version: versions.append(new_version)
        ),
    )
    update = _sglang_update(case, layouts, kw, ports)
    # as a client serializes it, once per TP rank (by value: no shared memory, any host)
    serialized = [
        MultiprocessingSerializer.serialize(update.named_tensors(), output_str=True) for _ in layouts
    ]
    replies, held = [], []  # held: the receive buffers the loader holds after each call
    if case["api"] == "http":  # the calls as the server's routes made them, from the trainer's client
        requests, answers = case["boxes"][engine_rank]
        while (call := requests.get(timeout=240)) is not None:
            method, obj = call
            replies.append(getattr(manager, method)(obj))
            held.append(held_receive_bytes())
            answers.put((replies[-1].success, replies[-1].message, method))
    for step in range(steps if case["api"] is True else 0):
        replies.append(manager.begin_weight_update(BeginWeightUpdateReqInput(selector="target")))
        replies.append(
            manager.update_weights_from_tensor(
                UpdateWeightsFromTensorReqInput(
                    serialized_named_tensors=serialized, load_format=LOADER, weight_version=f"step-{step}"
                )
            )
        )
        held.append(held_receive_bytes())
        replies.append(manager.end_weight_update(EndWeightUpdateReqInput()))
    out = _compare(ours, theirs)
    out.update(
        layout=str(layouts[engine_rank]),
        received=[1] * steps,
        specs_differ=[],
        replies=[(r.success, r.message) for r in replies],
        versions=versions,
        held=held,
        moved=sorted(n for n, ptr in _storage(ours).items() if where.get(n, ptr) != ptr),
    )
    if blackwell:  # what SGLang's own load requantized (theirs) and runs with TRT-LLM
        out.update(
            ue8m0=ue8m0,
            ue8m0_theirs=sorted(n for n, p in theirs.named_parameters() if getattr(p, "format_ue8m0", False)),
            trtllm=trtllm,
            int32=sorted(n for n, p in ours.named_parameters() if p.dtype == torch.int32),
        )
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _runner(model, engine_rank: int):
    """A model runner as SGLang's session code reads it: its ``WeightUpdater`` over ``model``, with
    glm_fp8's loader listed as a custom weight loader."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from glm_fp8.integrations.sglang import LOADER

    updater = WeightUpdater(
        tp_rank=engine_rank,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders=[LOADER],
        get_model=lambda: model,
        update_model_fields=lambda **_: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: None,
    )
    return SimpleNamespace(weight_updater=updater)


def _sglang_update(case: dict, layouts, kw: dict, ports):
    from glm_fp8.integrations.sglang import SGLangUpdate

    return SGLangUpdate(
        host="127.0.0.1",
        port=ports[0],
        rank_offset=case["senders"],
        world_size=case["senders"] + len(layouts),
        config=case["config"],
        layer_ids=kw["layer_ids"],
        engines=kw["engines"],
        senders=kw["senders"],
        rest=kw["rest"],
        delta=case["delta"],
        timeout_s=120,
        holders=kw.get("holders"),
        step_layers=kw.get("step_layers", 1),
    )


class _TokenizerManager:
    """What SGLang's HTTP routes call (its ``TokenizerManager``'s methods of a weight update),
    standing in for its fan-out to the scheduler processes over ZMQ: each call goes to every rank's
    ``SchedulerWeightUpdaterManager`` through a queue, their answers merged as SGLang merges them
    (``FanOutCommunicator.merge_results``); the payload normalized by SGLang's own function first."""

    def __init__(self, boxes):
        self.boxes, self.calls, self.paused = boxes, [], False

    def _fan_out(self, method: str, obj):
        for requests, _ in self.boxes:
            requests.put((method, obj))
        answers = [answers.get(timeout=240) for _, answers in self.boxes]
        self.calls.append(method)
        return all(ok for ok, _, _ in answers), " | ".join(m for _, m, _ in answers)

    async def pause_generation(self, obj):
        self.paused = True
        self.calls.append(f"pause_generation:{obj.mode}")

    async def continue_generation(self, obj):
        self.paused = False
        self.calls.append("continue_generation")

    async def begin_weight_update(self, obj, request=None):
        import asyncio

        return await asyncio.to_thread(self._fan_out, "begin_weight_update", obj)

    async def end_weight_update(self, obj, request=None):
        import asyncio

        return await asyncio.to_thread(self._fan_out, "end_weight_update", obj)

    async def update_weights_from_tensor(self, obj, request=None):
        import asyncio

        from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

        obj.serialized_named_tensors = normalize_serialized_named_tensor_payloads(
            obj.serialized_named_tensors
        )
        return await asyncio.to_thread(self._fan_out, "update_weights_from_tensor", obj)


def _through_http(case: dict, layouts, kw: dict, ports, mesh) -> dict:
    """Trainer rank 0 with SGLang's own HTTP server in front of the SGLang ranks: its FastAPI app
    (routes, request models, auth) served by uvicorn on a port of this process, its tokenizer
    manager stood in (``_TokenizerManager``). Per step: ``start_update`` (one server's
    ``SGLangUpdateCall``) over ``SGLangHttpClient`` beside ``send_model``; then a call against a
    wrong URL fails naming it."""
    import threading

    import uvicorn
    from sglang.srt.entrypoints import http_server

    from glm_fp8.core.errors import EngineCallFailed
    from glm_fp8.integrations.sglang import SGLangHttpClient, start_update
    from glm_fp8.transfer import DeltaOptions, Sender
    from glm_fp8.transfer.link import StoreLink

    manager = _TokenizerManager(case["boxes"])
    http_server.set_global_state(http_server._GlobalState(manager, None, {}))
    server = uvicorn.Server(
        uvicorn.Config(http_server.app, port=ports[3], lifespan="off", log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    client = SGLangHttpClient(f"http://127.0.0.1:{ports[3]}", timeout_s=200)
    update = _sglang_update(case, layouts, kw, ports)
    link = sender = None
    sent, messages, failed = [], [], []
    for step in range(case["steps"]):
        [call] = start_update([(client, update)], weight_version=f"step-{step}", link=link)
        if link is None:  # the SGLang ranks join the link in their first call: after it started
            link = call.link = StoreLink(
                "127.0.0.1", ports[0], 0, len(kw["engines"]), backend="gloo", timeout=timedelta(seconds=120)
            )
            sender = Sender(link, 0, delta=DeltaOptions() if case["delta"] else None, **kw)
        layers = ((i, _layer(case, i, step, mesh)) for i in kw["layer_ids"])
        t0 = time.monotonic()
        try:
            sent.append(sender.send_model(layers, rest=_layer(case, REST, step, mesh)).nbytes)
            messages.append(call.finish(200))
        except Exception as exc:  # noqa: BLE001 - a refused update: every side's account
            failed.append((type(exc).__name__, str(exc), time.monotonic() - t0))
            try:
                failed.append(("answered", call.join(200), None))
            except EngineCallFailed as call_exc:
                failed.append((type(call_exc).__name__, str(call_exc), call_exc.answered))
            break
    for requests, _ in case["boxes"]:
        requests.put(None)
    try:
        SGLangHttpClient(f"http://127.0.0.1:{ports[3]}/no-such-prefix", timeout_s=10).begin_weight_update()
        wrong = ""
    except EngineCallFailed as exc:
        wrong = str(exc)
    server.should_exit = True
    return {
        "sent": sent,
        "calls": manager.calls,
        "paused": manager.paused,
        "messages": messages,
        "wrong": wrong,
        "failed": failed,
    }


def _checkpoint(config: dict, weights):
    """SGLang's own load's input: the block-FP8 checkpoint, its indexer wk quantized too where SGLang
    holds it split (its block-FP8 linear loads the FP8 weight and its scale)."""
    from glm_fp8.engine.sglang import sglang_indexer_form
    from glm_fp8.testing import FP8_IN_CHECKPOINT, block_fp8_checkpoint

    split = sglang_indexer_form(config) == "split"
    fp8 = (*FP8_IN_CHECKPOINT, "wk") if split else FP8_IN_CHECKPOINT
    return block_fp8_checkpoint(config, torch.bfloat16, weights, fp8=fp8)


def _vllm_layouts(name: str | None):
    from glm_fp8.engine import EngineLayout

    return [] if name is None else EngineLayout.all_ranks(1, 2, True)  # vLLM at DP 2 with EP


CASES = {
    "tp2": dict(server="tp2"),
    "tp2-ep2": dict(server="tp2-ep2"),
    "attn-dp2-ep2": dict(server="attn-dp2-ep2"),
    "two senders into attn-dp2-ep2": dict(server="attn-dp2-ep2", senders=2),
    "two pipeline stages, a layer of each a step, through SGLang's session API": dict(
        server="attn-dp2-ep2", senders=2, stages=True, api=True
    ),
    "deltas into tp2-ep2": dict(server="tp2-ep2", steps=3, delta=True),
    "tp2 beside a vLLM ep2 server": dict(server="tp2", vllm="ep2"),
    # GLM-5: the vLLM ranks hold the indexer fused, the SGLang ranks split: each takes its own form
    "GLM-5's split indexer, tp2 beside a vLLM ep2 server": dict(server="tp2", vllm="ep2", config="glm-5"),
    "SGLang's session API, two updates into attn-dp2-ep2": dict(server="attn-dp2-ep2", steps=2, api=True),
    "SGLang's HTTP routes and glm_fp8's client, a dense update then a delta into attn-dp2-ep2": dict(
        server="attn-dp2-ep2", steps=2, delta=True, api="http"
    ),
    "GLM-5's split indexer, deltas into tp2": dict(server="tp2", steps=2, delta=True, config="glm-5"),
    "GLM-5's split indexer through SGLang's session API": dict(server="tp2-ep2", api=True, config="glm-5"),
    # SGLang's default on an NVIDIA GPU without EP: the shared expert as the routed experts' last
    "a fused shared expert, deltas into tp2": dict(server="tp2", steps=2, delta=True, fused=1),
    "broadcast into tp2-ep2": dict(server="tp2-ep2", broadcast=True),
    "a fused shared expert through SGLang's session API": dict(
        server="tp2", api=True, fused=1, config="glm-5"
    ),
    # Blackwell: SGLang requantized its block-FP8 linears and (DeepGEMM's runner) its experts to UE8M0
    "Blackwell with DeepGEMM's MoE runner, two updates through SGLang's session API into tp2-ep2": dict(
        server="tp2-ep2", api=True, steps=2, blackwell="deep_gemm"
    ),
    # Blackwell's default for GLM-5's experts: FlashInfer TRT-LLM ([w3; w1], float32 scales)
    "Blackwell with FlashInfer TRT-LLM's experts, GLM-5's split indexer, through SGLang's sessions": dict(
        server="tp2", api=True, blackwell="flashinfer_trtllm", config="glm-5"
    ),
    # SGLang's default for GLM-5 on SM100 without EP: TRT-LLM's experts, the shared expert fused in
    "Blackwell's default, TRT-LLM's experts with the shared expert fused in, through SGLang's sessions": dict(
        server="tp2", api=True, blackwell="flashinfer_trtllm", fused=1
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_update_lands_in_sglangs_glm5_model_as_sglangs_own_load_weights(name):
    spec = CASES[name]
    case = dict(
        server=SERVERS[spec["server"]],
        senders=spec.get("senders", 1),
        steps=spec.get("steps", 1),
        delta=spec.get("delta", False),
        vllm=_vllm_layouts(spec.get("vllm")),
        api=spec.get("api", False),
        config=CONFIGS[spec.get("config", "glm-5.2")],
        fused=spec.get("fused", 0),
        broadcast=spec.get("broadcast", False),
        stages=spec.get("stages", False),
        blackwell=spec.get("blackwell"),
    )
    tp, n_senders = case["server"]["tp_size"], case["senders"]
    world = n_senders + tp + len(case["vllm"])
    if case["api"] == "http":  # the calls' way from the routes to each rank's session code
        import torch.multiprocessing as mp

        ctx = mp.get_context("forkserver")
        case["boxes"] = [(ctx.Queue(), ctx.Queue()) for _ in range(tp)]
    results = launch(world, _rank, (case, free_ports(4)), timeout_s=300)
    assert all(status == "ok" for status, _ in results.values()), results
    sent = [results[r][1]["sent"] for r in range(n_senders)]
    assert all(s[0] > 0 for s in sent), sent
    for r in range(n_senders, n_senders + tp):
        out = torch.load(io.BytesIO(results[r][1]), weights_only=False)
        assert out["specs_differ"] == [], (out["layout"], out["specs_differ"])
        assert out["differ"] == [], (out["layout"], out["differ"])
        assert out["derived"] == 2 * case["config"]["num_hidden_layers"], out
        assert out["poisoned"] == [], out["poisoned"]
        assert out["params"] > 50 and out["received"][0] > 0
        if case["api"]:  # every call of SGLang's session succeeded; each update recorded its version
            assert all(ok for ok, _ in out["replies"]), out["replies"]
            assert len(out["replies"]) == 3 * case["steps"], out["replies"]
            assert out["versions"] == [f"step-{k}" for k in range(case["steps"])], out["versions"]
            assert out["held"] and set(out["held"]) == {0}, out["held"]  # the ring given back each time
            assert out["moved"] == [], out["moved"]  # every tensor where SGLang's CUDA graphs read it
        if case[
            "blackwell"
        ]:  # SGLang requantized every block-FP8 parameter of this model, again after each update
            assert out["ue8m0"] == out["ue8m0_theirs"] and len(out["ue8m0"]) >= 10, out["ue8m0"]
            assert out["int32"] == out["ue8m0"], out["int32"]  # each packed, as SGLang's own load leaves it
            experts = [n for n in out["ue8m0"] if ".mlp.experts." in n]
            assert bool(experts) == (case["blackwell"] == "deep_gemm"), experts
            assert bool(out["trtllm"]) == (case["blackwell"] == "flashinfer_trtllm"), out["trtllm"]
        if case["delta"] and not case["api"]:  # the first update dense, then only what changed (sent: below)
            assert all(0 < n < out["received"][0] / 10 for n in out["received"][1:]), out["received"]
    if case["api"] == "http":  # the routes in SGLang's order, every update's; generation resumed
        out = results[0][1]
        session = ["begin_weight_update", "update_weights_from_tensor", "end_weight_update"]
        want = ["pause_generation:retract", *session, "continue_generation"] * case["steps"]
        assert out["calls"] == want and not out["paused"], out["calls"]
        assert len(out["messages"]) == case["steps"], out["messages"]
        assert "/no-such-prefix: POST /begin_weight_update answered 404: Not Found" in out["wrong"], out[
            "wrong"
        ]
    for r in range(n_senders + tp, world):
        out = results[r][1]
        assert out["differ"] == [] and out["params"] > 50, out
    if case["delta"]:
        assert all(0 < n < s[0] / 10 for s in sent for n in s[1:]), sent


def _refused_through_http(server: str, **kw) -> str:
    """One update from one sender through SGLang's HTTP routes into a TP 2 server, which every rank
    refuses at the manifest: the sender raises within seconds (its message returned) and nothing is
    sent; SGLang answers every call of the session (the loader returned: its server lives on) and
    generation stays paused (the trainer calls ``join``, not ``finish``)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    case = dict(
        server=SERVERS[server],
        senders=1,
        steps=1,
        delta=False,
        vllm=[],
        api="http",
        config=CONFIG,
        fused=0,
        broadcast=False,
        boxes=[(ctx.Queue(), ctx.Queue()) for _ in range(2)],
    )
    results = launch(3, _rank, ({**case, **kw}, free_ports(4)), timeout_s=300)
    assert all(status == "ok" for status, _ in results.values()), results
    out = results[0][1]
    assert out["sent"] == [] and len(out["failed"]) == 2, out
    (kind, text, seconds), (call_kind, _, _) = out["failed"]
    assert kind == "ManifestMismatch" and "refused its parameters" in text and seconds < 30, out
    assert call_kind == "answered", out["failed"]  # SGLang's account: the loader returned
    session = ["begin_weight_update", "update_weights_from_tensor", "end_weight_update"]
    assert out["calls"] == ["pause_generation:retract", *session] and out["paused"], out["calls"]
    for r in (1, 2):  # every rank's server lives on: each call of its session answered
        replies = torch.load(io.BytesIO(results[r][1]), weights_only=False)["replies"]
        assert [ok for ok, _ in replies] == [True, True, True], replies
    return text


def test_a_refusal_through_sglangs_http_routes_stops_every_rank_and_leaves_generation_paused():
    """The trainer announces the ranks of a TP 2 server to a server of TP 2 with EP 2: each SGLang
    rank's loader finds its layout other than announced, and every rank votes on it before any
    layer; the sender raises within seconds naming the rank. The loader does not raise (SGLang
    0.5.23 would stop its server), so SGLang answers the call as a success; its session is ended
    and generation stays paused (the trainer calls ``join``, not ``finish``)."""
    text = _refused_through_http("tp2-ep2", announce={})  # announced: all_sglang_ranks(2), TP 2 without EP
    assert "layout: expected engines[" in text, text


def test_a_delta_update_into_a_blackwell_server_is_refused_at_once_naming_its_requantization():
    """SGLang on Blackwell requantizes the landed bytes (DeepGEMM's UE8M0 scales), so its parameters
    no longer hold what a delta update rebuilds the last update from: every rank's loader refuses
    ``delta=True`` at the manifest, the sender raises within seconds naming it, and the server's
    session calls all answer (generation stays paused)."""
    text = _refused_through_http("tp2", delta=True, blackwell="deep_gemm")
    assert "SGLangUpdate.delta" in text and "UE8M0" in text and "delta=False" in text, text


def _published_layout(rank, world, args: dict, tp_rank: int):
    """The layout ``sglang_rank_layout`` reads where SGLang published ``ServerArgs(**args)`` for TP rank
    ``tp_rank``, or the refusal's class and message."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    from glm_fp8.integrations.sglang import sglang_rank_layout

    reset_context()
    publish(
        ServerArgs(model_path="dummy", device="cpu", **args),
        role="test",
        ranks=SpawnRanks(world_rank=tp_rank),
    )
    try:
        return sglang_rank_layout()
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        return type(e).__name__, str(e)


@pytest.mark.parametrize(
    "args, tp_rank, want",
    [
        (dict(tp_size=4, ep_size=4, dp_size=2, enable_dp_attention=True), 3, dict(attn_dp_size=2, ep_size=4)),
        (dict(tp_size=2), 1, {}),
        (
            dict(tp_size=2, moe_dense_tp_size=1, moe_a2a_backend="deepep", ep_size=2),
            0,
            dict(ep_size=2, moe_dense_tp_size=1, moe_a2a_backend="deepep"),
        ),
        (dict(tp_size=2, ep_size=2, ep_num_redundant_experts=2), 1, "--ep-num-redundant-experts"),
    ],
)
def test_each_rank_reads_its_layout_from_sglangs_published_server_args(args, tp_rank, want):
    from glm_fp8.engine import SGLangLayout

    got = launch(1, _published_layout, (args, tp_rank), timeout_s=120)[0]
    assert got[0] == "ok", got
    if isinstance(want, str):
        assert got[1][0] == "EngineNotSupported" and want in got[1][1], got
        return
    assert got[1] == SGLangLayout.from_sglang(args["tp_size"], tp_rank, **want), got


# GLM-5.2 with its MTP layer (layer 4): the server's drafter decodes with it.
MTP_CONFIG = {**CONFIG, "num_nextn_predict_layers": 1}


def _drafter_rank(rank, world, ports, steps, speculative=True, wrong_layouts=False, fused=0, blackwell=None):
    """Trainer rank 0: per step the target's update (the decoder layers and the non-layer tensors),
    then the drafter's (the MTP layer) on the same link, both deltas after the first. SGLang ranks
    1 and 2 (TP 2 with EP 2, ``speculative``): SGLang's session code with a draft worker beside the
    TP worker, its calls with selector "all", so that SGLang runs glm_fp8's loader for the target,
    then for the drafter; without ``speculative``, no draft worker and no drafter.
    ``wrong_layouts``: the trainer announces the ranks of a TP 2 server without EP. ``fused``: a TP 2
    server without EP whose models (target and drafter) fuse the shared expert into the routed
    experts' stacks, as SGLang's loader decides on an NVIDIA GPU without EP. ``blackwell``: the
    server on Blackwell with that MoE runner (``_blackwell``), its updates dense."""
    import torch.distributed as dist

    from glm_fp8.engine import SGLangLayout
    from glm_fp8.integrations.sglang import SGLangUpdate
    from glm_fp8.transfer import DeltaOptions, Sender
    from glm_fp8.transfer.link import StoreLink

    dist.destroy_process_group()
    config, mtp = MTP_CONFIG, MTP_CONFIG["num_hidden_layers"]
    case = {"config": config}
    layouts = SGLangLayout.all_sglang_ranks(2, **({} if wrong_layouts or fused else {"ep_size": 2}))
    ids = list(range(mtp))  # the target's layers: the MTP layer goes in the drafter's update
    update = SGLangUpdate(
        host="127.0.0.1",
        port=ports[0],
        rank_offset=1,
        world_size=3,
        config=config,
        layer_ids=ids,
        engines=[None, *layouts],
        delta=blackwell is None,
        timeout_s=120,
        drafter=True,
    )
    if rank == 0:
        link = StoreLink("127.0.0.1", ports[0], 0, 3, backend="gloo", timeout=timedelta(seconds=120))
        kw = dict(config=config, device="cpu", delta=DeltaOptions() if update.delta else None)
        sender = Sender(link, 0, layer_ids=ids, rest=True, engines=update.engines, **kw)
        draft = update.drafter_update()
        drafter_sender, sent = None, []
        for step in range(steps):
            layers = ((i, _layer(case, i, step, None)) for i in ids)
            t0 = time.monotonic()
            try:
                target_bytes = sender.send_model(layers, rest=_layer(case, REST, step, None)).nbytes
            except Exception as exc:  # noqa: BLE001 - a refused update: its account
                return {"failed": (type(exc).__name__, str(exc), time.monotonic() - t0)}
            if (
                drafter_sender is None
            ):  # as each SGLang rank builds the drafter's receiver: after the target's
                drafter_sender = Sender(link, 0, layer_ids=list(draft.layer_ids), engines=draft.engines, **kw)
            mtp_layer = [(mtp, _layer(case, mtp, step, None))]
            sent.append((target_bytes, drafter_sender.send_model(mtp_layer).nbytes))
        return {"sent": sent}
    compare = speculative and not wrong_layouts  # a refused update: only the calls' outcome
    return _drafter_sessions(
        rank - 1,
        update,
        steps,
        ports,
        speculative=speculative,
        compare=compare,
        fused=fused,
        blackwell=blackwell,
    )


def _drafter_sessions(
    engine_rank: int,
    update,
    steps: int,
    ports,
    *,
    speculative: bool,
    compare: bool,
    fused: int = 0,
    blackwell: str | None = None,
):
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsFromTensorReqInput,
    )
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.utils import MultiprocessingSerializer

    from glm_fp8.engine import engine_param_specs
    from glm_fp8.engine.sglang import sglang_params
    from glm_fp8.integrations.sglang import LOADER
    from glm_fp8.integrations.sglang.loader import DRAFTER_TARGETS
    from glm_fp8.testing import moved_layer

    config = MTP_CONFIG
    server = SERVERS["tp2" if fused else "tp2-ep2"]
    _sglang_world(engine_rank, server, ports[1], speculative=speculative, blackwell=blackwell)
    cpu = torch.device("cpu")
    weights = None if steps == 1 else (lambda i: moved_layer(config, i, steps - 1, layout="hf"))
    theirs = _model(config, fused)
    theirs_drafter = _drafter(config, theirs, fused)
    for model in (theirs, theirs_drafter):  # SGLang's own load of the checkpoint, the drafter's too
        model.load_weights(_checkpoint(config, weights))
        DefaultModelLoader.postprocess_weights(model, cpu)
    ours = _model(config, fused)
    ours_drafter = _drafter(config, ours, fused)
    if blackwell:
        for model in (ours, ours_drafter):
            _started(model, config)

    target_runner, draft_runner = _runner(ours, engine_rank), _runner(ours_drafter, engine_rank)
    where = [_storage(ours), _storage(ours_drafter)]

    class Worker:  # the TP worker's members the manager reads; deserialization is SGLang's own
        model_runner = target_runner
        deserialize_own_rank = TpModelWorker.deserialize_own_rank

        def weight_update_runners(self):
            return [("target", target_runner)]

    class DraftWorker:  # BaseSpecWorker.weight_update_runners
        def weight_update_runners(self):
            return [("draft", draft_runner)]

    versions: list = []
    manager = SchedulerWeightUpdaterManager(
        tp_worker=Worker(),
        draft_worker=DraftWorker() if speculative else None,
        memory_saver_adapter=None,
        flush_cache=lambda **_: True,
        is_fully_idle=lambda: True,
        scheduler=SimpleNamespace(
            record_weight_version_change=lambda new_version: versions.append(new_version)
        ),
    )
    serialized = [MultiprocessingSerializer.serialize(update.named_tensors(), output_str=True)] * 2
    replies, t0 = [], time.monotonic()
    for step in range(steps):
        replies.append(manager.begin_weight_update(BeginWeightUpdateReqInput(selector="all")))
        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=serialized,
            load_format=LOADER,
            weight_version=f"step-{step}",
            selector="all",
        )
        replies.append(manager.update_weights_from_tensor(request))
        replies.append(manager.end_weight_update(EndWeightUpdateReqInput()))
    if not compare:
        return {"replies": [(r.success, r.message) for r in replies], "seconds": time.monotonic() - t0}
    layout = update.engines[update.rank_offset + engine_rank].drafter_layout
    held = {
        n: p.data
        for n, p in theirs_drafter.named_parameters()
        if not n.endswith(KV_SCALES) and n not in DRAFTER_TARGETS
    }
    built = {n: (tuple(t.shape), t.dtype) for n, t in sglang_params(held, layout, fused).items()}
    specs = engine_param_specs(config, layout)
    out = {
        "target": _compare(ours, theirs),
        "drafter": _compare(ours_drafter, theirs_drafter),
        "shared": ours_drafter.lm_head.weight is ours.lm_head.weight,
        # the drafter's expert stack: the routed experts, then the fused shared expert's slot
        "stack": ours_drafter.model.decoder.mlp.experts.w13_weight.shape[0],
        # the checkpoint's shapes: on Blackwell SGLang has repacked the requantized scales since
        "specs_differ": []
        if blackwell
        else sorted(n for n in set(specs) | set(built) if specs.get(n) != built.get(n)),
        "replies": [(r.success, r.message) for r in replies],
        "versions": versions,
        "ue8m0": [
            sum(getattr(p, "format_ue8m0", False) for p in m.parameters()) for m in (ours, ours_drafter)
        ],
        "moved": [
            sorted(n for n, ptr in _storage(m).items() if w.get(n, ptr) != ptr)
            for m, w in zip((ours, ours_drafter), where)
        ],
    }
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    "fused, blackwell",
    [(0, None), (1, None), (0, "deep_gemm")],
    ids=["tp2-ep2", "tp2 fused shared expert", "tp2-ep2 on Blackwell, dense"],
)
def test_the_mtp_drafter_takes_the_mtp_layer_through_sglangs_session_api(fused, blackwell):
    """A speculative server (TP 2 with EP 2; or TP 2 whose models fuse the shared expert into the
    routed experts' stacks): SGLang's session code runs glm_fp8's loader for the target, then for
    its MTP drafter (``SGLangUpdate(drafter=True)``: selector "all"); the trainer sends the
    target's update, then the drafter's on the same link. After a dense update and a delta, every
    parameter of both models (the drafter's embeddings and ``lm_head`` the target's) and both
    models' ``w_kc`` / ``w_vc`` equal SGLang's own load of the same block-FP8 checkpoint, and
    ``engine_param_specs`` of the drafter's layout lists exactly what SGLang built. On Blackwell
    (DeepGEMM's UE8M0 scales in both models, the updates dense), the same after two updates."""
    steps = 2
    results = launch(3, _drafter_rank, (free_ports(2), steps, True, False, fused, blackwell), timeout_s=300)
    assert all(status == "ok" for status, _ in results.values()), results
    sent = results[0][1]["sent"]
    assert all(t > 0 and d > 0 for t, d in sent), sent
    if blackwell is None:  # the second: deltas
        assert sent[1][0] < sent[0][0] / 10 and sent[1][1] < sent[0][1] / 10, sent
    for r in (1, 2):
        out = torch.load(io.BytesIO(results[r][1]), weights_only=False)
        assert out["specs_differ"] == [], out["specs_differ"]
        for model in ("target", "drafter"):
            got = out[model]
            assert got["differ"] == [] and got["poisoned"] == [], (model, got)
        assert (
            out["target"]["derived"] == 2 * MTP_CONFIG["num_hidden_layers"] and out["drafter"]["derived"] == 2
        )
        assert out["shared"] and out["drafter"]["params"] > 30
        assert out["stack"] == MTP_CONFIG["n_routed_experts"] // (1 if fused else 2) + fused, out["stack"]
        assert all(ok for ok, _ in out["replies"]) and len(out["replies"]) == 3 * steps, out["replies"]
        assert out["versions"] == [f"step-{k}" for k in range(steps)], out["versions"]
        assert all(n >= 5 for n in out["ue8m0"]) if blackwell else out["ue8m0"] == [0, 0], out["ue8m0"]
        assert out["moved"] == [[], []], out["moved"]  # both models' tensors where CUDA graphs read them


def test_a_drafters_update_into_a_server_without_one_is_refused_at_once():
    """``drafter=True`` into a server that decodes without a drafter: each SGLang rank's loader
    refuses it in the target's call (no drafter would take the MTP layer, and the trainer would
    wait for it), voted with the manifest: the sender raises within seconds naming the setting,
    and every call of SGLang's session succeeds (the loader never raises)."""
    results = launch(3, _drafter_rank, (free_ports(2), 1, False), timeout_s=300)
    assert all(status == "ok" for status, _ in results.values()), results
    kind, text, seconds = results[0][1]["failed"]
    assert kind == "ManifestMismatch" and "runs no speculative decoding" in text and seconds < 30, text
    for r in (1, 2):
        assert [ok for ok, _ in results[r][1]["replies"]] == [True, True, True], results[r][1]


def test_a_refused_target_update_ends_the_drafters_call_at_once():
    """A speculative server refuses the target's update (the trainer announced other layouts): every
    rank stops at the manifest, the trainer sends no drafter's update, and the loader's call for
    the drafter, which SGLang still makes in the same call, returns at once instead of waiting for
    it until the link's timeout (120 s here)."""
    results = launch(3, _drafter_rank, (free_ports(2), 1, True, True), timeout_s=300)
    assert all(status == "ok" for status, _ in results.values()), results
    kind, text, seconds = results[0][1]["failed"]
    assert kind == "ManifestMismatch" and "layout: expected engines[" in text and seconds < 30, text
    for r in (1, 2):
        out = results[r][1]
        assert [ok for ok, _ in out["replies"]] == [True, True, True] and out["seconds"] < 60, out
