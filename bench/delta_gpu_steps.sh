#!/usr/bin/env bash
# The GPU steps of a change to the delta step's kernels or to its sender, as two runs of
# bench/gpu_run.sh that each fit in 10 minutes (logs under $OUT or ./gpu_logs, a folder per part):
#
#   bash bench/delta_gpu_steps.sh 1   # build; delta_kernels.py (the comparison 8 bytes a lane
#                                     # checked against the byte path, then each kernel timed beside
#                                     # a device copy of the same bytes); the GPU test files; the
#                                     # delta pipeline with its GPU profile: 40 GLM-5 layers, 80
#                                     # where the card holds more than 100 GiB (an H200)
#   bash bench/delta_gpu_steps.sh 2   # the seeded fuzz of every backend at its default budget, and
#                                     # compute-sanitizer memcheck of the Triton kernels
#
# FUZZ_SEED picks the fuzz's first seed (default 20261911); DELTA_LAYERS overrides the layer count.
set -uo pipefail
part=${1:?"usage: bash bench/delta_gpu_steps.sh 1|2"}
base=${OUT:-gpu_logs}
off="HOST=0 GATHER=0 PIPELINE=0 MEGATRON=0 FLEET=0 DELTA=0 DELTA_APPLY=0 HOST_READ=0 ENGINE=0 BENCH=0"
case "$part" in
  1)
    gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    layers=${DELTA_LAYERS:-$([ "${gib:-0}" -gt 102400 ] && echo 80 || echo 40)}
    env $off OUT="$base/part1" BUILD=1 FUZZ=0 SANITIZE=0 DELTA_KERNELS=1 GPU_TESTS=1 TESTS=1 \
      TEST_TIMEOUT=220 TEST_ARGS="-n 8 -p no:benchmark" DELTA_PIPELINE=1 DELTA_LAYERS="$layers" \
      DELTA_MASTERS=bf16 DELTA_GRAPHS=on \
      DELTA_ARGS="--repeats 1 --delta-lr 1e-6 --delta-kept gpu host --delta-step adam --gpu-profile 8" \
      bash bench/gpu_run.sh
    ;;
  2)
    env $off OUT="$base/part2" BUILD=1 FUZZ=1 FUZZ_CASES=100 FUZZ_SEED="${FUZZ_SEED:-20261911}" \
      FUZZ_TIMEOUT=380 TESTS=0 SANITIZE=1 SANITIZE_TOOLS=memcheck SANITIZE_ARGS=triton \
      bash bench/gpu_run.sh
    ;;
  *) echo "usage: bash bench/delta_gpu_steps.sh 1|2" >&2; exit 2 ;;
esac
