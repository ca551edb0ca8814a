// torch bindings of the CUDA backend: torch.ops.glm_fp8.quantize_blockwise_.
//
// The host entry point checks every contract of the launch (ranks, shapes, dtypes, devices)
// and raises before anything is enqueued; then it fills QuantizeParams and launches on the
// current stream. Overlap of outputs and inputs is checked by the Python callers
// (glm_fp8.quantize), which also name the user's tensors in their messages.
#include <Python.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>

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

// q [E, R, C] float8_e4m3fn (or its uint8 view), scale [E, ceil(R/128), ceil(C/128)] float32,
// sources: 1 to 4 tensors [E, R_k, C] of one dtype with sum R_k = R, any strides.
// nonfinite: optional int32 flag, set to 1 when some block holds NaN/Inf (never cleared).
void quantize_blockwise_(at::Tensor& q, at::Tensor& scale, at::TensorList sources, bool ue8m0,
                         const std::optional<at::Tensor>& nonfinite) {
  const auto n = static_cast<int64_t>(sources.size());
  GLM_FP8_CHECK(VALUE, n >= 1 && n <= kMaxSources,
                "sources: expected 1 to " + std::to_string(kMaxSources) + " tensors, got " + std::to_string(n));
  const at::Tensor& first = sources[0];
  GLM_FP8_CHECK(VALUE, first.dim() == 3, "sources[0]: expected a 3-D tensor [E, R, C], got shape " + str(first.sizes()));
  GLM_FP8_CHECK(VALUE, first.is_cuda(), "sources[0]: expected a CUDA tensor, got device " + str(first.device()));
  const InputType type = input_type(first);
  const int64_t experts = first.size(0), cols = first.size(2);
  int64_t rows = 0;
  for (int64_t k = 0; k < n; ++k) {
    const at::Tensor& t = sources[k];
    const std::string name = "sources[" + std::to_string(k) + "]";
    GLM_FP8_CHECK(VALUE, t.dim() == 3 && t.size(0) == experts && t.size(2) == cols,
                  name + ": expected shape [" + std::to_string(experts) + ", R, " + std::to_string(cols) +
                      "] (as sources[0]), got " + str(t.sizes()));
    GLM_FP8_CHECK(TYPE, t.scalar_type() == first.scalar_type(),
                  name + ": expected dtype " + str(first.scalar_type()) + " (as sources[0]), got " + str(t.scalar_type()));
    GLM_FP8_CHECK(VALUE, t.device() == first.device(),
                  name + ": expected device " + str(first.device()) + ", got " + str(t.device()));
    rows += t.size(1);
  }
  GLM_FP8_CHECK(TYPE, q.scalar_type() == at::kFloat8_e4m3fn || q.scalar_type() == at::kByte,
                "q: expected dtype float8_e4m3fn (or its uint8 view), got " + str(q.scalar_type()));
  check_output(q, "q", {experts, rows, cols}, first.device());
  GLM_FP8_CHECK(TYPE, scale.scalar_type() == at::kFloat, "scale: expected dtype float32, got " + str(scale.scalar_type()));
  check_output(scale, "scale", {experts, ceil_blocks(rows), ceil_blocks(cols)}, first.device());
  if (nonfinite.has_value()) {
    const at::Tensor& f = *nonfinite;
    GLM_FP8_CHECK(TYPE, f.scalar_type() == at::kInt, "nonfinite: expected dtype int32, got " + str(f.scalar_type()));
    GLM_FP8_CHECK(VALUE, f.numel() >= 1 && f.device() == first.device(),
                  "nonfinite: expected at least one element on " + str(first.device()) + ", got shape " +
                      str(f.sizes()) + " on " + str(f.device()));
  }
  if (experts == 0 || rows == 0 || cols == 0) return;

  QuantizeParams p{};
  int64_t begin = 0;
  for (int64_t k = 0; k < kMaxSources; ++k) {
    const at::Tensor& t = sources[k < n ? k : 0];
    p.src[k] = Source{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2), k < n ? begin : rows};
    if (k < n) begin += t.size(1);
  }
  p.experts = experts;
  p.rows = rows;
  p.cols = cols;
  p.row_blocks = ceil_blocks(rows);
  p.col_blocks = ceil_blocks(cols);
  p.q = static_cast<uint8_t*>(q.data_ptr());
  p.q_stride_e = q.stride(0);
  p.q_stride_r = q.stride(1);
  p.q_stride_c = q.stride(2);
  p.scale = scale.data_ptr<float>();
  p.s_stride_e = scale.stride(0);
  p.s_stride_r = scale.stride(1);
  p.s_stride_c = scale.stride(2);
  p.nonfinite = nonfinite.has_value() ? nonfinite->data_ptr<int>() : nullptr;
  p.vec_out = p.q_stride_c == 1 && reinterpret_cast<uintptr_t>(p.q) % 8 == 0 &&
              (rows == 1 || p.q_stride_r % 8 == 0) && (experts == 1 || p.q_stride_e % 8 == 0);

  const c10::cuda::CUDAGuard guard(first.device());
  const cudaError_t err = launch_quantize_blockwise(p, type, ue8m0, c10::cuda::getCurrentCUDAStream().stream());
  GLM_FP8_CHECK(RUNTIME, err == cudaSuccess, std::string("glm_fp8 CUDA quantize launch failed: ") + cudaGetErrorString(err));
}

}  // namespace
}  // namespace glm_fp8

TORCH_LIBRARY(glm_fp8, m) {
  m.def(
      "quantize_blockwise_(Tensor(a!) q, Tensor(b!) scale, Tensor[] sources, bool ue8m0, "
      "Tensor(c!)? nonfinite=None) -> ()");
}

TORCH_LIBRARY_IMPL(glm_fp8, CUDA, m) { m.impl("quantize_blockwise_", &glm_fp8::quantize_blockwise_); }

// A plain extension module: importing glm_fp8._C loads the library, which registers the ops.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "glm_fp8 CUDA backend (torch.ops.glm_fp8)", -1, nullptr};
  return PyModule_Create(&module);
}
