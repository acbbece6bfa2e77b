// NF4 dequantization: GPU device code and its launcher (CUDA; hipified for ROCm). No torch here;
// kernels/nf4_cuda.cu is the glue. The arithmetic is kernels/nf4_cpu.cpp's, which is torchao's
// NF4Tensor.get_original_weight() op for op (compute in fp32, round to T after each op):
//   scaler[b]   = T(T(q[b] / factor[b / scaler_block_size]) + mean)
//   w[2 j]      = T(nf4[data[j] >> 4] * scaler[j / (block_size / 2)]),  w[2 j + 1]: low nibble
// so the output equals it bit for bit. The 16-entry code book sits in shared memory; each thread
// expands 4 packed bytes (8 outputs) when a block's bytes come in whole groups of 4, one byte
// otherwise.
#pragma once

#include "ffi_cuda_kernels.cuh"  // the F32 / BF16 / F16 storage and rounding rules

namespace squash_nf4 {

using squash_ffi::BF16;
using squash_ffi::F16;
using squash_ffi::F32;

template <typename T>
__device__ __forceinline__ float scaler_of(const int8_t* qs, const typename T::raw* factor,
                                           float mean, int64_t b, int64_t scaler_block_size) {
  const float s1 = T::to_acc(T::from_acc(static_cast<float>(qs[b]) /
                                         T::to_acc(factor[b / scaler_block_size])));
  return T::to_acc(T::from_acc(s1 + mean));
}

template <typename T, int BYTES>
__global__ void nf4_dequantize_kernel(const uint8_t* __restrict__ data,
                                      const int8_t* __restrict__ qs,
                                      const typename T::raw* __restrict__ factor,
                                      const typename T::raw* __restrict__ mean_p,
                                      const typename T::raw* __restrict__ nf4, int64_t nbytes,
                                      int64_t half_block, int64_t scaler_block_size,
                                      typename T::raw* __restrict__ out) {
  using raw = typename T::raw;
  __shared__ float book[16];
  if (threadIdx.x < 16) book[threadIdx.x] = T::to_acc(nf4[threadIdx.x]);
  __syncthreads();
  const float mean = T::to_acc(mean_p[0]);
  const int64_t groups = nbytes / BYTES;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j0 = g * BYTES;
    const float s = scaler_of<T>(qs, factor, mean, j0 / half_block, scaler_block_size);
    uint8_t b[BYTES];
    if constexpr (BYTES == 4) {
      const uint32_t w = reinterpret_cast<const uint32_t*>(data)[g];
#pragma unroll
      for (int i = 0; i < 4; ++i) b[i] = static_cast<uint8_t>(w >> (8 * i));
    } else {
      b[0] = data[j0];
    }
    raw v[2 * BYTES];
#pragma unroll
    for (int i = 0; i < BYTES; ++i) {
      v[2 * i] = T::from_acc(book[b[i] >> 4] * s);
      v[2 * i + 1] = T::from_acc(book[b[i] & 15] * s);
    }
    if constexpr (BYTES == 4 && sizeof(raw) == 4) {
      float4* o = reinterpret_cast<float4*>(out + 2 * j0);
      o[0] = make_float4(v[0], v[1], v[2], v[3]);
      o[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else if constexpr (BYTES == 4) {
      uint4 q;
      q.x = v[0] | (static_cast<uint32_t>(v[1]) << 16);
      q.y = v[2] | (static_cast<uint32_t>(v[3]) << 16);
      q.z = v[4] | (static_cast<uint32_t>(v[5]) << 16);
      q.w = v[6] | (static_cast<uint32_t>(v[7]) << 16);
      *reinterpret_cast<uint4*>(out + 2 * j0) = q;
    } else {
      out[2 * j0] = v[0];
      out[2 * j0 + 1] = v[1];
    }
  }
}

// Dequantize nbytes packed bytes (2 * nbytes outputs) in blocks of 2 * half_block elements.
template <typename T>
void launch_nf4_dequantize(const uint8_t* data, const int8_t* qs, const typename T::raw* factor,
                           const typename T::raw* mean, const typename T::raw* nf4,
                           int64_t nbytes, int64_t half_block, int64_t scaler_block_size,
                           typename T::raw* out, cudaStream_t stream) {
  constexpr int threads = 256;
  const bool by4 = half_block % 4 == 0;  // then 4 bytes never straddle two blocks
  const int64_t groups = by4 ? nbytes / 4 : nbytes;
  const int64_t blocks = (groups + threads - 1) / threads;
  const unsigned int grid = static_cast<unsigned int>(blocks < 65535 ? (blocks > 0 ? blocks : 1)
                                                                     : 65535);
  if (by4)
    nf4_dequantize_kernel<T, 4><<<grid, threads, 0, stream>>>(data, qs, factor, mean, nf4, nbytes,
                                                              half_block, scaler_block_size, out);
  else
    nf4_dequantize_kernel<T, 1><<<grid, threads, 0, stream>>>(data, qs, factor, mean, nf4, nbytes,
                                                              half_block, scaler_block_size, out);
}

}  // namespace squash_nf4
