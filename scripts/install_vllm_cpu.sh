#!/usr/bin/env bash
# vLLM 0.34 in a venv of its own beside the CPU build of torch 2.13.0, for the tests that run vLLM's
# own classes (tests/integrations/test_vllm_backend_real.py, test_vllm_model_real.py) on a CPU.
# A plain `pip install vllm==0.34.0` would replace torch with a CUDA build, so the wheel goes in
# without its dependencies and they are named one by one (pip then warns that vLLM wants torch
# 2.14 and torchvision, which these tests do not use). About 5 minutes on 2 cores.
#
#   bash scripts/install_vllm_cpu.sh [VENV]      # default VENV: .venv-vllm; then glm_fp8 into it
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" torch==2.13.0
WHEELS="$(mktemp -d)"
"$VENV/bin/python" -m pip download -q --no-deps -d "$WHEELS" vllm==0.34.0
"${PIP[@]}" --no-deps "$WHEELS"/vllm-0.34.0-*.whl
"${PIP[@]}" regex cachetools psutil sentencepiece numpy "requests>=2.33.0" tqdm blake3 py-cpuinfo \
    "transformers<5.23.0,>=5.16.1" "huggingface_hub>=2.0.0" "tokenizers>=0.23.3" "safetensors>=0.6.2" \
    "protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*" "pydantic>=2.12.0" orjson prometheus_client pillow \
    typing_extensions filelock partial-json-parser jsonschema pyzmq msgspec pyyaml einops "depyf==0.20.0" \
    cloudpickle python-json-logger ninja pybase64 cbor2 ijson setproctitle "numba==0.65.0" \
    "openai>=2.25.0" "fastapi[standard]<0.137.0,>=0.133.0" "aiohttp>=3.14.4" tiktoken "lark==1.2.2" \
    "torch==2.13.0"
"${PIP[@]}" "llguidance<1.8.0,>=1.7.0" "xgrammar==0.2.8" "outlines_core==0.2.14" \
    "lm-format-enforcer==0.11.3" "compressed-tensors==0.17.0" "mistral_common[image]>=1.13.0" \
    "opencv-python-headless>=4.13.0"
"${PIP[@]}" -e ".[test]"
rm -rf "$WHEELS"
"$VENV/bin/python" -c "import vllm, torch; print(f'vllm {vllm.__version__} beside torch {torch.__version__}')"
