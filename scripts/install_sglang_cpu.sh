#!/usr/bin/env bash
# SGLang 0.5.23 in a venv of its own beside the CPU build of torch 2.13.0, so that SGLang's own model
# classes (GlmMoeDsaForCausalLM with Fp8Config, its load_weights and DefaultModelLoader's post-processing)
# can be built and loaded on a CPU. SGLang pins torch 2.14.1 and a dozen CUDA-only packages
# (sglang-kernel, flashinfer, deep-gemm, ...), so the wheel goes in without its dependencies and the
# pure-Python ones that the model, model-runner and engine modules import are named one by one, pinned,
# with torch==2.13.0 named beside them so that none of them can swap in a CUDA torch (pip then warns
# about the ones left out). The cp311 wheel wants python3 to be 3.11. About 1.5 minutes on 2 cores.
#
#   bash scripts/install_sglang_cpu.sh [VENV]    # default VENV: .venv-sglang; then glm_fp8 into it
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-sglang}"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps sglang==0.5.23
# transformers and tokenizers at the versions SGLang pins; triton because SGLang's layers import it at
# module level and the CPU torch does not bring it; IPython for sglang/utils.py; dill for
# sampling/custom_logit_processor.py on the path of the models; fastapi, uvicorn, uvloop and
# setproctitle for model_runner, the engine and weight_sync; jsonschema, xgrammar and soundfile for the
# HTTP server's module (entrypoints/http_server.py, whose routes the HTTP client's test serves). scipy, xxhash, interegular and
# prometheus_client, also declared, are imported lazily on none of those paths and stay out.
"${PIP[@]}" "transformers==5.19.0" "tokenizers==0.23.2" "huggingface_hub==1.33.0" "safetensors==0.8.0" \
    "triton==3.9.0" "apache-tvm-ffi==0.1.11" "compressed-tensors==0.18.0" "openai==2.8.0" \
    "sentencepiece==0.2.1" "gguf==0.19.0" "ipython==9.19.1" "dill==0.4.1" "einops==0.8.2" \
    "msgspec==0.23.0" "orjson==3.13.0" "pybase64==1.5.1" "partial-json-parser==0.2.1.1.post7" \
    "pydantic==2.14.4" "pyzmq==27.3.0" "aiohttp==3.14.5" "requests==2.34.2" "regex==2026.12.2" \
    "psutil==7.2.2" "distro==1.9.0" "packaging==26.4" "pillow==13.0.0" "numpy==2.4.6" "tqdm==4.70.1" \
    "zstandard==0.25.0" "python-multipart==0.0.34" "fastapi==0.165.0" "uvicorn==0.55.0" \
    "uvloop==0.23.0" "setproctitle==1.3.8" "jsonschema==4.26.0" "xgrammar==0.2.7" "soundfile==0.13.1" \
    "torch==2.13.0"
# torchvision: PyPI's only wheel for torch 2.13 (0.28.0) is a CUDA build (its _C.so needs
# libtorch_cuda.so), so beside the CPU torch `import torchvision` dies ("operator torchvision::nms does
# not exist"), and PyPI has neither a CPU wheel nor an sdist. SGLang imports it at module level only for
# image preprocessing, on the path of every model all the same: sglang.srt.models.glm4_moe ->
# batch_overlap.single_batch_overlap -> layers.moe.utils -> sglang.srt.configs -> configs.nano_nemotron_vl
# -> multimodal.internvl_utils (`import torchvision.transforms as T`, `InterpolationMode`), and
# configs.deepseek_ocr; transformers, finding it installed, then imports `torchvision.io.decode_image`,
# `ImageReadMode` and `transforms.functional.pil_to_tensor` in image_utils.py. So a stand-in goes into
# site-packages: InterpolationMode is a real enum (transformers maps PIL's modes to it when imported);
# every other name imports but raises once called, and no text model's code calls any of them. No
# dist-info: pip does not count it as installed (and `pip install torchvision` would overwrite it).
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
mkdir -p "$SITE/torchvision"
cat > "$SITE/torchvision/__init__.py" <<'EOF'
"""Not torchvision: a stand-in written by glm_fp8's scripts/install_sglang_cpu.sh (see the comment there).

PyPI has no CPU torchvision for torch 2.13; SGLang and transformers import these names at module level
for image preprocessing only. InterpolationMode is real; any other name raises once it is called."""
import enum as _enum
import sys as _sys
import types as _types

__version__ = "0.28.0+stub"


class InterpolationMode(_enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Missing:
    def __init__(self, qualname):
        self._qualname = qualname

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._qualname}: torchvision in this venv is a stub written by "
                           "scripts/install_sglang_cpu.sh (PyPI has no CPU torchvision for torch 2.13)")

    def __repr__(self):
        return f"<torchvision stub {self._qualname}>"


def _module_getattr(module):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{module}.{name}")
    return __getattr__


__getattr__ = _module_getattr(__name__)
for _name in ("io", "transforms", "transforms.functional", "transforms.v2", "transforms.v2.functional"):
    _mod = _types.ModuleType(f"{__name__}.{_name}")
    _mod.__path__ = []  # a package, so that `import torchvision.transforms.v2.functional` finds its children
    _mod.__getattr__ = _module_getattr(_mod.__name__)
    _mod.InterpolationMode = InterpolationMode
    _sys.modules[_mod.__name__] = _mod
    _parent, _, _child = _mod.__name__.rpartition(".")
    setattr(_sys.modules[_parent], _child, _mod)
del _name, _mod, _parent, _child
EOF
"${PIP[@]}" -e ".[test]"
"$VENV/bin/python" -c "import sglang.srt.models.glm4_moe, sglang, torch; \
print(f'sglang {sglang.__version__} beside torch {torch.__version__}')"
