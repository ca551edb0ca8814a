#!/usr/bin/env bash
# One run on a GPU machine: build the CUDA backend, GPU test suite, compute-sanitizer, benchmarks.
# Usage on the H200 (repo root): bash bench/gpu_run.sh  (logs under $OUT or ./gpu_logs)
# Switches (1 = run), in this order: BUILD=1 FUZZ=1 SWEEP=0 KSWEEP=0 TESTS=1 SANITIZE=1 HOST=(BENCH)
# GATHER=1 PIPELINE=1 MEGATRON=0 FLEET=0 DELTA=0 DELTA_APPLY=0 HOST_READ=0 DELTA_KERNELS=0 DELTA_PIPELINE=0 (DELTA_MASTERS, DELTA_GRAPHS, DELTA_ARGS) ENGINE=1 BENCH=1; PIPELINE_LAYERS (80), FLEET_LAYERS (40) and ENGINE_LAYERS (16) size the transfer
# benchmarks (bench/scripts/pipeline.py, engine_rank.py); TEST_PATHS (default tests), TEST_ARGS, SWEEP_ARGS, SANITIZE_ARGS and
# BENCH_ARGS go to pytest, bench/scripts/sweep.py, bench/scripts/sanitize.py and glm-fp8 bench; SANITIZE_TOOLS
# (default "memcheck racecheck") picks compute-sanitizer's tools. FUZZ runs tests/kernels/test_fuzz.py
# with FUZZ_CASES (default 400) cases per GPU backend from seed FUZZ_SEED, FUZZ_BUDGET_S seconds
# at most per backend (default 120), within FUZZ_TIMEOUT (default 300) s, and the delta fuzz
# (tests/kernels/test_delta_fuzz.py) alike; FUZZ_FILES picks the fuzz files (default both). GPU_TESTS=1 sets
# TEST_PATHS to the test files that run on the GPU (the rest are CPU gloo tests that CI runs;
# the whole suite no longer finishes in one 10-minute run beside the fuzz).
set -uo pipefail
LOG=${OUT:-gpu_logs}; mkdir -p "$LOG"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  nvcc --version | tail -2; } | tee "$LOG/env.txt"
if [ "${BUILD:-1}" = 1 ]; then
  t0=$(date +%s)
  # The README's build command, in place (no pip install on a machine without network).
  if GLM_FP8_BUILD_CUDA=1 MAX_JOBS=16 python3 setup.py build_ext --inplace > "$LOG/build.txt" 2>&1; then
    echo "build: ok in $(( $(date +%s) - t0 )) s"
  else
    echo "build: FAILED"; tail -40 "$LOG/build.txt"
  fi
fi
python3 -c 'from glm_fp8 import available_backends as a; print("backends:", a("cuda"))' | tee -a "$LOG/env.txt"
if [ "${FUZZ:-1}" = 1 ]; then
  GLM_FP8_FUZZ_CASES=${FUZZ_CASES:-400} GLM_FP8_FUZZ_SEED=${FUZZ_SEED:-} GLM_FP8_FUZZ_BUDGET_S=${FUZZ_BUDGET_S:-} \
    timeout -s INT "${FUZZ_TIMEOUT:-300}" python3 -m pytest -q -rA ${FUZZ_FILES:-tests/kernels/test_fuzz.py tests/kernels/test_delta_fuzz.py} 2>&1 \
    | tee "$LOG/fuzz.txt" | grep -E '^(delta )?fuzz: |^(FAILED|ERROR|SKIPPED) |^- seed=|=> |replay: | (passed|failed)' | sed -n 1,60p
fi
if [ "${SWEEP:-0}" = 1 ]; then python3 bench/scripts/sweep.py ${SWEEP_ARGS:-} 2>&1 | tee "$LOG/sweep.txt"; fi
if [ "${KSWEEP:-0}" = 1 ]; then bash bench/scripts/kernel_sweep.sh 2>&1 | tee "$LOG/kernel_sweep.txt"; fi
if [ "${GPU_TESTS:-0}" = 1 ]; then
  TEST_PATHS="tests/kernels/test_backends.py tests/transfer/test_broadcast.py tests/kernels/test_convert.py tests/kernels/test_errors.py
    tests/kernels/test_quantize.py tests/cli/test_cli.py tests/kernels/test_checksum.py tests/model/test_trainer_layouts.py
    tests/transfer/test_one_pass.py tests/kernels/test_delta.py tests/transfer/test_delta_wire.py
    tests/transfer/test_delta_transfer.py tests/transfer/test_layer_graphs.py"
fi
if [ "${TESTS:-1}" = 1 ]; then
  # tests/kernels/test_fuzz.py ran in FUZZ above, if on.
  timeout -s INT "${TEST_TIMEOUT:-400}" python3 -m pytest -q -rfE ${TEST_PATHS:-tests} ${TEST_ARGS:-} \
    $([ "${FUZZ:-1}" = 1 ] && echo --ignore=tests/kernels/test_fuzz.py --ignore=tests/kernels/test_delta_fuzz.py) 2>&1 \
    | tee "$LOG/tests.txt" | tail -25
fi
if [ "${SANITIZE:-1}" = 1 ]; then
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/scripts/sanitize.py ${SANITIZE_ARGS:-} \
      > "$LOG/sanitize-$tool.txt" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -c '=========.*Error\|ERROR SUMMARY' "$LOG/sanitize-$tool.txt") summary lines)"
    grep "ERROR SUMMARY\|failures" "$LOG/sanitize-$tool.txt" | tail -3
  done
fi
# HOST defaults to BENCH: the bench's small checked calls are bound by host latency, and the host's
# own figures in the same call tell a slower host from slower host code.
if [ "${HOST:-${BENCH:-1}}" = 1 ]; then python3 bench/scripts/host_overhead.py 2>&1 | tee "$LOG/host_overhead.txt"; fi
if [ "${GATHER:-1}" = 1 ]; then python3 bench/scripts/gather.py 2>&1 | tee "$LOG/gather.txt" | tail -8; fi
if [ "${PIPELINE:-1}" = 1 ]; then
  L=${PIPELINE_LAYERS:-80}
  # The whole-layer modes skip layer 0's byte check: its reference (~50 GiB) does not fit beside
  # the rings; bench/scripts/pipeline.py --device cpu checks those modes' bytes (CI).
  { python3 bench/scripts/pipeline.py --mode broadcast --layers $L --repeats 2 --no-check
    python3 bench/scripts/pipeline.py --mode scatter --layers $L --tp 8 --repeats 1 --no-check
    python3 bench/scripts/pipeline.py --mode senders --layers $L --tp 8 --ep --engines 4 --senders 32 \
      --sender 0 1 --master bf16 fp32 --repeats 2; } 2>&1 | tee "$LOG/pipeline.txt" | grep -v '^---'
fi
if [ "${MEGATRON:-0}" = 1 ]; then
  L=${MEGATRON_LAYERS:-80}
  # A Megatron-Core rank's share (#45): miles' GLM-5 trainer (TP 4, PP 8, CP 2, EP 16: 128 senders,
  # each stage's 16 its layers) into 4 servers of EP 8; sender 0 is handed its stage's layers only.
  # No layer-0 check: its reference of a whole GLM-5 layer ran out of an H100's memory (the script's
  # --device cpu --model tiny run checks those bytes).
  python3 bench/scripts/pipeline.py --mode senders --layers $L --tp 8 --ep --engines 4 \
    --trainer megatron:tp4,pp8,cp2,ep16 --sender 0 --master bf16 fp32 --repeats 2 --no-check 2>&1 \
    | tee "$LOG/megatron.txt" | grep -v '^---'
fi
if [ "${FLEET:-0}" = 1 ]; then
  L=${FLEET_LAYERS:-40}
  # One sender into 4 servers of 2 layouts (#32): time against the link, wire bytes against the model.
  { python3 bench/scripts/pipeline.py --mode scatter --layers $L --servers 2xEP8 2xTP8 --repeats 2 --no-check
    python3 bench/scripts/pipeline.py --mode senders --layers $L --senders 32 --servers 2xEP8 2xTP8 \
      --sender 0 1 --master bf16 --repeats 2
    # 8 senders into 4 x EP 8: the senders' NICs would bound it, so group broadcasts (topology.py).
    python3 bench/scripts/pipeline.py --mode senders --layers $L --senders 8 --servers 4xEP8 \
      --sender 0 --master bf16 --repeats 2; } 2>&1 | tee "$LOG/fleet.txt" | grep -v '^---'
fi
if [ "${DELTA:-0}" = 1 ]; then
  # The changed fraction from real AdamW steps at GLM-5's expert shape, the kernel checked against
  # the reference at every step, and the field's encodings of it (zstd: the zstandard package; on a
  # machine without network, a wheel carried under build/wheels/, `pip download zstandard` here).
  python3 -c 'import zstandard' 2>/dev/null || python3 -m pip install -q --no-index build/wheels/zstandard-*.whl
  python3 bench/scripts/delta_fraction.py --device cuda --steps ${DELTA_STEPS:-20} --quantizer kernel \
    --json "$LOG/delta_fraction.json" 2>&1 | tee "$LOG/delta_fraction.txt" | tail -20
fi
if [ "${DELTA_APPLY:-0}" = 1 ]; then
  # Each encoding of one layer's FP8 change on an engine rank's 32 experts: the trainer's encode,
  # the engine's apply, each checked bit for bit (docs/delta.md#beside-the-field).
  python3 -c 'import zstandard' 2>/dev/null || python3 -m pip install -q --no-index build/wheels/zstandard-*.whl
  python3 bench/scripts/delta_apply.py --device cuda ${DELTA_APPLY_ARGS:-} --json "$LOG/delta_apply.json" 2>&1 \
    | tee "$LOG/delta_apply.txt" | tail -20
fi
if [ "${HOST_READ:-0}" = 1 ]; then
  # The host-kept delta's in-place read of pinned memory against the copy engine (docs/delta.md#in-the-transfer).
  python3 bench/scripts/host_read.py 2>&1 | tee "$LOG/host_read.txt"
fi
if [ "${DELTA_KERNELS:-0}" = 1 ]; then
  # A delta step's kernels on one segment beside a device copy of its bytes, checked first (docs/delta.md#in-the-transfer).
  python3 bench/scripts/delta_kernels.py ${DELTA_KERNELS_ARGS:-} 2>&1 | tee "$LOG/delta_kernels.txt"
fi
if [ "${DELTA_PIPELINE:-0}" = 1 ]; then
  # #33: delta updates of 80 GLM-5 layers by one of 32 senders into 4 x EP 8 (its kept copy is its
  # share, ~24 GiB), after stand-in trainer steps (Adam's first and its warm step, standin.py) at
  # two learning rates, against the dense update; the kept copy on the GPU and in pinned host memory.
  python3 bench/scripts/pipeline.py --mode senders --layers ${DELTA_LAYERS:-80} --tp 8 --ep --engines 4 \
    --senders 32 --sender 0 --master ${DELTA_MASTERS:-bf16 fp32} --repeats 2 --delta-lr 1e-6 1e-5 --delta-steps 3 \
    --delta-kept gpu host --delta-step sign adam --delta-graphs ${DELTA_GRAPHS:-on off} ${DELTA_ARGS:-} 2>&1 \
    | tee "$LOG/delta_pipeline.txt" | grep -v '^---\|^prof|'
fi
if [ "${ENGINE:-1}" = 1 ]; then
  # ENGINE_ARGS="--delta": also the rank's delta landing against its dense one (#33)
  python3 bench/scripts/engine_rank.py --layers ${ENGINE_LAYERS:-16} ${ENGINE_ARGS:-} 2>&1 | tee "$LOG/engine_rank.txt"
fi
if [ "${BENCH:-1}" = 1 ]; then python3 -m glm_fp8.cli bench --markdown ${BENCH_ARGS:-} --json "$LOG/bench.json" 2>&1 | tee "$LOG/bench.md"; fi
