#!/usr/bin/env bash
# Megatron-Core 0.19.2 into a venv that has glm_fp8 and the CPU torch (default .venv-vllm), for
# tests/integrations/test_megatron_real.py. Megatron-Core 0.19 declares Python >= 3.12 but ships a
# cp311 wheel, which imports and builds its models on 3.11: it goes in with --ignore-requires-python
# and without its dependencies (torch, numpy, packaging: already there), so the CPU torch stays.
#
#   bash scripts/install_megatron_cpu.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
WHEELS="$(mktemp -d)"
"$VENV/bin/python" -m pip download -q --no-deps --ignore-requires-python -d "$WHEELS" megatron-core==0.19.2
"$VENV/bin/python" -m pip install -q --no-deps --ignore-requires-python "$WHEELS"/megatron_core-0.19.2-*.whl
"$VENV/bin/python" -m pip install -q "packaging>=24.2" "numpy<2.4"
rm -rf "$WHEELS"
"$VENV/bin/python" -c "import megatron.core, torch; print(f'megatron-core {megatron.core.__version__} beside torch {torch.__version__}')"
