// CUDA C++ block-FP8 quantization: one 256-thread block per 128x128 tile.
//
// Same contract and bits as the Triton kernel (glm_fp8/quantize.py) and the reference
// (docs/numerics.md). A thread holds 8 consecutive columns of 8 tile rows as raw input
// bits (32 registers for 16-bit inputs), so the tile is read from memory exactly once: amax
// over the registers, one block-wide reduction, then the fp8 bytes from the same registers.
#include <algorithm>
#include <climits>

#include <cuda_fp16.h>

#include "quantize_blockwise.h"

namespace glm_fp8 {
namespace {

// Tuning knobs, defaults the best measured on an H200 (bench/scripts/kernel_sweep.sh sweeps
// them; bench/RESULTS.md and HISTORY.md have the figures): threads per 128x128 tile, the
// resident blocks per SM the register allocation must allow (0: the compiler's choice) per
// input width, and the L2 prefetch size hint of the streaming loads (0: none).
#ifndef GLM_FP8_THREADS
#define GLM_FP8_THREADS 256
#endif
#ifndef GLM_FP8_MIN_BLOCKS_16BIT
#define GLM_FP8_MIN_BLOCKS_16BIT 0
#endif
#ifndef GLM_FP8_MIN_BLOCKS_FP32
#define GLM_FP8_MIN_BLOCKS_FP32 0
#endif
#ifndef GLM_FP8_L2_PREFETCH_BYTES
#define GLM_FP8_L2_PREFETCH_BYTES 0
#endif
#if GLM_FP8_L2_PREFETCH_BYTES == 256
#define GLM_FP8_L2_PREFETCH ".L2::256B"
#elif GLM_FP8_L2_PREFETCH_BYTES == 128
#define GLM_FP8_L2_PREFETCH ".L2::128B"
#elif GLM_FP8_L2_PREFETCH_BYTES == 64
#define GLM_FP8_L2_PREFETCH ".L2::64B"
#else
#define GLM_FP8_L2_PREFETCH ""
#endif

constexpr int kBlock = 128;
constexpr int kThreads = GLM_FP8_THREADS;
constexpr int kVec = 8;  // consecutive columns a thread holds in each of its rows
constexpr int kChunksPerRow = kBlock / kVec;  // 16 threads span one tile row
constexpr int kRowsPerPass = kThreads / kChunksPerRow;  // 16
constexpr int kPasses = kBlock / kRowsPerPass;  // 8 rows per thread
constexpr uint32_t kInvFp8MaxBits = 0x3B124925u;  // fl32(1/448)
constexpr uint32_t kScaleFloorBits = 0x2B8CBCCCu;  // fl32(1e-12)

// max that returns NaN when either operand is NaN (fmaxf drops NaN and would hide it).
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Input types as raw bits: a thread's 8 elements of one row are kWords 32-bit words, and the
// arithmetic runs on pairs of elements (one word of two 16-bit values, or two float words).
template <InputType kType>
struct Traits;

// What bf16 and f16 share: two elements per 32-bit word.
struct Packed16 {
  using Bits = uint16_t;
  static constexpr int kWords = kVec / 2;
  static constexpr int kMinBlocks = GLM_FP8_MIN_BLOCKS_16BIT;
};

template <>
struct Traits<InputType::kBFloat16> : Packed16 {
  // max.NaN of |a| and |b| lane by lane: one instruction per two elements.
  __device__ static uint32_t amax2(uint32_t m, uint32_t w) {
    uint32_t r;
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(m), "r"(w & 0x7FFF7FFFu));
    return r;
  }
  __device__ static float2 to_float2(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  }
};

template <>
struct Traits<InputType::kFloat16> : Packed16 {
  __device__ static uint32_t amax2(uint32_t m, uint32_t w) {
    uint32_t r;
    asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(m), "r"(w & 0x7FFF7FFFu));
    return r;
  }
  __device__ static float2 to_float2(uint32_t w) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
};

template <>
struct Traits<InputType::kFloat32> {
  using Bits = uint32_t;
  static constexpr int kWords = kVec;
  static constexpr int kMinBlocks = GLM_FP8_MIN_BLOCKS_FP32;
};

// Pair k of a thread's 8-element chunk as floats, signs kept.
template <InputType kType>
__device__ __forceinline__ float2 pair_at(const uint32_t (&w)[Traits<kType>::kWords], int k) {
  if constexpr (kType == InputType::kFloat32) {
    return make_float2(__uint_as_float(w[2 * k]), __uint_as_float(w[2 * k + 1]));
  } else {
    return Traits<kType>::to_float2(w[k]);
  }
}

// 0x80 in byte 0 / byte 1 where pair k's first / second element has its sign bit set (NaN and
// -0.0 included). prmt with the sign-replicate flag (selector bit 3) copies a byte's msb into
// all of its bits: one instruction per pair.
template <InputType kType>
__device__ __forceinline__ uint32_t pair_signs(const uint32_t (&w)[Traits<kType>::kWords], int k) {
  uint32_t r;
  if constexpr (kType == InputType::kFloat32) {
    asm("prmt.b32 %0, %1, %2, 0x44FB;" : "=r"(r) : "r"(w[2 * k]), "r"(w[2 * k + 1]));  // bytes 3, 7
  } else {
    asm("prmt.b32 %0, %1, %2, 0x44B9;" : "=r"(r) : "r"(w[k]), "r"(0u));  // bytes 1, 3
  }
  return r & 0x8080u;
}

// Block-local amax of a thread's elements, NaN-propagating.
template <InputType kType>
__device__ __forceinline__ float thread_amax(const uint32_t (&w)[kPasses][Traits<kType>::kWords]) {
  if constexpr (kType == InputType::kFloat32) {
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) m = max_nan(m, fabsf(__uint_as_float(w[i][j])));
    }
    return m;
  } else {
    // Max over packed 16-bit magnitudes is exact: their order is that of the float32 values.
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
#pragma unroll
      for (int j = 0; j < Traits<kType>::kWords; ++j) m = Traits<kType>::amax2(m, w[i][j]);
    }
    const float2 f = Traits<kType>::to_float2(m);
    return max_nan(f.x, f.y);
  }
}

// Correctly rounded x / s from rcp = RN(1/s): x * rcp is within 2 ulp; each step adds the
// exact FMA remainder times rcp (Markstein). Cheaper than an IEEE division per element.
// Sign-symmetric, so it may run on signed x (a -0.0 comes out +0.0; its sign is put back).
__device__ __forceinline__ float div_rn(float x, float s, float rcp) {
  float y = __fmul_rn(x, rcp);
  y = __fmaf_rn(__fmaf_rn(-y, s, x), rcp, y);
  y = __fmaf_rn(__fmaf_rn(-y, s, x), rcp, y);
  return y;
}

// e4m3fn codes of two floats (RNE, saturating at +-448, NaN -> 0x7F): lo in byte 0.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// Read-once 16-byte load, not kept in L1 (with GLM_FP8_L2_PREFETCH_BYTES, an L2 prefetch hint).
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate" GLM_FP8_L2_PREFETCH ".v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// The source holding row r of the concatenation: row bounds are non-decreasing and unused
// sources start at R, so counting the bounds at or below r finds it.
__device__ __forceinline__ int source_index(const QuantizeParams& p, int64_t r) {
  return (r >= p.src[1].row_begin) + (r >= p.src[2].row_begin) + (r >= p.src[3].row_begin);
}

// Load row r, columns [c0, c0 + 8) of the concatenation of expert e; zeros outside the matrix.
template <InputType kType>
__device__ __forceinline__ void load_chunk(const QuantizeParams& p, int64_t e, int64_t r, int64_t c0,
                                           uint32_t (&w)[Traits<kType>::kWords]) {
  using Bits = typename Traits<kType>::Bits;
#pragma unroll
  for (int i = 0; i < Traits<kType>::kWords; ++i) w[i] = 0;
  if (r >= p.rows || c0 >= p.cols) return;
  const Source& s = p.src[source_index(p, r)];
  const Bits* row = static_cast<const Bits*>(s.ptr) + e * s.stride_e + (r - s.row_begin) * s.stride_r;
  if (p.vec_in && c0 + kVec <= p.cols) {
    const uint4* v = reinterpret_cast<const uint4*>(row + c0);
#pragma unroll
    for (int i = 0; i < Traits<kType>::kWords / 4; ++i) {
      const uint4 x = load_stream(v + i);
      w[4 * i] = x.x;
      w[4 * i + 1] = x.y;
      w[4 * i + 2] = x.z;
      w[4 * i + 3] = x.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (c0 + j < p.cols) {
        const uint32_t b = row[(c0 + j) * s.stride_c];
        if constexpr (sizeof(Bits) == 2) {
          w[j >> 1] |= b << ((j & 1) * 16);
        } else {
          w[j] = b;
        }
      }
    }
  }
}

template <InputType kType, bool kUe8m0>
__global__ void __launch_bounds__(kThreads, Traits<kType>::kMinBlocks)
    quantize_blockwise_kernel(const __grid_constant__ LaunchParams g) {
  constexpr int kWords = Traits<kType>::kWords;
  // The job holding this block's tile: jobs' tiles follow one another in the grid.
  const int64_t launch_tile = g.tile_offset + blockIdx.x;
  int j = 0;
#pragma unroll
  for (int k = 1; k < kMaxJobs; ++k) j += k < g.num_jobs && launch_tile >= g.job[k].tile_begin;
  const QuantizeParams& p = g.job[j];
  // Tiles are numbered with column blocks fastest, so neighbouring blocks share rows.
  const int64_t tile = launch_tile - p.tile_begin;
  const int64_t cb = tile % p.col_blocks;
  const int64_t rb = (tile / p.col_blocks) % p.row_blocks;
  const int64_t e = tile / (p.col_blocks * p.row_blocks);
  const int64_t c0 = cb * kBlock + (threadIdx.x % kChunksPerRow) * kVec;
  const int64_t r0 = rb * kBlock + threadIdx.x / kChunksPerRow;

  // An interior tile (whole 128x128, one source, vector-aligned rows in and out) steps one
  // pointer by 16 rows per pass and skips every bounds check: the common case, kept lean
  // because for 16-bit inputs this kernel is instruction-bound, not memory-bound.
  const int64_t row_lo = rb * kBlock;
  const bool interior = p.vec_in && p.vec_out && row_lo + kBlock <= p.rows && (cb + 1) * kBlock <= p.cols &&
                        source_index(p, row_lo) == source_index(p, row_lo + kBlock - 1);
  uint32_t w[kPasses][kWords];  // [rows of this thread][8 elements as raw bits]
  if (interior) {
    const Source& src = p.src[source_index(p, row_lo)];
    const auto* row = static_cast<const typename Traits<kType>::Bits*>(src.ptr) + e * src.stride_e +
                      (r0 - src.row_begin) * src.stride_r + c0;
    const int64_t step = kRowsPerPass * src.stride_r;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
#pragma unroll
      for (int v = 0; v < kWords / 4; ++v) {
        const uint4 x = load_stream(reinterpret_cast<const uint4*>(row + i * step) + v);
        w[i][4 * v] = x.x;
        w[i][4 * v + 1] = x.y;
        w[i][4 * v + 2] = x.z;
        w[i][4 * v + 3] = x.w;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) load_chunk<kType>(p, e, r0 + i * kRowsPerPass, c0, w[i]);
  }

  // Block amax; NaN propagates so that a non-finite block gets a non-finite scale.
  float amax = thread_amax<kType>(w);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = max_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  __shared__ float warp_amax[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_amax[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; ++i) amax = max_nan(amax, warp_amax[i]);

  float s = max_nan(__fmul_rn(amax, __uint_as_float(kInvFp8MaxBits)), __uint_as_float(kScaleFloorBits));
  if constexpr (kUe8m0) {
    // Round up to a power of two by bit arithmetic (docs/numerics.md#ue8m0-scales), not exp2(ceil(log2(s))).
    const uint32_t b = __float_as_uint(s);
    if ((b & 0x007FFFFFu) != 0 && s < __uint_as_float(0x7F800000u)) {
      s = __uint_as_float((b & 0x7F800000u) + 0x00800000u);
    }
  }
  if (threadIdx.x == 0) {
    p.scale[e * p.s_stride_e + rb * p.s_stride_r + cb * p.s_stride_c] = s;
    if (p.nonfinite != nullptr && !isfinite(s)) *p.nonfinite = 1;
  }

  const float rcp = __frcp_rn(s);
  uint8_t* const dst0 = p.q + e * p.q_stride_e + r0 * p.q_stride_r + c0 * p.q_stride_c;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int64_t r = r0 + i * kRowsPerPass;
    if (!interior && (r >= p.rows || c0 >= p.cols)) continue;
    uint32_t word[2];  // the 8 fp8 bytes, little-endian
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t code[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const float2 x = pair_at<kType>(w[i], 2 * h + k);
        // The cvt keeps the sign of non-zero values; OR-ing x's sign bits restores it for
        // -0.0 (the division returns +0.0) and NaN (cvt gives 0x7F).
        code[k] = e4m3x2(div_rn(x.x, s, rcp), div_rn(x.y, s, rcp)) | pair_signs<kType>(w[i], 2 * h + k);
      }
      word[h] = code[0] | (code[1] << 16);
    }
    uint8_t* dst = dst0 + i * kRowsPerPass * p.q_stride_r;
    if (interior || (p.vec_out && c0 + kVec <= p.cols)) {
      __stcs(reinterpret_cast<uint2*>(dst), make_uint2(word[0], word[1]));
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (c0 + j < p.cols) dst[j * p.q_stride_c] = static_cast<uint8_t>(word[j >> 2] >> ((j & 3) * 8));
      }
    }
  }
}

template <InputType kType, bool kUe8m0>
cudaError_t launch_typed(const LaunchParams& g, int64_t tiles, cudaStream_t stream) {
  LaunchParams part = g;
  for (int64_t start = 0; start < tiles; start += INT_MAX) {
    part.tile_offset = start;
    const auto grid = static_cast<unsigned>(std::min<int64_t>(tiles - start, INT_MAX));
    quantize_blockwise_kernel<kType, kUe8m0><<<grid, kThreads, 0, stream>>>(part);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <InputType kType>
cudaError_t launch_for_type(const LaunchParams& g, int64_t tiles, bool ue8m0, cudaStream_t stream) {
  return ue8m0 ? launch_typed<kType, true>(g, tiles, stream) : launch_typed<kType, false>(g, tiles, stream);
}

}  // namespace

bool sources_vectorizable(const QuantizeParams& p, InputType type) {
  const int64_t size = type == InputType::kFloat32 ? 4 : 2;
  for (int k = 0; k < kMaxSources; ++k) {
    const Source& s = p.src[k];
    const int64_t end = k + 1 < kMaxSources ? p.src[k + 1].row_begin : p.rows;
    if (end <= s.row_begin) continue;  // unused or empty: never read
    const bool aligned = reinterpret_cast<uintptr_t>(s.ptr) % 16 == 0 &&
                         (end - s.row_begin == 1 || (s.stride_r * size) % 16 == 0) &&
                         (p.experts == 1 || (s.stride_e * size) % 16 == 0);
    if (s.stride_c != 1 || !aligned) return false;
  }
  return true;
}

cudaError_t launch_quantize_blockwise(const QuantizeParams* jobs, int num_jobs, InputType type, bool ue8m0,
                                      cudaStream_t stream) {
  for (int first = 0; first < num_jobs; first += kMaxJobs) {
    LaunchParams g{};
    int64_t tiles = 0;
    for (int k = first; k < std::min(num_jobs, first + kMaxJobs); ++k) {
      const int64_t job_tiles = jobs[k].experts * jobs[k].row_blocks * jobs[k].col_blocks;
      if (job_tiles == 0) continue;  // an empty job has no tile to own
      QuantizeParams& p = g.job[g.num_jobs++];
      p = jobs[k];
      p.vec_in = sources_vectorizable(p, type);
      p.tile_begin = tiles;
      tiles += job_tiles;
    }
    if (tiles == 0) continue;
    cudaError_t err = cudaErrorInvalidValue;
    switch (type) {
      case InputType::kBFloat16:
        err = launch_for_type<InputType::kBFloat16>(g, tiles, ue8m0, stream);
        break;
      case InputType::kFloat16:
        err = launch_for_type<InputType::kFloat16>(g, tiles, ue8m0, stream);
        break;
      case InputType::kFloat32:
        err = launch_for_type<InputType::kFloat32>(g, tiles, ue8m0, stream);
        break;
    }
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace glm_fp8
