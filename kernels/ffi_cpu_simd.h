// SIMD helpers for the FFI CPU kernels (ffi_cpu.cpp): the vector type the target's widest unit
// holds, 8x8 (and on AVX-512 16x16) block transposes with dtype conversion, and an 8-way
// horizontal sum.
//
// The vector width is chosen at compile time from the target (-march=native, or the narrower
// variant SQUASH_CPU_ISA asks for): 64 bytes (16 fp32 lanes) with AVX-512F, 32 bytes (8 lanes)
// with AVX2 + FMA, 16 bytes (4 lanes) with NEON on aarch64 and on any other CPU. The vector types
// are GCC/Clang vector extensions, so the micro-kernels in ffi_cpu.cpp are written once over the
// width and compile to zmm, ymm or NEON q-register FMAs. The tile copies transpose 8x8 blocks
// (AVX2/F16C where present, which every AVX-512 CPU has; portable loops elsewhere), and on
// AVX-512 fp32 tiles 16x16 blocks, whose rows are whole cache lines. The 8-way sum folds a wide
// vector to 8 lanes first.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SQUASH_FFI_AVX2 1
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(SQUASH_FFI_AVX2)
#define SQUASH_FFI_VEC_BYTES 64
#define SQUASH_FFI_ISA "avx512"
#elif defined(SQUASH_FFI_AVX2)
#define SQUASH_FFI_VEC_BYTES 32
#define SQUASH_FFI_ISA "avx2"
#elif defined(__ARM_NEON)
#define SQUASH_FFI_VEC_BYTES 16
#define SQUASH_FFI_ISA "neon"
#else
#define SQUASH_FFI_VEC_BYTES 16
#define SQUASH_FFI_ISA "generic"
#endif

namespace squash_ffi_cpu {

constexpr int kVecBytes = SQUASH_FFI_VEC_BYTES;
typedef float vfloat __attribute__((vector_size(kVecBytes)));
typedef double vdouble __attribute__((vector_size(kVecBytes)));

// Vec<acc_t>::type: one vector of acc_t; lanes values per vector.
template <typename acc_t>
struct Vec;
template <>
struct Vec<float> {
  using type = vfloat;
  static constexpr int lanes = kVecBytes / 4;
};
template <>
struct Vec<double> {
  using type = vdouble;
  static constexpr int lanes = kVecBytes / 8;
};

template <typename V>
inline V load_vec(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V>
inline void store_vec(void* p, V v) {
  std::memcpy(p, &v, sizeof(V));
}

// d[c * ds + r] = s[r * ss + c] for r, c < 8, converting src_t -> dst_t (portable version).
template <typename src_t, typename dst_t>
inline void transpose8(const src_t* s, int64_t ss, dst_t* d, int64_t ds) {
  dst_t b[8][8];
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < 8; ++c) b[c][r] = static_cast<dst_t>(s[r * ss + c]);
  for (int c = 0; c < 8; ++c)
    for (int r = 0; r < 8; ++r) d[c * ds + r] = b[c][r];
}

#ifdef SQUASH_FFI_AVX2

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// Round to nearest even, NaN -> 0x7FC0: the same bits as c10::BFloat16(float).
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                       nan));
  r = _mm256_srli_epi32(r, 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

inline void transpose8_regs(__m256 (&r)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Into fp32 tiles from fp32/bf16/fp16 rows.
template <typename src_t>
inline void transpose8_to_float(const src_t* s, int64_t ss, float* d, int64_t ds) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = load8(s + i * ss);
  transpose8_regs(r);
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(d + i * ds, r[i]);
}
template <>
inline void transpose8<float, float>(const float* s, int64_t ss, float* d, int64_t ds) {
  transpose8_to_float(s, ss, d, ds);
}
template <>
inline void transpose8<c10::BFloat16, float>(const c10::BFloat16* s, int64_t ss, float* d,
                                             int64_t ds) {
  transpose8_to_float(s, ss, d, ds);
}
template <>
inline void transpose8<c10::Half, float>(const c10::Half* s, int64_t ss, float* d, int64_t ds) {
  transpose8_to_float(s, ss, d, ds);
}

// Out of fp32 blocks into bf16/fp16 rows.
template <typename dst_t>
inline void transpose8_from_float(const float* s, int64_t ss, dst_t* d, int64_t ds) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + i * ss);
  transpose8_regs(r);
  for (int i = 0; i < 8; ++i) store8(d + i * ds, r[i]);
}
template <>
inline void transpose8<float, c10::BFloat16>(const float* s, int64_t ss, c10::BFloat16* d,
                                             int64_t ds) {
  transpose8_from_float(s, ss, d, ds);
}
template <>
inline void transpose8<float, c10::Half>(const float* s, int64_t ss, c10::Half* d, int64_t ds) {
  transpose8_from_float(s, ss, d, ds);
}

#endif  // SQUASH_FFI_AVX2

#if defined(SQUASH_FFI_AVX2) && defined(__AVX512F__)
// 16x16 block transposes on AVX-512: each row read or written is a whole 64-byte line of fp32
// (half as many partial-line accesses as the 8x8 blocks), in 16 loads, 64 shuffles, 16 stores.
#define SQUASH_FFI_AVX512 1

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// bf16/fp16: two 8-lane stores, rounded as store8 rounds.
template <typename dst_t>
inline void store16(dst_t* p, __m512 v) {
  store8(p, _mm512_castps512_ps256(v));
  store8(p + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

inline void transpose16_regs(__m512 (&r)[16]) {
  __m512 t[16];
  // Within each 128-bit lane: 4x4 transposes of rows 4g..4g+3.
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  // r[4g + c], lane L: rows 4g..4g+3 of column 4L + c. Then a 4x4 transpose of the lanes of
  // r[c], r[4 + c], r[8 + c], r[12 + c] puts column 4L + c in r[4L + c].
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_f32x4(r[c], r[c + 4], _MM_SHUFFLE(2, 0, 2, 0));
    t[c + 4] = _mm512_shuffle_f32x4(r[c], r[c + 4], _MM_SHUFFLE(3, 1, 3, 1));
    t[c + 8] = _mm512_shuffle_f32x4(r[c + 8], r[c + 12], _MM_SHUFFLE(2, 0, 2, 0));
    t[c + 12] = _mm512_shuffle_f32x4(r[c + 8], r[c + 12], _MM_SHUFFLE(3, 1, 3, 1));
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_f32x4(t[c], t[c + 8], _MM_SHUFFLE(2, 0, 2, 0));
    r[c + 8] = _mm512_shuffle_f32x4(t[c], t[c + 8], _MM_SHUFFLE(3, 1, 3, 1));
    r[c + 4] = _mm512_shuffle_f32x4(t[c + 4], t[c + 12], _MM_SHUFFLE(2, 0, 2, 0));
    r[c + 12] = _mm512_shuffle_f32x4(t[c + 4], t[c + 12], _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// d[c * ds + r] = s[r * ss + c] for r, c < 16: fp32/bf16/fp16 rows into fp32 tiles, or fp32
// blocks out into fp32/bf16/fp16 rows.
template <typename src_t, typename dst_t>
inline void transpose16(const src_t* s, int64_t ss, dst_t* d, int64_t ds) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = load16(s + i * ss);
  transpose16_regs(r);
  for (int i = 0; i < 16; ++i) store16(d + i * ds, r[i]);
}

#endif  // AVX-512

// out[q] += sum of the lanes of p[q], q < 8 (p: 8 vectors of acc_t; portable version).
template <typename V, typename acc_t>
inline void add_hsum8(const V (&p)[8], acc_t* out) {
  for (int q = 0; q < 8; ++q) {
    acc_t s = 0;
    for (int l = 0; l < static_cast<int>(sizeof(V) / sizeof(acc_t)); ++l) s += p[q][l];
    out[q] += s;
  }
}

#ifdef SQUASH_FFI_AVX2
inline void add_hsum8_m256(const __m256 (&p)[8], float* out) {
  const __m256 h01 = _mm256_hadd_ps(p[0], p[1]);
  const __m256 h23 = _mm256_hadd_ps(p[2], p[3]);
  const __m256 h45 = _mm256_hadd_ps(p[4], p[5]);
  const __m256 h67 = _mm256_hadd_ps(p[6], p[7]);
  const __m256 a = _mm256_hadd_ps(h01, h23);  // sums 0..3: low halves | high halves
  const __m256 b = _mm256_hadd_ps(h45, h67);  // sums 4..7
  const __m256 lo = _mm256_permute2f128_ps(a, b, 0x20), hi = _mm256_permute2f128_ps(a, b, 0x31);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), _mm256_add_ps(lo, hi)));
}

#ifdef SQUASH_FFI_AVX512
// 16-lane fp32 vectors: the eight sums in registers, halving the partials 16 -> 8 -> 4 -> 2 -> 1
// lanes with lane shuffles (no trip through memory).
template <>
inline void add_hsum8<vfloat, float>(const vfloat (&p)[8], float* out) {
  __m512 q[8], t[4];
  for (int i = 0; i < 8; ++i) std::memcpy(&q[i], &p[i], sizeof(__m512));
  // t[i]: 8 partials of p[2i] in the low 256 bits, of p[2i + 1] in the high ones.
  for (int i = 0; i < 4; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // u0, 128-bit lane L: 4 partials of p[L]; u1: of p[4 + L].
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(t[2], t[3], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane L: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] (a: u0's lane, b: u1's), then the pairs added.
  const __m512 c = _mm512_add_ps(_mm512_unpacklo_ps(u0, u1), _mm512_unpackhi_ps(u0, u1));
  const __m512 e = _mm512_add_ps(c, _mm512_permute_ps(c, _MM_SHUFFLE(1, 0, 3, 2)));
  // lane L, element 0: the sum of p[L]; element 1: of p[4 + L].
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m256 sums = _mm512_castps512_ps256(_mm512_permutexvar_ps(order, e));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), sums));
}
#else
// Any fp32 vector of 8 or more lanes: fold halves down to 8 lanes, then the AVX2 sum.
template <>
inline void add_hsum8<vfloat, float>(const vfloat (&p)[8], float* out) {
  __m256 r[8];
  for (int q = 0; q < 8; ++q) {
    float lanes[Vec<float>::lanes];
    std::memcpy(lanes, &p[q], sizeof(vfloat));
    __m256 acc = _mm256_loadu_ps(lanes);
    for (int h = 8; h < Vec<float>::lanes; h += 8)
      acc = _mm256_add_ps(acc, _mm256_loadu_ps(lanes + h));
    r[q] = acc;
  }
  add_hsum8_m256(r, out);
}
#endif  // SQUASH_FFI_AVX512
#endif

}  // namespace squash_ffi_cpu
