// torch bindings of the CUDA backend: torch.ops.glm_fp8.quantize_blockwise_ (a group of jobs).
//
// The host entry point checks every contract of the launch (ranks, shapes, dtypes, devices)
// and raises before anything is enqueued; then it fills QuantizeParams and launches on the
// current stream. Overlap of outputs and inputs is checked by the Python callers
// (glm_fp8.kernels.quantize), which also name the user's tensors in their messages.
#include <Python.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "quantize_blockwise.h"

namespace glm_fp8 {
namespace {

// Messages are built as one std::string with std::to_string and passed to TORCH_CHECK whole:
// c10::str would format numbers through an ostream, and with some toolchains (seen on the
// H200 image's /opt/gcc) this library's own copy of the stream code then meets the process's
// libstdc++ locale and crashes instead of raising.
std::string str(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string str(at::ScalarType t) { return c10::toString(t); }

std::string str(const at::Device& d) { return d.str(); }

// kind: VALUE (ValueError), TYPE (TypeError) or RUNTIME (RuntimeError).
#define TORCH_CHECK_RUNTIME TORCH_CHECK
#define GLM_FP8_CHECK(kind, cond, msg)    \
  do {                                    \
    if (!(cond)) {                        \
      const std::string message = (msg);  \
      TORCH_CHECK_##kind(false, message); \
    }                                     \
  } while (0)

int64_t ceil_blocks(int64_t n) { return (n + 127) / 128; }

InputType input_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16:
      return InputType::kBFloat16;
    case at::kHalf:
      return InputType::kFloat16;
    case at::kFloat:
      return InputType::kFloat32;
    default:
      GLM_FP8_CHECK(TYPE, false, "sources[0]: expected dtype bfloat16, float16 or float32, got " + str(t.scalar_type()));
  }
  return InputType::kFloat32;  // unreachable
}

void check_output(const at::Tensor& t, const std::string& name, at::IntArrayRef shape, const at::Device& device) {
  GLM_FP8_CHECK(VALUE, t.sizes() == shape, name + ": expected shape " + str(shape) + ", got " + str(t.sizes()));
  GLM_FP8_CHECK(VALUE, t.device() == device, name + ": expected device " + str(device) + ", got " + str(t.device()));
}

// One call quantizes num_sources.size() jobs of one input dtype, as one grid where possible.
// Job j: q[j] [E, R, C] float8_e4m3fn (or its uint8 view), scale[j] [E, ceil(R/128),
// ceil(C/128)] float32, from the next num_sources[j] (1 to 4) tensors of `sources`, each
// [E, R_k, C] with sum R_k = R, any strides. nonfinite: optional int32 flag, set to 1 when some
// block holds NaN/Inf (never cleared). Everything is checked before anything is enqueued.
void quantize_blockwise_(at::TensorList q, at::TensorList scale, at::TensorList sources, at::IntArrayRef num_sources,
                         bool ue8m0, const std::optional<at::Tensor>& nonfinite) {
  const auto jobs = static_cast<int64_t>(num_sources.size());
  GLM_FP8_CHECK(VALUE, static_cast<int64_t>(q.size()) == jobs && static_cast<int64_t>(scale.size()) == jobs,
                "q, scale: expected one tensor per job (" + std::to_string(jobs) + " in num_sources), got " +
                    std::to_string(q.size()) + " and " + std::to_string(scale.size()));
  int64_t total = 0;
  for (int64_t j = 0; j < jobs; ++j) {
    GLM_FP8_CHECK(VALUE, num_sources[j] >= 1 && num_sources[j] <= kMaxSources,
                  "num_sources[" + std::to_string(j) + "]: expected 1 to " + std::to_string(kMaxSources) +
                      " tensors, got " + std::to_string(num_sources[j]));
    total += num_sources[j];
  }
  GLM_FP8_CHECK(VALUE, static_cast<int64_t>(sources.size()) == total,
                "sources: expected " + std::to_string(total) + " tensors (the sum of num_sources), got " +
                    std::to_string(sources.size()));
  if (jobs == 0) return;
  const at::Tensor& first = sources[0];
  GLM_FP8_CHECK(VALUE, first.is_cuda(), "sources[0]: expected a CUDA tensor, got device " + str(first.device()));
  const InputType type = input_type(first);
  std::vector<QuantizeParams> params(jobs);
  int64_t k = 0;  // index into sources
  for (int64_t j = 0; j < jobs; ++j) {
    const std::string job = "[" + std::to_string(j) + "]";
    const at::Tensor& head = sources[k];
    const std::string head_name = "sources[" + std::to_string(k) + "]";
    GLM_FP8_CHECK(VALUE, head.dim() == 3, head_name + ": expected a 3-D tensor [E, R, C], got shape " + str(head.sizes()));
    const int64_t experts = head.size(0), cols = head.size(2);
    QuantizeParams& p = params[j];
    int64_t rows = 0;
    for (int64_t i = 0; i < num_sources[j]; ++i, ++k) {
      const at::Tensor& t = sources[k];
      const std::string name = "sources[" + std::to_string(k) + "]";
      GLM_FP8_CHECK(VALUE, t.dim() == 3 && t.size(0) == experts && t.size(2) == cols,
                    name + ": expected shape [" + std::to_string(experts) + ", R, " + std::to_string(cols) + "] (as " +
                        head_name + "), got " + str(t.sizes()));
      GLM_FP8_CHECK(TYPE, t.scalar_type() == first.scalar_type(),
                    name + ": expected dtype " + str(first.scalar_type()) +
                        " (as sources[0]; one call quantizes one input dtype), got " + str(t.scalar_type()));
      GLM_FP8_CHECK(VALUE, t.device() == first.device(),
                    name + ": expected device " + str(first.device()) + ", got " + str(t.device()));
      p.src[i] = Source{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2), rows};
      rows += t.size(1);
    }
    for (int64_t i = num_sources[j]; i < kMaxSources; ++i) p.src[i] = Source{p.src[0].ptr, 0, 0, 0, rows};
    const at::Tensor& qj = q[j];
    const at::Tensor& sj = scale[j];
    GLM_FP8_CHECK(TYPE, qj.scalar_type() == at::kFloat8_e4m3fn || qj.scalar_type() == at::kByte,
                  "q" + job + ": expected dtype float8_e4m3fn (or its uint8 view), got " + str(qj.scalar_type()));
    check_output(qj, "q" + job, {experts, rows, cols}, first.device());
    GLM_FP8_CHECK(TYPE, sj.scalar_type() == at::kFloat,
                  "scale" + job + ": expected dtype float32, got " + str(sj.scalar_type()));
    check_output(sj, "scale" + job, {experts, ceil_blocks(rows), ceil_blocks(cols)}, first.device());
    p.experts = experts;
    p.rows = rows;
    p.cols = cols;
    p.row_blocks = ceil_blocks(rows);
    p.col_blocks = ceil_blocks(cols);
    p.q = static_cast<uint8_t*>(qj.data_ptr());
    p.q_stride_e = qj.stride(0);
    p.q_stride_r = qj.stride(1);
    p.q_stride_c = qj.stride(2);
    p.scale = sj.data_ptr<float>();
    p.s_stride_e = sj.stride(0);
    p.s_stride_r = sj.stride(1);
    p.s_stride_c = sj.stride(2);
    p.vec_out = p.q_stride_c == 1 && reinterpret_cast<uintptr_t>(p.q) % 8 == 0 &&
                (rows == 1 || p.q_stride_r % 8 == 0) && (experts == 1 || p.q_stride_e % 8 == 0);
  }
  int* flag = nullptr;
  if (nonfinite.has_value()) {
    const at::Tensor& f = *nonfinite;
    GLM_FP8_CHECK(TYPE, f.scalar_type() == at::kInt, "nonfinite: expected dtype int32, got " + str(f.scalar_type()));
    GLM_FP8_CHECK(VALUE, f.numel() >= 1 && f.device() == first.device(),
                  "nonfinite: expected at least one element on " + str(first.device()) + ", got shape " +
                      str(f.sizes()) + " on " + str(f.device()));
    flag = f.data_ptr<int>();
  }
  for (QuantizeParams& p : params) p.nonfinite = flag;

  const c10::cuda::CUDAGuard guard(first.device());
  const cudaError_t err = launch_quantize_blockwise(params.data(), static_cast<int>(jobs), type, ue8m0,
                                                    c10::cuda::getCurrentCUDAStream().stream());
  GLM_FP8_CHECK(RUNTIME, err == cudaSuccess, std::string("glm_fp8 CUDA quantize launch failed: ") + cudaGetErrorString(err));
}

}  // namespace
}  // namespace glm_fp8

TORCH_LIBRARY(glm_fp8, m) {
  m.def(
      "quantize_blockwise_(Tensor(a!)[] q, Tensor(b!)[] scale, Tensor[] sources, int[] num_sources, "
      "bool ue8m0, Tensor(c!)? nonfinite=None) -> ()");
}

TORCH_LIBRARY_IMPL(glm_fp8, CUDA, m) { m.impl("quantize_blockwise_", &glm_fp8::quantize_blockwise_); }

// A plain extension module: importing glm_fp8._C loads the library, which registers the ops.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "glm_fp8 CUDA backend (torch.ops.glm_fp8)", -1, nullptr};
  return PyModule_Create(&module);
}
