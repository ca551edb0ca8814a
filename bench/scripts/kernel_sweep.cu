// Compile-time knob sweep of the CUDA kernel (csrc/quantize_blockwise.cu), without torch.
//
// Each build fixes the knobs at the top of the kernel file with -D flags; this program times
// that build on GLM-5 routed experts (w13 from [w1; w3] and w2 in one launch, as
// quantize_experts does on this backend) against a device-to-device copy of the same input bytes, both in the
// same process, interleaved over rounds so that clock drift hits both alike. The CUDA
// counterpart of bench/scripts/sweep.py. Usage (repository root, on the GPU machine):
//   bash bench/scripts/kernel_sweep.sh            # builds every variant in parallel, prints a table
// Inputs are uniform in [-0.05, 0.05), never zeros. Correctness is the test suite's job.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <cuda_bf16.h>

#include "../../csrc/quantize_blockwise.cu"

namespace {

#define CHECK_CUDA(x)                                                                        \
  do {                                                                                       \
    const cudaError_t err_ = (x);                                                            \
    if (err_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

template <typename T>
__global__ void fill_uniform(T* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) ^ seed;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    const float u = (h >> 8) * (1.0f / 16777216.0f) - 0.5f;  // [-0.5, 0.5)
    x[i] = static_cast<T>(u * 0.1f);
  }
}

int64_t blocks(int64_t n) { return (n + 127) / 128; }

// One quantize_experts: w13 = [w1; w3] per expert, then w2; contiguous [E, R, C] tensors.
struct Layer {
  int64_t e, h, i, elem;
  const char *w1, *w3, *w2;
  uint8_t *q13, *q2;
  float *s13, *s2;
  int64_t input_bytes() const { return 3 * e * i * h * elem; }
  int64_t moved_bytes() const {
    return input_bytes() + 3 * e * i * h + 4 * e * (blocks(2 * i) * blocks(h) + blocks(h) * blocks(i));
  }
};

glm_fp8::QuantizeParams params(const std::vector<const void*>& src, const std::vector<int64_t>& src_rows, int64_t e,
                               int64_t c, uint8_t* q, float* s) {
  glm_fp8::QuantizeParams p{};
  int64_t begin = 0;
  for (int k = 0; k < glm_fp8::kMaxSources; ++k) {
    const bool used = k < static_cast<int>(src.size());
    const int64_t rows_k = used ? src_rows[k] : 0;
    p.src[k] = glm_fp8::Source{used ? src[k] : src[0], rows_k * c, c, 1, begin};
    begin += rows_k;
  }
  for (int k = static_cast<int>(src.size()); k < glm_fp8::kMaxSources; ++k) p.src[k].row_begin = begin;
  p.experts = e;
  p.rows = begin;
  p.cols = c;
  p.row_blocks = blocks(begin);
  p.col_blocks = blocks(c);
  p.q = q;
  p.q_stride_e = begin * c;
  p.q_stride_r = c;
  p.q_stride_c = 1;
  p.scale = s;
  p.s_stride_e = p.row_blocks * p.col_blocks;
  p.s_stride_r = p.col_blocks;
  p.s_stride_c = 1;
  p.nonfinite = nullptr;
  p.vec_out = true;
  return p;
}

void quantize(const Layer& l, glm_fp8::InputType type) {
  const glm_fp8::QuantizeParams jobs[2] = {params({l.w1, l.w3}, {l.i, l.i}, l.e, l.h, l.q13, l.s13),
                                           params({l.w2}, {l.h}, l.e, l.i, l.q2, l.s2)};
  CHECK_CUDA(glm_fp8::launch_quantize_blockwise(jobs, 2, type, false, nullptr));
}

// Milliseconds of `reps` back-to-back calls of fn, divided by reps.
template <typename F>
float time_ms(F fn, int reps) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  CHECK_CUDA(cudaEventRecord(a));
  for (int k = 0; k < reps; ++k) fn();
  CHECK_CUDA(cudaEventRecord(b));
  CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  return ms / reps;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void run(const char* variant, const char* name, const Layer& l, glm_fp8::InputType type, void* copy_dst, int rounds,
         int reps) {
  const int64_t bytes = l.input_bytes();
  const auto copy = [&] { CHECK_CUDA(cudaMemcpyAsync(copy_dst, l.w1, bytes, cudaMemcpyDeviceToDevice)); };
  const auto quant = [&] { quantize(l, type); };
  copy();
  quant();
  std::vector<float> shares, ms_q, ms_c;
  for (int r = 0; r < rounds; ++r) {
    const float tc = time_ms(copy, reps), tq = time_ms(quant, reps);
    ms_c.push_back(tc);
    ms_q.push_back(tq);
    shares.push_back((l.moved_bytes() / tq) / (2.0f * bytes / tc));
  }
  std::sort(shares.begin(), shares.end());
  std::printf("| %-28s | %-18s | %8.3f | %8.3f | %.3f | %.3f-%.3f |\n", variant, name, median(ms_q), median(ms_c),
              median(shares), shares.front(), shares.back());
}

}  // namespace

int main(int argc, char** argv) {
  const char* variant = argc > 1 ? argv[1] : "default";
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  const int64_t e = 256, h = 6144, i = 2048, n = e * i * h;
  // One allocation per role: inputs of one dtype are w1, w3, w2 back to back, so the copy
  // reads exactly the input bytes from one pointer.
  char *in32, *in16, *dst;
  uint8_t *q13, *q2;
  float *s13, *s2;
  CHECK_CUDA(cudaMalloc(&in32, 3 * n * 4));
  CHECK_CUDA(cudaMalloc(&in16, 3 * n * 2));
  CHECK_CUDA(cudaMalloc(&dst, 3 * n * 4));
  CHECK_CUDA(cudaMalloc(&q13, 2 * n));
  CHECK_CUDA(cudaMalloc(&q2, n));
  CHECK_CUDA(cudaMalloc(&s13, 4 * e * blocks(2 * i) * blocks(h)));
  CHECK_CUDA(cudaMalloc(&s2, 4 * e * blocks(h) * blocks(i)));
  fill_uniform<<<4096, 256>>>(reinterpret_cast<float*>(in32), 3 * n, 1u);
  fill_uniform<<<4096, 256>>>(reinterpret_cast<__nv_bfloat16*>(in16), 3 * n, 2u);
  CHECK_CUDA(cudaDeviceSynchronize());
  const Layer bf16{e, h, i, 2, in16, in16 + n * 2, in16 + 2 * n * 2, q13, q2, s13, s2};
  const Layer fp32{e, h, i, 4, in32, in32 + n * 4, in32 + 2 * n * 4, q13, q2, s13, s2};
  // E=8: the first 8 experts of separate w1, w3, w2 stacks (inputs no longer one block, so
  // the copy reads the first 3 * 8 experts' bytes of w1's buffer: the same byte count).
  const int64_t n8 = 8 * i * h;
  const Layer e8{8, h, i, 2, in16, in16 + n8 * 2, in16 + 2 * n8 * 2, q13, q2, s13, s2};
  run(variant, "glm5-experts-bf16", bf16, glm_fp8::InputType::kBFloat16, dst, rounds, 3);
  run(variant, "glm5-experts-fp32", fp32, glm_fp8::InputType::kFloat32, dst, rounds, 3);
  run(variant, "e8-experts-bf16", e8, glm_fp8::InputType::kBFloat16, dst, rounds, 40);
  return 0;
}
