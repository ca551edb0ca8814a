"""An update through the backend lands in vLLM 0.34's own GLM-5 model exactly as vLLM's own
``load_weights`` loads the same weights (skipped without vLLM 0.34).

Invariant: on every engine rank (TP 2, EP 2, and TP 2 x DP 2), every parameter of vLLM's
``GlmMoeDsaForCausalLM`` (the class a GPU engine builds: ``vllm/models/deepseek_v32/nvidia/``; its
layers, fused-MoE and block-FP8 linear parameters, in vLLM's TP / EP shards), after a glm_fp8
update and vLLM's post-reload hooks, holds the bytes that vLLM's ``load_weights`` of the same
weights as a block-FP8 checkpoint (per-expert names, ``weight_scale_inv``) followed by the same
hooks gives it, in every transfer mode, from bf16 weights and from fp32 masters (the checkpoint
then quantized from the fp32 values by glm_fp8's reference, with no cast: nothing in the expected
bytes goes through glm_fp8's transfer), and from transformers' own GLM-5 model (its routing bias a
buffer, FSDP2-style DTensors over two trainer ranks) through glm_fp8's ``ModuleStateSource``. So
does every parameter of vLLM's MTP drafter
(``DeepseekV32MTP``, built by vLLM's ``load_eagle_model``, which makes its embedding and head the
target's) after vLLM's draft session. Both models start poisoned (NaN / 0xFF), so a byte either
path leaves unwritten shows as a difference unless both leave it (vLLM's vocabulary padding). And
glm_fp8's ``engine_param_specs`` for the rank's layout lists exactly the names, shapes and dtypes
of the parameters vLLM built.

Real: vLLM's model classes, layers, weight loaders, parallel groups (gloo over the engine ranks;
DP replicas in one world under ``external_launcher``, as torchrun starts them),
``VllmConfig`` / ``ModelConfig`` from a config.json, weight-transfer factories; glm_fp8's backend.
Stood in: the CUDA platform (vllm_standin.py: a Hopper that allocates on the CPU, compiled
extensions that import but never run), the RPC (queues, test_vllm_backend.py's QueueClient).
"""

import importlib.metadata
import importlib.util
import json
import os

import pytest
import torch

# Nothing of vLLM is imported here: each rank installs the stand-in platform before its first import.
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)
if not importlib.metadata.version("vllm").startswith("0.34."):
    pytest.skip(f"written against vLLM 0.34's model classes, found {importlib.metadata.version('vllm')}",
                allow_module_level=True)  # fmt: skip

from glm_fp8.models import REST, TINY_GLM5  # noqa: E402
from glm_fp8.testing import free_port, launch, synthetic_layer  # noqa: E402

# The tiny GLM-5 as a checkpoint's config.json: what vLLM reads beyond glm_fp8's keys.
CONFIG = {
    **TINY_GLM5,
    "num_nextn_predict_layers": 0,
    "architectures": ["GlmMoeDsaForCausalLM"],
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                            "weight_block_size": [128, 128]},
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "index_topk": 64, "num_key_value_heads": 4,
}  # fmt: skip
# Checkpoint tensors stored in block FP8 (the rest travel in their own dtype).
_FP8_IN_CHECKPOINT = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj", "wq_b",
                      "gate_proj", "up_proj", "down_proj")  # fmt: skip


def _checkpoint(config: dict, dtype: torch.dtype):
    """The model as a block-FP8 checkpoint holds it: the same values glm_fp8's trainer source
    sends (``synthetic_layer``, Hugging Face's per-expert names), each FP8 weight quantized alone
    by glm_fp8's reference, its scales beside it as ``weight_scale_inv``; the MTP layer under
    ``model.layers.{num_hidden_layers}``."""
    from glm_fp8.models import model_layer_ids
    from glm_fp8.reference import quantize_blockwise_ref

    for i in [*model_layer_ids(config), REST]:
        for name, t in synthetic_layer(config, i, dtype, "hf_checkpoint").items():
            short = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
            if short in _FP8_IN_CHECKPOINT and t.dim() == 2:
                q, s = quantize_blockwise_ref(t)
                yield name, q
                yield name.removesuffix("weight") + "weight_scale_inv", s
            else:
                yield name, t


def _vllm_config(tmp: str, config: dict, layout):
    """A worker's ``VllmConfig``: the model read from ``tmp``/config.json, this worker's parallel
    sizes, an MTP drafter (speculative decoding) when the config has the layer."""
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        WeightTransferConfig,
    )

    model = ModelConfig(model=tmp, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True)
    parallel = ParallelConfig(
        tensor_parallel_size=layout.tp_size,
        data_parallel_size=layout.dp_size,
        data_parallel_rank=layout.dp_rank,
        enable_expert_parallel=layout.ep_size > 1,
        # every rank launched by the test, as torchrun does: one world over the DP replicas
        distributed_executor_backend="external_launcher" if layout.dp_size > 1 else None,
    )
    spec = None
    if config["num_nextn_predict_layers"]:
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=model,
                                 target_parallel_config=parallel)  # fmt: skip
    return VllmConfig(
        model_config=model, parallel_config=parallel, speculative_config=spec,
        load_config=LoadConfig(load_format="dummy"), device_config=DeviceConfig(device="cpu"),
        weight_transfer_config=WeightTransferConfig(backend="glm_fp8"),
    )  # fmt: skip


def _poisoned(vllm_config, model_config=None) -> torch.nn.Module:
    """vLLM's model (the target, or the drafter of ``model_config``), every parameter NaN / 0xFF."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
        model = initialize_model(vllm_config=vllm_config, model_config=model_config)
    with torch.no_grad():
        for p in model.parameters():
            p.view(torch.uint8).fill_(0xFF)  # NaN in every float format vLLM holds
    return model


def _models(vllm_config, checkpoint: list | None):
    """(target, drafter, names vLLM's loader left unloaded) as a vLLM worker builds them: the
    target, then (speculative decoding) the drafter by vLLM's own ``load_eagle_model``, which
    loads it and then makes its ``embed_tokens`` and ``shared_head.head`` the target's. With a
    ``checkpoint`` each is loaded by its own ``load_weights``, then vLLM's post-reload hooks run."""
    import vllm.v1.worker.gpu.spec_decode.eagle.utils as eagle
    from vllm.config import set_current_vllm_config

    from glm_fp8.integrations.vllm import vllm_finalize

    unloaded: list[str] = []

    def load(model):
        if checkpoint is not None:
            loaded = model.load_weights(iter(checkpoint))
            unloaded.extend(sorted(set(dict(model.named_parameters())) - loaded))
        return model

    def get_model(*, vllm_config, model_config):  # vLLM's loader: build, then load the checkpoint
        with set_current_vllm_config(vllm_config):
            return load(_poisoned(vllm_config, model_config))

    target = get_model(vllm_config=vllm_config, model_config=None)
    drafter = None
    if vllm_config.speculative_config is not None:
        eagle.get_model = get_model
        with set_current_vllm_config(vllm_config):
            drafter = eagle.load_eagle_model(target, vllm_config)
    if checkpoint is not None:
        with set_current_vllm_config(vllm_config):
            for model in (target, drafter) if drafter is not None else (target,):
                vllm_finalize(model)  # the hooks a kernel-format reload runs after loading
    return target, drafter, unloaded


def _rank(rank, world, trainers, port, vllm_port, boxes, case, mode, mtp, tmp, dtype, source):
    import vllm_standin

    vllm_standin.install()
    config = {**CONFIG, "num_nextn_predict_layers": int(mtp)}
    mesh = None
    if source == "hf_module" and trainers > 1:  # every rank of the launcher's group makes the mesh
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh("cpu", torch.arange(trainers))
    if rank < trainers:
        return _trainer(rank, world, trainers, port, boxes, config, mode, dtype, source, mesh)
    return _engine(rank - trainers, world - trainers, vllm_port, boxes, case, config, tmp, dtype)


def _hf_model(config: dict, dtype: torch.dtype, mesh) -> torch.nn.Module:
    """transformers' own GLM-5 (``GlmMoeDsaForCausalLM``, its routing bias a float32 buffer) holding
    the synthetic weights in ``dtype`` (fp32: a trainer's masters); over a mesh, each parameter a
    DTensor as FSDP2 shards it (>= 2-D ``Shard(0)``, 1-D replicated), buffers plain."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = {k: v for k, v in config.items() if k not in ("quantization_config", "architectures")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf), dtype=dtype)
    state = {}
    for i in [*range(config["num_hidden_layers"]), REST]:
        state.update(synthetic_layer(config, i, dtype, "hf"))
    model.load_state_dict(state, strict=True)
    if mesh is not None:
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    t = distribute_tensor(p.detach(), mesh, [Shard(0) if p.dim() >= 2 else Replicate()])
                    mod._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
    return model


def _trainer(rank, world, trainers, port, boxes, config, mode, dtype, source_kind, mesh):
    from test_vllm_backend import QueueClient
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from glm_fp8.integrations.vllm import LayerSource, ModuleStateSource
    from glm_fp8.integrations.vllm.backend import GlmFp8TrainerInitInfo

    if source_kind == "hf_module":
        # vLLM's own ModuleSource over it misses the bias buffer: refused before anything moves
        model = _hf_model(config, dtype, mesh)
        source = ModuleStateSource(ModuleSource(model))
    else:
        source = LayerSource(lambda ids: ((i, synthetic_layer(config, i, dtype, "hf")) for i in ids),
                             rest=lambda: synthetic_layer(config, REST, dtype, "hf"),
                             mtp=bool(config["num_nextn_predict_layers"]), experts_whole=True)  # fmt: skip
    info = GlmFp8TrainerInitInfo("127.0.0.1", port, engine_ranks=world - trainers, config=config, mode=mode,
                                 trainer_ranks=trainers, timeout_s=120, rank=rank)  # fmt: skip
    try:
        client = QueueClient(boxes) if rank == 0 else None
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        sent = engine.send_weights()
        used = engine.side.mode
        engine.shutdown()
        return used, [o["session"] for o in sent]
    finally:
        if rank == 0:
            for inbox, _ in boxes:
                inbox.put(("stop", ()))


def _engine(r, engines, vllm_port, boxes, case, config, tmp, dtype):
    import torch.distributed as dist
    from test_vllm_backend import _layouts
    from test_vllm_backend_real import VllmWorker, _serve
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    import glm_fp8.integrations.vllm as integ
    from glm_fp8.engine import engine_param_specs

    integ.register()  # what vLLM's plugin loader does in every worker process
    layout = _layouts(case)[r]
    dist.destroy_process_group()  # the launcher's group spans the trainer too; vLLM's spans its workers
    # Two engines, each with its own config: a config registers the attention layers of one model.
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(engines))  # what torchrun sets
    configs = [_vllm_config(tmp, config, layout) for _ in range(2)]
    for c in configs:
        c.parallel_config.rank = r  # what vLLM's WorkerBase sets: the global RANK under torchrun
    with set_current_vllm_config(configs[0]):
        parallel_state.init_distributed_environment(engines, r, f"tcp://127.0.0.1:{vllm_port}", r, "gloo")
        parallel_state.initialize_model_parallel(layout.tp_size, 1)
    # vLLM's own loader, of a checkpoint quantized from the trainer's own values (fp32 masters: from
    # fp32, with no cast), independently of glm_fp8's transfer
    theirs = _models(configs[0], list(_checkpoint(config, dtype)))
    target, drafter, _ = _models(configs[1], None)
    models = [m for m in (target, drafter) if m is not None]
    built = {n: (tuple(p.shape), p.dtype) for m in models for n, p in m.named_parameters()}
    specs = {n: (tuple(shape), dtype) for n, (shape, dtype) in engine_param_specs(config, layout).items()}
    spec_mismatch = sorted(n for n in set(built) | set(specs) if built.get(n) != specs.get(n))
    worker = VllmWorker(configs[1], target, drafter, torch.device("cpu"))
    log: list[str] = []
    _serve(worker, *boxes[r], log)

    same = lambda a, b: torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))  # noqa: E731
    differ, poisoned, names = [], [], []
    for ours, want in zip((target, drafter), theirs[:2]):
        if ours is None:
            continue
        params = dict(want.named_parameters())
        differ += [n for n, p in ours.named_parameters() if not same(p, params[n])]
        poisoned += [n for n, p in params.items() if bool((p.contiguous().view(torch.uint8) == 0xFF).all())]
        names += list(params)
    return {
        "differ": differ,
        "params": len(names),
        "absorbed": sum(n.endswith(".W_UK_T") for n in names),
        "unloaded": theirs[2],
        "poisoned": poisoned,
        "spec_mismatch": spec_mismatch,
        "log": log,
        "updates": worker.updates,
        "updater_layout": worker.engine.side.updater.layout == layout,
    }


@pytest.mark.parametrize(
    "trainers, case, mode, mtp, dtype, source",
    [
        (1, "tp2", "broadcast", False, "bfloat16", "layers"),
        (1, "ep2", "scatter", False, "bfloat16", "layers"),
        (2, "ep2", "senders", False, "bfloat16", "layers"),
        (1, "tp2", "scatter", True, "bfloat16", "layers"),
        (1, "tp2xdp2", "scatter", False, "bfloat16", "layers"),
        # fp32 masters, in every mode: the bytes of the checkpoint quantized from them (no cast)
        (1, "tp2", "broadcast", False, "float32", "layers"),
        (1, "ep2", "scatter", False, "float32", "hf_module"),
        (2, "ep2", "senders", False, "float32", "hf_module"),
    ],
)
def test_an_update_lands_in_vllms_glm5_model_as_vllms_own_load_weights(
    trainers, case, mode, mtp, dtype, source, tmp_path
):
    """``hf_module``: transformers' own GLM-5 model (fp32, FSDP2-style DTensors over the trainer
    ranks, the routing bias a buffer) through glm_fp8's ``ModuleStateSource``."""
    import torch.multiprocessing as mp

    if source == "hf_module":
        pytest.importorskip("transformers.models.glm_moe_dsa")

    ctx = mp.get_context("spawn")
    engines = 4 if case == "tp2xdp2" else 2
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in range(engines)]
    with open(os.path.join(tmp_path, "config.json"), "w") as f:  # written once, read by every engine rank
        json.dump({**CONFIG, "num_nextn_predict_layers": int(mtp)}, f)
    args = (trainers, free_port(), free_port(), boxes, case, mode, mtp, str(tmp_path), getattr(torch, dtype),
            source)  # fmt: skip
    results = launch(trainers + engines, _rank, args, timeout_s=240)
    for r, (status, out) in results.items():
        assert status == "ok", (r, status, out)
    sessions = ["target", "draft"] if mtp else ["target"]
    for t in range(trainers):
        assert results[t][1] == (mode, sessions), results[t]
    for r in range(trainers, trainers + engines):
        out = results[r][1]
        assert out["log"] == [] and out["updater_layout"], out
        assert out["spec_mismatch"] == [], out  # glm_fp8's engine layout is vLLM's, name by name
        assert out["unloaded"] == [] and out["poisoned"] == [], out  # vLLM's loader filled every parameter
        assert out["params"] > 90 + 30 * mtp and out["differ"] == [], out
        # MLA's W_UK_T / W_UV (rebuilt by the hooks) compared too, the drafter's included
        assert out["absorbed"] == CONFIG["num_hidden_layers"] + mtp, out
        assert [into for _, into in out["updates"]] == (["target", "drafter"] if mtp else ["target"]), out
