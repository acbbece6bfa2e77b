// NF4 dequantization: torch glue of squash::nf4_dequantize for GPUs (CUDA; ROCm through hipify).
// Argument checks (worded as kernels/nf4_cpu.cpp words them), allocation, dtype dispatch and op
// registration; the device code is nf4_cuda_kernels.cuh. Runs on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "nf4_cuda_kernels.cuh"

namespace {

using namespace squash_nf4;

template <typename T>
const typename T::raw* nf4_raw(const at::Tensor& t) {
  return reinterpret_cast<const typename T::raw*>(t.const_data_ptr());
}

at::Tensor nf4_dequantize_cuda(const at::Tensor& quantized_data,
                               const at::Tensor& quantized_scalers,
                               const at::Tensor& quantization_factor,
                               const at::Tensor& scaler_mean, const at::Tensor& nf4,
                               int64_t block_size, int64_t scaler_block_size) {
  constexpr const char* op = "squash::nf4_dequantize";
  TORCH_CHECK_VALUE(quantized_data.scalar_type() == at::kByte, op,
                    ": quantized_data must be uint8, got ", quantized_data.scalar_type());
  TORCH_CHECK_VALUE(quantized_scalers.scalar_type() == at::kChar, op,
                    ": quantized_scalers must be int8, got ", quantized_scalers.scalar_type());
  const at::ScalarType st = nf4.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, op,
                    ": nf4 must be float32, bfloat16 or float16, got ", st);
  TORCH_CHECK_VALUE(quantization_factor.scalar_type() == st && scaler_mean.scalar_type() == st,
                    op, ": quantization_factor and scaler_mean must have nf4's dtype ", st);
  TORCH_CHECK_VALUE(nf4.numel() == 16 && scaler_mean.numel() == 1, op,
                    ": nf4 must have 16 elements and scaler_mean one");
  TORCH_CHECK_VALUE(block_size >= 2 && block_size % 2 == 0 && scaler_block_size >= 1, op,
                    ": block_size must be even and positive and scaler_block_size positive, got ",
                    block_size, " and ", scaler_block_size);
  const int64_t n = 2 * quantized_data.numel();
  TORCH_CHECK_VALUE(n % block_size == 0, op, ": ", n, " elements are not whole blocks of ",
                    block_size);
  const int64_t n_blocks = n / block_size;
  TORCH_CHECK_VALUE(quantized_scalers.numel() == n_blocks, op, ": quantized_scalers has ",
                    quantized_scalers.numel(), " elements, ", n_blocks, " blocks need one each");
  TORCH_CHECK_VALUE(n_blocks % scaler_block_size == 0 &&
                        quantization_factor.numel() == n_blocks / scaler_block_size,
                    op, ": quantization_factor has ", quantization_factor.numel(), " elements, ",
                    n_blocks, " blocks in scaler blocks of ", scaler_block_size, " need ",
                    n_blocks / scaler_block_size, " (and must divide evenly)");
  for (const at::Tensor* t : {&quantized_scalers, &quantization_factor, &scaler_mean, &nf4})
    TORCH_CHECK_VALUE(t->device() == quantized_data.device(), op,
                      ": all inputs must be on one device, got ", quantized_data.device(),
                      " and ", t->device());
  const c10::cuda::CUDAGuard guard(quantized_data.device());
  const at::Tensor data = quantized_data.contiguous(), qs = quantized_scalers.contiguous();
  const at::Tensor qf = quantization_factor.contiguous(), lut = nf4.contiguous();
  const at::Tensor mean = scaler_mean.contiguous();
  at::Tensor out = at::empty({n}, nf4.options().memory_format(at::MemoryFormat::Contiguous));
  if (n == 0) return out;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    launch_nf4_dequantize<T>(data.const_data_ptr<uint8_t>(), qs.const_data_ptr<int8_t>(),
                             nf4_raw<T>(qf), nf4_raw<T>(mean), nf4_raw<T>(lut), n / 2,
                             block_size / 2, scaler_block_size,
                             reinterpret_cast<typename T::raw*>(out.mutable_data_ptr()), stream);
  };
  if (st == at::kFloat)
    run(F32{});
  else if (st == at::kBFloat16)
    run(BF16{});
  else
    run(F16{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(squash, CUDA, m) { m.impl("nf4_dequantize", &nf4_dequantize_cuda); }
