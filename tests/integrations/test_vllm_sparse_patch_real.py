"""vLLM 0.34's own ``sparse_nccl`` patches of a block-FP8 checkpoint, applied by vLLM's own
``load_checkpoint_weight_patches`` to vLLM's own GLM-5 model: the field's sparse update beside
glm_fp8's FP8 delta (docs/delta.md#beside-the-field). Skipped without vLLM 0.34.

Invariant: on every engine rank (TP 2, EP 2), a model loaded by vLLM's ``load_weights`` from the
checkpoint of one trainer step (``moved_layer``, step 0), then patched with the changes to the
next step's checkpoint (per tensor: int32 flat indices of the elements whose bytes changed and
their new values in the checkpoint's dtype, e4m3 for the FP8 weights, float32 for their
``weight_scale_inv``, bf16 for the rest; each patch checked by vLLM's trainer-side
``_validate_patch``) and finalized as vLLM's ``SparseNCCLWeightTransferEngine.finish_weight_update``
does, holds byte for byte what vLLM's ``load_weights`` of the next step's checkpoint gives a fresh
model (poisoned, NaN / 0xFF), MLA's absorbed ``W_UK_T`` / ``W_UV`` included.

What a CPU build of torch lacks, and how this test stands in: ``index_copy_`` of float8_e4m3fn,
which vLLM's staging of an FP8 patch calls (it raises ``NotImplementedError`` on the CPU; asserted
first), and neither has torch 2.11 on an H100 (``bench/scripts/fp8_patch_ops.py``,
bench/RESULTS.md): this test gives it its bytes' meaning, the copy of the uint8 views, and so
tests the rest of vLLM's path. The ``isnan`` and ``where`` of e4m3 that vLLM's masked copy calls
are torch's own.
"""

import importlib.metadata
import importlib.util
import json
import os

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)
if not importlib.metadata.version("vllm").startswith("0.34."):
    pytest.skip(
        f"written against vLLM 0.34's sparse patches, found {importlib.metadata.version('vllm')}",
        allow_module_level=True,
    )

from glm_fp8.testing import free_port, launch, moved_layer  # noqa: E402

F8 = torch.float8_e4m3fn
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _fp8_index_copy_by_bytes() -> None:
    """``index_copy_`` of float8_e4m3fn as the copy of its uint8 views (this process)."""
    index_copy = torch.Tensor.index_copy_

    def index_copy_(self, dim, index, source):
        if self.dtype == F8:
            index_copy(self.view(torch.uint8), dim, index, source.view(torch.uint8))
            return self
        return index_copy(self, dim, index, source)

    torch.Tensor.index_copy_ = index_copy_


def _patches(old: list, new: list) -> list:
    """vLLM's sparse patches (``CheckpointWeightPatch``) taking checkpoint ``old`` to ``new``, each
    first built as the trainer's ``SparseWeightPatch`` and checked by vLLM's ``_validate_patch``."""
    from vllm.distributed.weight_transfer.sparse_nccl_engine import (
        SparseNCCLTrainerWeightTransferEngine,
        SparseWeightPatch,
    )
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

    out = []
    for (name, a), (name_b, b) in zip(old, new, strict=True):
        assert name == name_b, (name, name_b)
        ints = INTS[a.element_size()]
        idx = (a.view(ints) != b.view(ints)).flatten().nonzero().flatten().to(torch.int32)
        if not len(idx):
            continue
        patch = SparseWeightPatch(name, idx, b.flatten()[idx.long()].contiguous(), tuple(b.shape))
        SparseNCCLTrainerWeightTransferEngine._validate_patch(patch)
        out.append(CheckpointWeightPatch(name, patch.full_shape, b.dtype, patch.values, patch.indices))
    return out


def _rank(rank, world, vllm_port, case, tmp):
    import vllm_standin

    vllm_standin.install()
    import torch.distributed as dist
    from test_vllm_backend import _layouts
    from test_vllm_model_real import CONFIG, _checkpoint, _models, _vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.model_loader.checkpoint_weight_patch import load_checkpoint_weight_patches
    from vllm.model_executor.model_loader.weight_utils import finalize_model_weights

    layout = _layouts(case)[rank]
    dist.destroy_process_group()  # vLLM's world is its own
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    configs = [_vllm_config(tmp, CONFIG, layout) for _ in range(2)]
    for c in configs:
        c.parallel_config.rank = rank
    with set_current_vllm_config(configs[0]):
        parallel_state.init_distributed_environment(world, rank, f"tcp://127.0.0.1:{vllm_port}", rank, "gloo")
        parallel_state.initialize_model_parallel(layout.tp_size, 1)
    step = lambda k: list(
        _checkpoint(CONFIG, torch.bfloat16, lambda i: moved_layer(CONFIG, i, k, torch.bfloat16, "hf"))
    )  # noqa: E731
    old, new = step(0), step(1)
    patches = _patches(old, new)
    ours, _, _ = _models(configs[0], old)
    theirs, _, _ = _models(configs[1], new)
    fp8 = [p for p in patches if p.dtype == F8]
    try:  # vLLM stages each sparse patch in a NaN-filled tensor by index_copy_: not on a CPU for e4m3
        with set_current_vllm_config(configs[0]):
            load_checkpoint_weight_patches(ours, fp8[:1])
        cpu_error = None
    except NotImplementedError as exc:
        cpu_error = str(exc)
    _fp8_index_copy_by_bytes()
    with set_current_vllm_config(configs[0]):
        loaded = load_checkpoint_weight_patches(ours, patches)
        finalize_model_weights(ours)  # SparseNCCLWeightTransferEngine.finish_weight_update
    same = lambda a, b: torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))  # noqa: E731
    want = dict(theirs.named_parameters())
    return {
        "cpu_error": cpu_error,
        "patches": len(patches),
        "fp8_patches": len(fp8),
        "patch_bytes": sum(p.values.nbytes + p.indices.nbytes for p in patches),
        "checkpoint_bytes": sum(t.nbytes for _, t in new),
        "loaded": len(loaded),
        "params": len(want),
        "absorbed": sum(n.endswith(".W_UK_T") for n in want),
        "differ": [n for n, p in ours.named_parameters() if not same(p, want[n])],
        "changed": sum(not same(p, q) for (_, p), (_, q) in zip(old, new)),
    }


@pytest.mark.parametrize("case", ["tp2", "ep2"])
def test_vllms_sparse_fp8_patches_land_exactly_in_vllms_glm5_model(case, tmp_path):
    from test_vllm_model_real import CONFIG

    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    results = launch(2, _rank, (free_port(), case, str(tmp_path)), timeout_s=240)
    for r, (status, out) in results.items():
        assert status == "ok", (r, status, out)
        assert "index_copy" in out["cpu_error"] and "Float8_e4m3fn" in out["cpu_error"], out
        assert out["fp8_patches"] > 20 and out["patches"] > out["fp8_patches"], out
        assert out["changed"] == out["patches"], out  # every tensor that changed, patched
        assert out["patch_bytes"] < out["checkpoint_bytes"] / 20, out  # a sparse step
        assert out["loaded"] > 0 and out["params"] > 90, out
        assert out["absorbed"] == CONFIG["num_hidden_layers"], out
        assert out["differ"] == [], out
