"""vLLM 0.34's CUDA model files on a CPU-only torch: a stand-in Hopper platform (tests only).

``install()`` makes ``vllm.platforms.current_platform`` a ``CudaPlatformBase`` that reports an
H200 (compute capability 9.0) but allocates on the CPU, and lets vLLM's compiled extensions
(``vllm._C`` and friends, flash-attention, DeepGEMM, compressed-tensors) import as inert stand-ins,
so that vLLM's own GLM-5 classes (``vllm/models/deepseek_v32/nvidia/model.py``: the
``GlmMoeDsaForCausalLM`` a GPU engine builds) construct their parameters under vLLM's names, shapes
and dtypes, and their ``load_weights`` runs. Nothing here runs a kernel: a forward pass would call
the stand-ins and fail.

Call it first thing in a fresh process (a spawned test rank), before anything imports
``vllm.platforms``: modules that read ``current_platform`` at import keep what they saw.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

# What imports but cannot load without CUDA (libcuda / a CUDA build of torch), or is not installed.
_STUBBED = (
    "vllm._C",
    "vllm._C_stable_libtorch",
    "vllm._moe_C",
    "vllm._moe_C_stable_libtorch",
    "vllm._flashmla_C",
    "vllm._flashmla_extension_C",
    "vllm._deepselect_C",
    "vllm._flashkda_C",
    "vllm.cumem_allocator",
    "vllm.fs_io_C",
    "vllm.spinloop",
    "vllm.vllm_flash_attn",
    "compressed_tensors",
    "deep_gemm",
)
# torch.ops namespaces the extensions would have registered.
_OP_NAMESPACES = (
    "_C",
    "_moe_C",
    "_C_cache_ops",
    "_C_custom_ar",
    "_C_utils",
    "_flashmla_C",
    "_flashmla_extension_C",
    "_deepselect_C",
    "_C_stable_libtorch",
    "_moe_C_stable_libtorch",
)


class _Op:
    """A missing compiled op or attribute: callable, falsy (so capability probes say "no")."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        return _Op(self._name + "()")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Op(f"{self._name}.{name}")

    def __bool__(self) -> bool:
        return False

    def __iter__(self):
        return iter(())


class _AnyType(type):
    """A stubbed module's attribute: a class (modules subclass them and write ``X | None``)."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyType(name, (), {})

    def __call__(cls, *args, **kwargs):
        return _AnyType(cls.__name__ + "()", (), {})

    def __iter__(cls):
        return iter(())


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyType(name, (), {"__module__": self.__name__})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if any(name == s or name.startswith(s + ".") for s in _STUBBED):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    """Install the stand-ins in this process (idempotent)."""
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return
    platforms = sys.modules.get("vllm.platforms")
    if "vllm.platforms.cuda" in sys.modules or getattr(platforms, "_current_platform", None) is not None:
        raise RuntimeError("vllm_standin.install(): vLLM's platform was resolved already; call it first")
    os.environ["VLLM_USE_DEEP_GEMM"] = "0"  # fp32 block scales, as a checkpoint holds them
    import torch
    import torch.library

    sys.meta_path.insert(0, _StubFinder())
    for ns in _OP_NAMESPACES:
        setattr(torch.ops, ns, _Op(f"torch.ops.{ns}"))
    # What a Hopper build answers, so vLLM picks the block-FP8 kernels an H200 runs (not Marlin).
    for probe in ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8"):
        setattr(torch.ops._C, probe, lambda capability: capability >= 90)
    real_register_fake = torch.library.register_fake

    def register_fake(op, *args, **kwargs):  # fake kernels of ops that were never registered
        if isinstance(op, str) and op.split("::")[0] in _OP_NAMESPACES:
            return (lambda fn: fn) if not args else None
        return real_register_fake(op, *args, **kwargs)

    torch.library.register_fake = register_fake

    import vllm.platforms
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    class StandInH200(CudaPlatformBase):
        device_type = "cpu"  # where vLLM's model code allocates

        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(9, 0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H200 (stand-in)"

        @classmethod
        def device_count(cls) -> int:
            return 8

        @classmethod
        def is_fully_connected(cls, device_ids) -> bool:
            return True

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 141 << 30

        @classmethod
        def is_pin_memory_available(cls) -> bool:
            return False

        @classmethod
        def get_device_communicator_cls(cls) -> str:  # vLLM's groups talk over gloo here
            return "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase"

    vllm.platforms.current_platform = StandInH200()
    # A CUDA side stream for the shared experts: nothing runs on it here.
    import vllm.model_executor.layers.fused_moe.runner.shared_experts as shared_experts
    import vllm.utils.torch_utils as torch_utils

    torch_utils.aux_stream = shared_experts.aux_stream = lambda: None
