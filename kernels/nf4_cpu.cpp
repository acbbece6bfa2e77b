// NF4 dequantization: the CPU kernel of squash::nf4_dequantize.
//
// torchao's NF4Tensor stores a weight of n elements as
//   quantized_data      uint8 (n / 2): two 4-bit codes a byte, the high nibble first
//   quantized_scalers   int8 (n / block_size): each block's absmax, less scaler_mean, quantized
//   quantization_factor T (n / block_size / scaler_block_size): one per block of scalers
//   scaler_mean         T (one element), nf4: T (16), the code book
// and NF4Tensor.get_original_weight() computes, in T's arithmetic (fp32, or bf16/fp16 where every
// op computes in fp32 and rounds its result to T):
//   scaler[b] = T(T(q[b] / factor[b / scaler_block_size]) + mean)
//   w[2 j]    = T(nf4[data[j] >> 4] * scaler[j / (block_size / 2)])
//   w[2 j + 1] = T(nf4[data[j] & 15] * scaler[j / (block_size / 2)])
// This kernel does the same operations in the same order, so its output is equal bit for bit.
//
// Within a block every output is one of 16 values: the kernel computes the block's 16-entry table
// (tab[c] = T(nf4[c] * scaler), exactly torchao's product) and the rest is a lookup of each code
// in that table, held in registers: AVX-512 vpermps (fp32) / vpermw (16-bit), AVX2 two vpermps
// and a blend / pshufb on byte planes, NEON tbl; a scalar loop elsewhere and for block tails.
// Threads split the blocks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace {

// ---- per-dtype arithmetic: compute in fp32, round to T (as ATen's bf16/fp16 kernels do) --------
template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}
template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

// Output bits: fp32 stays float, bf16/fp16 are stored as their 16-bit patterns.
template <typename T>
struct Bits {
  using type = uint16_t;
};
template <>
struct Bits<float> {
  using type = float;
};

template <typename T>
inline typename Bits<T>::type bits_of(T v) {
  typename Bits<T>::type b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

// ---- lookup of the codes of `nbytes` packed bytes in a 16-entry table ---------------------------
inline void lookup_scalar(const uint8_t* in, int64_t nbytes, const float* tab, float* out) {
  for (int64_t j = 0; j < nbytes; ++j) {
    out[2 * j] = tab[in[j] >> 4];
    out[2 * j + 1] = tab[in[j] & 15];
  }
}
inline void lookup_scalar(const uint8_t* in, int64_t nbytes, const uint16_t* tab, uint16_t* out) {
  for (int64_t j = 0; j < nbytes; ++j) {
    out[2 * j] = tab[in[j] >> 4];
    out[2 * j + 1] = tab[in[j] & 15];
  }
}

inline void lookup(const uint8_t* in, int64_t nbytes, const float* tab, float* out) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 t = _mm512_loadu_ps(tab);
  // Lane 2i takes byte i's high nibble, lane 2i+1 its low one (vpermps reads the low 4 bits).
  const __m512i shifts = _mm512_set_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  for (; j + 8 <= nbytes; j += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + j));
    const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)), shifts);
    _mm512_storeu_ps(out + 2 * j, _mm512_permutexvar_ps(idx, t));
  }
#elif defined(__AVX2__)
  const __m256 lo = _mm256_loadu_ps(tab), hi = _mm256_loadu_ps(tab + 8);
  const __m256i shifts = _mm256_set_epi32(0, 4, 0, 4, 0, 4, 0, 4);
  for (; j + 4 <= nbytes; j += 4) {
    int32_t four;
    std::memcpy(&four, in + j, 4);
    const __m128i b = _mm_cvtsi32_si128(four);
    const __m256i idx = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)), shifts);
    // vpermps reads the low 3 bits; bit 3, shifted into the sign, picks the upper half.
    const __m256 sel = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
    const __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx),
                                      _mm256_permutevar8x32_ps(hi, idx), sel);
    _mm256_storeu_ps(out + 2 * j, v);
  }
#elif defined(__ARM_NEON) && defined(__aarch64__)
  uint8x16x4_t t;
  t.val[0] = vld1q_u8(reinterpret_cast<const uint8_t*>(tab));
  t.val[1] = vld1q_u8(reinterpret_cast<const uint8_t*>(tab + 4));
  t.val[2] = vld1q_u8(reinterpret_cast<const uint8_t*>(tab + 8));
  t.val[3] = vld1q_u8(reinterpret_cast<const uint8_t*>(tab + 12));
  const uint8_t offs_b[16] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
  const uint8x16_t offs = vld1q_u8(offs_b);
  for (; j + 8 <= nbytes; j += 8) {
    const uint8x8_t b = vld1_u8(in + j);
    const uint8x8x2_t z = vzip_u8(vshr_n_u8(b, 4), vand_u8(b, vdup_n_u8(15)));
    const uint8x16_t codes = vcombine_u8(z.val[0], z.val[1]);  // 16 codes in output order
    const uint8x16x2_t c2 = vzipq_u8(codes, codes);
    for (int h = 0; h < 2; ++h) {
      const uint8x16x2_t c4 = vzipq_u8(c2.val[h], c2.val[h]);  // each code 4 times
      for (int q = 0; q < 2; ++q) {
        const uint8x16_t idx = vaddq_u8(vshlq_n_u8(c4.val[q], 2), offs);  // its 4 bytes
        vst1q_u8(reinterpret_cast<uint8_t*>(out + 2 * j + 8 * h + 4 * q), vqtbl4q_u8(t, idx));
      }
    }
  }
#endif
  lookup_scalar(in + j, nbytes - j, tab, out + 2 * j);
}

inline void lookup(const uint8_t* in, int64_t nbytes, const uint16_t* tab, uint16_t* out) {
  int64_t j = 0;
#if defined(__AVX512BW__)
  const __m512i t = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tab)));
  const __m512i shifts = _mm512_set1_epi32(4);  // 16-bit lanes 4, 0, 4, 0, ...
  const __m512i low4 = _mm512_set1_epi16(15);
  for (; j + 16 <= nbytes; j += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + j));
    const __m256i d = _mm256_set_m128i(_mm_unpackhi_epi8(b, b), _mm_unpacklo_epi8(b, b));
    const __m512i idx =
        _mm512_and_si512(_mm512_srlv_epi16(_mm512_cvtepu8_epi16(d), shifts), low4);
    _mm512_storeu_si512(out + 2 * j, _mm512_permutexvar_epi16(idx, t));
  }
#elif defined(__AVX2__)
  uint8_t tlo[16], thi[16];  // the table's low and high bytes
  for (int c = 0; c < 16; ++c) {
    tlo[c] = static_cast<uint8_t>(tab[c] & 0xff);
    thi[c] = static_cast<uint8_t>(tab[c] >> 8);
  }
  const __m128i vlo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tlo));
  const __m128i vhi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(thi));
  const __m128i low4 = _mm_set1_epi8(15);
  for (; j + 8 <= nbytes; j += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + j));
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), low4),
                                            _mm_and_si128(b, low4));
    const __m128i lob = _mm_shuffle_epi8(vlo, codes), hib = _mm_shuffle_epi8(vhi, codes);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * j), _mm_unpacklo_epi8(lob, hib));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * j + 8), _mm_unpackhi_epi8(lob, hib));
  }
#elif defined(__ARM_NEON) && defined(__aarch64__)
  uint8x16x2_t t;
  t.val[0] = vld1q_u8(reinterpret_cast<const uint8_t*>(tab));
  t.val[1] = vld1q_u8(reinterpret_cast<const uint8_t*>(tab + 8));
  const uint8_t offs_b[16] = {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1};
  const uint8x16_t offs = vld1q_u8(offs_b);
  for (; j + 8 <= nbytes; j += 8) {
    const uint8x8_t b = vld1_u8(in + j);
    const uint8x8x2_t z = vzip_u8(vshr_n_u8(b, 4), vand_u8(b, vdup_n_u8(15)));
    const uint8x16_t codes = vcombine_u8(z.val[0], z.val[1]);
    const uint8x16x2_t c2 = vzipq_u8(codes, codes);  // each code twice
    for (int h = 0; h < 2; ++h) {
      const uint8x16_t idx = vaddq_u8(vshlq_n_u8(c2.val[h], 1), offs);
      vst1q_u8(reinterpret_cast<uint8_t*>(out + 2 * j + 8 * h), vqtbl2q_u8(t, idx));
    }
  }
#endif
  lookup_scalar(in + j, nbytes - j, tab, out + 2 * j);
}

template <typename T>
void dequantize_impl(const uint8_t* data, const int8_t* qs, const T* factor, T mean, const T* nf4,
                     int64_t n_blocks, int64_t block_size, int64_t scaler_block_size, T* out) {
  using B = typename Bits<T>::type;
  const int64_t half = block_size / 2;
  float code_book[16];
  for (int c = 0; c < 16; ++c) code_book[c] = to_f(nf4[c]);
  const float mean_f = to_f(mean);
  // About 32 KiB of output per task at the least.
  const int64_t grain = std::max<int64_t>(1, 8192 / block_size);
  at::parallel_for(0, n_blocks, grain, [&](int64_t b0, int64_t b1) {
    B tab[16];
    for (int64_t b = b0; b < b1; ++b) {
      // torchao: (int8 / factor) in T, then + scaler_mean in T.
      const T s1 = round_to<T>(static_cast<float>(qs[b]) / to_f(factor[b / scaler_block_size]));
      const float s = to_f(round_to<T>(to_f(s1) + mean_f));
      for (int c = 0; c < 16; ++c) tab[c] = bits_of(round_to<T>(code_book[c] * s));
      lookup(data + b * half, half, tab, reinterpret_cast<B*>(out) + b * block_size);
    }
  });
}

at::Tensor nf4_dequantize_cpu(const at::Tensor& quantized_data, const at::Tensor& quantized_scalers,
                              const at::Tensor& quantization_factor, const at::Tensor& scaler_mean,
                              const at::Tensor& nf4, int64_t block_size,
                              int64_t scaler_block_size) {
  constexpr const char* op = "squash::nf4_dequantize";
  TORCH_CHECK_VALUE(quantized_data.scalar_type() == at::kByte, op,
                    ": quantized_data must be uint8, got ", quantized_data.scalar_type());
  TORCH_CHECK_VALUE(quantized_scalers.scalar_type() == at::kChar, op,
                    ": quantized_scalers must be int8, got ", quantized_scalers.scalar_type());
  const at::ScalarType st = nf4.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, op,
                    ": nf4 must be float32, bfloat16 or float16, got ", st);
  TORCH_CHECK_VALUE(quantization_factor.scalar_type() == st && scaler_mean.scalar_type() == st,
                    op, ": quantization_factor (", quantization_factor.scalar_type(),
                    ") and scaler_mean (", scaler_mean.scalar_type(), ") must have nf4's dtype ",
                    st);
  TORCH_CHECK_VALUE(nf4.numel() == 16 && scaler_mean.numel() == 1, op,
                    ": nf4 must have 16 elements and scaler_mean one, got ", nf4.numel(), " and ",
                    scaler_mean.numel());
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
                    op, ": quantization_factor has ", quantization_factor.numel(),
                    " elements, ", n_blocks, " blocks in scaler blocks of ", scaler_block_size,
                    " need ", n_blocks / scaler_block_size, " (and must divide evenly)");
  const at::Tensor data = quantized_data.contiguous(), qs = quantized_scalers.contiguous();
  const at::Tensor qf = quantization_factor.contiguous(), lut = nf4.contiguous();
  at::Tensor out = at::empty({n}, nf4.options().memory_format(at::MemoryFormat::Contiguous));
  if (n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st, "nf4_dequantize", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      dequantize_impl<scalar_t>(data.data_ptr<uint8_t>(), qs.data_ptr<int8_t>(),
                                qf.data_ptr<scalar_t>(), scaler_mean.item<scalar_t>(),
                                lut.data_ptr<scalar_t>(), n_blocks, block_size,
                                scaler_block_size, out.data_ptr<scalar_t>());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(squash, CPU, m) { m.impl("nf4_dequantize", &nf4_dequantize_cpu); }
