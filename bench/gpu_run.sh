#!/usr/bin/env bash
# One device call: GPU test suite, launch-config sweep, benchmark tables.
# Usage on the H200 (repo root): bash bench/gpu_run.sh  (logs under $OUT or ./gpu_logs)
# Switches: SWEEP=0, BENCH=0, BCAST=0, TESTS=0 skip a part; BENCH_ARGS adds to glm-fp8 bench.
set -uo pipefail
LOG=${OUT:-gpu_logs}; mkdir -p "$LOG"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } | tee "$LOG/env.txt"
if [ "${TESTS:-1}" = 1 ]; then python3 -m pytest -q tests 2>&1 | tee "$LOG/tests.txt" | tail -8; fi
if [ "${SWEEP:-1}" = 1 ]; then python3 bench/sweep.py 2>&1 | tee "$LOG/sweep.txt"; fi
if [ "${BCAST:-1}" = 1 ]; then python3 bench/bench_broadcast.py 2>&1 | tee "$LOG/broadcast.txt"; fi
if [ "${BENCH:-1}" = 1 ]; then python3 -m glm_fp8.cli bench --markdown ${BENCH_ARGS:-} --json "$LOG/bench.json" 2>&1 | tee "$LOG/bench.md"; fi
