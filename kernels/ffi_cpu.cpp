// FFI sparse linear: CPU kernels for the squash::ffi_linear ops (naive first version).
#include <torch/library.h>
#include <ATen/ATen.h>

namespace {

at::Tensor ffi_linear_cpu(const at::Tensor& x, const at::Tensor& values, const at::Tensor& indices) {
  TORCH_CHECK_VALUE(values.dim() == 2 && indices.sizes() == values.sizes(), "bad shapes");
  auto x2 = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  auto v = values.to(at::kFloat).contiguous();
  auto idx = indices.to(at::kLong).contiguous();
  const int64_t T = x2.size(0), in = x2.size(1), out = v.size(0), k = v.size(1);
  auto y = at::zeros({T, out}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  float* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o) {
      float acc = 0.f;
      for (int64_t j = 0; j < k; ++j) acc += vp[o * k + j] * xp[t * in + ip[o * k + j]];
      yp[t * out + o] = acc;
    }
  auto shape = x.sizes().vec();
  shape.back() = out;
  return y.to(x.scalar_type()).reshape(shape);
}

}  // namespace

TORCH_LIBRARY_IMPL(squash, CPU, m) { m.impl("ffi_linear", &ffi_linear_cpu); }
