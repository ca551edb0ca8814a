#!/usr/bin/env bash
# Build bench/scripts/kernel_sweep.cu once per knob setting (in parallel), run each, print one table.
# Usage on the GPU machine (repository root): bash bench/scripts/kernel_sweep.sh [rounds]
# SWEEP_BUILD_ONLY=1 only builds (e.g. on the CPUs while something else uses the GPU).
# Knobs: the GLM_FP8_* macros at the top of csrc/quantize_blockwise.cu.
set -uo pipefail
DIR=${OUT:-gpu_logs}/kernel_sweep; mkdir -p "$DIR"
ARCH=${ARCH:--gencode=arch=compute_90,code=sm_90}
declare -A VARIANTS=(
  [default]=""
  [fp32-min-blocks-3]="-DGLM_FP8_MIN_BLOCKS_FP32=3"
  [threads-512]="-DGLM_FP8_THREADS=512"
  [l2-prefetch-256B]="-DGLM_FP8_L2_PREFETCH_BYTES=256"
  [l2-prefetch-128B]="-DGLM_FP8_L2_PREFETCH_BYTES=128"
  [threads-512-l2-prefetch-256B]="-DGLM_FP8_THREADS=512 -DGLM_FP8_L2_PREFETCH_BYTES=256"
)
for v in "${!VARIANTS[@]}"; do
  [ -x "$DIR/$v" ] && continue  # built by an earlier SWEEP_BUILD_ONLY=1 run
  nvcc -O3 -std=c++17 $ARCH ${VARIANTS[$v]} -Xptxas -v bench/scripts/kernel_sweep.cu -o "$DIR/$v" > "$DIR/$v.build.txt" 2>&1 &
done
wait
[ "${SWEEP_BUILD_ONLY:-0}" = 1 ] && exit 0
echo "| variant                      | case               | ms       | copy ms  | share | range       |"
echo "|------------------------------|--------------------|----------|----------|-------|-------------|"
for v in default $(printf '%s\n' "${!VARIANTS[@]}" | grep -vx default | sort); do
  [ -x "$DIR/$v" ] || { echo "| $v | build failed: $(tail -3 "$DIR/$v.build.txt" | tr '\n' ' ') |"; continue; }
  "$DIR/$v" "$v" "${1:-7}"
done
