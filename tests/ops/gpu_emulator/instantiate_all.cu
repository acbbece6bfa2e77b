#include "ffi_cuda_kernels.cuh"
namespace {
template <typename T, typename I>
void all(cudaStream_t s) {
  using namespace squash_ffi;
  launch_validate<I>(nullptr, 0, 0, 0, nullptr, s);
  launch_pack<T, I>(nullptr, nullptr, nullptr, 0, nullptr, s);
  launch_chunk_ptr<I>(nullptr, nullptr, 0, 0, 0, 1, nullptr, s);
  launch_spmm<T>(nullptr, 0, 0, false, nullptr, nullptr, 0, 0, 1, 1, nullptr, nullptr, false, s);
  launch_sddmm<T, I>(nullptr, nullptr, 0, 0, false, false, nullptr, nullptr, 0, 0, 1, 1, 0,
                     nullptr, s);
  launch_small_tokens<T, I>(nullptr, 0, 0, nullptr, nullptr, 0, 0, nullptr, s);
}
}  // namespace
void squash_ffi_instantiate_all(cudaStream_t s) {
  using namespace squash_ffi;
  all<F32, int16_t>(s); all<F32, int32_t>(s); all<F64, int16_t>(s); all<F64, int32_t>(s);
  all<BF16, int16_t>(s); all<BF16, int32_t>(s); all<F16, int16_t>(s); all<F16, int32_t>(s);
}
