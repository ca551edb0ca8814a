// Block-FP8 quantization kernel interface, free of torch headers (nvcc compiles it alone).
//
// Contract (docs/numerics.md, the same bits as glm_fp8.kernels.reference): the row-concatenation
// of up to four sources [E, R_k, C] is quantized as one [E, R, C] matrix per expert, 128x128
// tiles anchored at (0, 0); q gets e4m3fn bytes, scale gets one float32 per tile.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace glm_fp8 {

constexpr int kMaxSources = 4;

enum class InputType : int { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2 };

struct Source {
  const void* ptr;  // element [0, 0, 0] of this source
  int64_t stride_e, stride_r, stride_c;  // in elements
  int64_t row_begin;  // first row of the concatenation that this source holds
};

// One quantization job: a concatenation of sources and its outputs.
struct QuantizeParams {
  Source src[kMaxSources];  // unused entries: row_begin = R, so no row selects them
  int64_t experts, rows, cols;  // E, R (sum of R_k), C
  int64_t row_blocks, col_blocks;  // ceil(R/128), ceil(C/128)
  uint8_t* q;  // fp8 e4m3fn bytes [E, R, C]
  int64_t q_stride_e, q_stride_r, q_stride_c;  // in bytes
  float* scale;  // [E, ceil(R/128), ceil(C/128)]
  int64_t s_stride_e, s_stride_r, s_stride_c;  // in elements
  int* nonfinite;  // optional: set to 1 when a tile's scale is NaN/Inf (never cleared here)
  bool vec_out;  // q rows are contiguous and 8-byte aligned: 8-byte stores
  // Set by launch_quantize_blockwise: 16-byte source loads possible; first tile in its launch.
  bool vec_in;
  int64_t tile_begin;
};

// Jobs of one input dtype run as one grid (up to kMaxJobs per launch): a small layer's
// w13 and w2 cost one launch and one tail, not two.
constexpr int kMaxJobs = 8;

struct LaunchParams {
  QuantizeParams job[kMaxJobs];
  int num_jobs;
  int64_t tile_offset;  // first tile of this launch (grids past 2^31 - 1 run as several)
};

// True when every source can be read with 16-byte vector loads: unit column stride and
// 16-byte aligned pointers and row/expert strides.
bool sources_vectorizable(const QuantizeParams& params, InputType type);

// Enqueue `num_jobs` quantizations of inputs of `type` on `stream`, in as few launches as
// kMaxJobs allows. Returns the first launch error, if any.
cudaError_t launch_quantize_blockwise(const QuantizeParams* jobs, int num_jobs, InputType type, bool ue8m0,
                                      cudaStream_t stream);

}  // namespace glm_fp8
