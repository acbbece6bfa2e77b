// FFI sparse linear: CPU kernels for squash::ffi_linear, ffi_linear_grad_input and
// ffi_linear_grad_values.
//
// Every row o of the FFI matrix keeps k non-zeros: values (out, k) at columns indices (out, k).
//   forward       y[t, o]  = sum_j values[o, j] * x[t, indices[o, j]]
//   grad_input    gx[t, i] = sum_{(o, j): indices[o, j] = i} values[o, j] * g[t, o]
//   grad_values   gv[o, j] = sum_t g[t, o] * x[t, indices[o, j]]
//
// Layout. Token-major activations (T, F) are copied, tile by tile, into feature-major tiles
// (F, W) of W tokens (zero past the last token; fp32, or fp64 for fp64 inputs). W runs from one
// vector (16 fp32 lanes with AVX-512, 8 with AVX2, at least 8 tokens) up to 64 fp32 tokens for
// long rows, and up to 128 for the values gradient on AVX-512; the vector width comes from the
// compile target (ffi_cpu_simd.h). A gathered feature
// is then W contiguous values: each gathered row costs W / lanes vector loads and fused
// multiply-adds, and the W sums of one output row stay in registers across the whole fan-in.
// W is chosen so that a tile stays in L2.
//   forward:     x tile -> xT (in, W); every y row gathers its k rows of xT.
//   grad_input:  g tile -> gT (out, W); every gx row gathers the rows of gT listed by the
//                transposed (CSC) pattern, built once per call by a counting sort of the indices
//                by column: for input feature i, the (o, values[o, j]) with indices[o, j] = i.
//                Each gx row has one writer: no atomics.
//   Both are one gather-SpMM (gather_spmm) over a row-wise sparse matrix; only where a row's
//   (column, value) pairs come from differs.
//   grad_values: x and g tiles -> xT, gT; gv[o, j] += dot(gT[o], xT[indices[o, j]]).
// Long rows (low sparsity) are gathered one block of the tile at a time, a block small enough to
// stay in L1, with 64 rows accumulating in memory meanwhile.
// Many tokens: threads take whole tiles (grad_values sums per-thread partials at the end). Few
// tokens: all tiles are transposed once, then threads split the output rows. One or two tokens
// skip the tiles: a direct gather on the token rows (forward, grad_values); grad_input scatters
// into up to eight token rows, cheaper there than building its CSC pattern.
//
// Inputs are checked with TORCH_CHECK_VALUE (a Python ValueError) before any memory is read
// through the indices: the whole FFI index contract (ffi_index_check.h, worded as
// squash.sparsity.validate_ffi words it) in one pass over the indices.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include "ffi_cpu_simd.h"
#include "ffi_index_check.h"

namespace {

// ---- per-phase thread time, for benchmarks/ffi_kernels.py ---------------------------------------
// Off unless squash_ffi_cpu_phases(1) turned it on (then each timed region reads the clock twice).
// Phases: 0 tile transposes in (token- to feature-major), 1 tile transposes out, 2 gather
// multiply-adds (their row blocks, less the transposes out they contain), 3 the CSC build of the
// input gradient (wall time of the calling thread).
std::atomic<bool> g_phase_on{false};
std::atomic<int64_t> g_phase_ns[4];

struct PhaseTimer {
  int id;
  bool on;
  std::chrono::steady_clock::time_point t0;
  explicit PhaseTimer(int i) : id(i), on(g_phase_on.load(std::memory_order_relaxed)) {
    if (on) t0 = std::chrono::steady_clock::now();
  }
  ~PhaseTimer() {
    if (on)
      g_phase_ns[id].fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now() - t0)
                                   .count(),
                               std::memory_order_relaxed);
  }
};

using squash_ffi_cpu::load_vec;
using squash_ffi_cpu::store_vec;
using squash_ffi_cpu::Vec;

template <typename scalar_t>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};

// Bytes of the feature-major tile(s) one thread gathers from (half of a 512 KiB L2).
constexpr int64_t kTileBytes = 256 * 1024;
// The values gradient's tiles may fill half of the core's L2 where that is larger (l2_bytes).
// Its tokens are summed across a vector and then across lanes for every gathered row, so wider
// tiles (up to kDotVectors vectors: a row of the g tile and eight running sums stay in
// registers) spread those horizontal sums over more tokens.
#ifdef SQUASH_FFI_AVX512
constexpr int kDotVectors = 8;  // 32 vector registers
#else
constexpr int kDotVectors = 4;
#endif
// Up to this many tokens, the forward and the values gradient gather from the token rows
// directly, and the input gradient scatters into them (cheaper than building its CSC pattern).
constexpr int64_t kDirectTokens = 2;
constexpr int64_t kDirectScatterTokens = 8;
// Output rows computed per block before their W tokens are written back token-major (at most).
constexpr int64_t kRowBlock = 64;
// Long rows are gathered one block of features at a time, so that the part of the tile being
// read (kBlockBytes) stays in L1 while kRowBlock rows accumulate: used from kMinBlockedTokens
// tokens when a row holds at least kMinSegment indices per block on average.
constexpr int64_t kBlockBytes = 32 * 1024;
constexpr int64_t kMinSegment = 24;
constexpr int64_t kMinBlockedTokens = 128;
// Features per pass of a 16x16 tile copy (AVX-512): 128 features of a 32-token tile are 16 KiB.
constexpr int64_t kCopyFeatures = 128;

int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

// a * b + c, fused where the CPU has FMA: the direct (token-row) paths spell it out so that the
// compiler rounds alike however it vectorizes them (int16 and int32 indices give equal bits).
template <typename T>
inline T fmadd(T a, T b, T c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// Rough costs on one core (nanoseconds), used only to keep small jobs on the calling thread.
constexpr double kNsPerCopy = 0.25;     // one element through a tile transpose
constexpr double kNsPerTileFma = 0.05;  // one multiply-add inside a tile (8 per vector op)
constexpr double kNsPerDirect = 1.0;    // one gathered or scattered multiply-add on token rows
constexpr double kNsPerCscEntry = 4.0;  // one index through the counting sort of the CSC pattern
// Jobs estimated below this run on the calling thread: starting the pool costs microseconds,
// and on a busy machine a parallel region can wait a whole scheduler tick for its last thread.
constexpr double kSerialNs = 100e3;

// Grain for at::parallel_for over n items of ns_per_item each: all n (one chunk, inline) for a
// small job, else 1.
int64_t grain_for(int64_t n, double ns_per_item) {
  return static_cast<double>(n) * ns_per_item < kSerialNs ? std::max<int64_t>(n, 1) : 1;
}

// Per-thread scratch kept between calls and grown on demand, 64-byte aligned. Buffers alive at
// the same time on one thread use different slots.
template <typename T>
T* scratch(int slot, int64_t n) {
  thread_local std::vector<char> buffers[2];
  std::vector<char>& buf = buffers[slot];
  const size_t bytes = static_cast<size_t>(n) * sizeof(T) + 64;
  if (buf.size() < bytes) buf.resize(bytes);
  const auto p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<T*>((p + 63) & ~static_cast<uintptr_t>(63));
}

// Tile widths (tokens) for acc_t: from one vector (at least 8 tokens, the transpose block) up
// to wide_width, 256 bytes of a token row: 64 fp32 or 32 fp64 tokens.
template <typename acc_t>
constexpr int min_width() {
  return Vec<acc_t>::lanes > 8 ? Vec<acc_t>::lanes : 8;
}
template <typename acc_t>
constexpr int wide_width() {
  return 256 / sizeof(acc_t) > min_width<acc_t>() ? 256 / sizeof(acc_t) : min_width<acc_t>();
}

// The values gradient's widest tile: kDotVectors vectors, and no narrower than 32 tokens.
template <typename acc_t>
constexpr int dot_width() {
  return kDotVectors * Vec<acc_t>::lanes > 32 ? kDotVectors * Vec<acc_t>::lanes : 32;
}

// L2 bytes of one core as the OS reports them (sysconf), else 512 KiB.
int64_t l2_bytes() {
  static const int64_t bytes = [] {
#ifdef _SC_LEVEL2_CACHE_SIZE
    const long b = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (b > 0) return static_cast<int64_t>(b);
#endif
    return int64_t{512 * 1024};
  }();
  return bytes;
}

// Tile width for `rows` feature rows of acc_t per token and T tokens: up to `widest` tokens,
// halved while the tile exceeds `budget` bytes.
template <typename acc_t>
int64_t tile_width(int64_t rows, int64_t tokens, int64_t widest = 32,
                   int64_t budget = kTileBytes) {
  constexpr int64_t lo = min_width<acc_t>(), elem = sizeof(acc_t);
  int64_t w = std::max<int64_t>(widest, lo);
  while (w > lo && rows * w * elem > budget) w /= 2;
  while (w > lo && w / 2 >= tokens) w /= 2;  // do not pad a few tokens out to a wide tile
  return w;
}

// Runs f(std::integral_constant<int, W>{}) for the runtime tile width W: the smallest of
// min_width, 2 min_width, ..., Wmax that holds W.
template <typename acc_t, int Wmax = wide_width<acc_t>(), int Wc = min_width<acc_t>(),
          typename F>
void with_width(int64_t W, const F& f) {
  if constexpr (Wc >= Wmax) {
    f(std::integral_constant<int, Wc>{});
  } else {
    if (W <= Wc)
      f(std::integral_constant<int, Wc>{});
    else
      with_width<acc_t, Wmax, 2 * Wc>(W, f);
  }
}

// Blocks of `width` key values (feature or row ids) over the entries of each row r, the entries
// [begin(r), end(r)) with keys `keys`: seg[r * (nb + 1) + b] is the offset (from begin(r)) of the
// first entry in block b, and seg[r * (nb + 1) + nb] the row length. Keys come sorted within a
// row, but any order still splits a row into nb ranges covering each entry once (sums stay
// right; only the locality is lost).
struct Blocks {
  int64_t width = 0, nb = 0;
  at::Tensor holder;
  const int32_t* seg = nullptr;
  const int32_t* row(int64_t r) const { return seg + r * (nb + 1); }
};

template <typename key_t, typename Begin>
Blocks make_blocks(const key_t* keys, int64_t rows, int64_t key_limit, int64_t width,
                   const Begin& begin) {
  Blocks blk;
  blk.width = width;
  const int64_t nb = blk.nb = div_up(key_limit, width);
  blk.holder = at::empty({rows * (nb + 1)}, at::kInt);
  int32_t* seg = blk.holder.data_ptr<int32_t>();
  const double ns =
      (static_cast<double>(begin(rows)) / std::max<int64_t>(rows, 1) + nb) * kNsPerCopy;
  at::parallel_for(0, rows, grain_for(rows, ns), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const key_t* kr = keys + begin(r);
      const int64_t n = begin(r + 1) - begin(r);
      int32_t* sr = seg + r * (nb + 1);
      int64_t j = 0;
      for (int64_t b = 0; b < nb; ++b) {
        sr[b] = static_cast<int32_t>(j);
        while (j < n && kr[j] < (b + 1) * width) ++j;
      }
      sr[nb] = static_cast<int32_t>(n);
    }
  });
  blk.seg = seg;
  return blk;
}

// ---- tile copies ----------------------------------------------------------------------------

// dst[f * W + l] = src[l * rs + f] for l < tv, 0 for tv <= l < W; f < F. src: the tile's first
// token row.
template <typename scalar_t, typename acc_t>
void to_feature_major(const scalar_t* src, int64_t rs, int64_t tv, int64_t F, int64_t W,
                      acc_t* __restrict dst) {
  const PhaseTimer timer(0);
  int64_t l16 = 0;  // tokens below l16 are done
#ifdef SQUASH_FFI_AVX512
  if constexpr (std::is_same<acc_t, float>::value) {
    // 16x16 blocks, kCopyFeatures features at a time so that their rows of the tile stay in L1
    // while all the tile's tokens are written.
    const int64_t f16 = F / 16 * 16;
    l16 = tv / 16 * 16;
    for (int64_t fb = 0; fb < f16; fb += kCopyFeatures) {
      const int64_t fe = std::min(f16, fb + kCopyFeatures);
      for (int64_t l0 = 0; l0 < l16; l0 += 16)
        for (int64_t f0 = fb; f0 < fe; f0 += 16)
          squash_ffi_cpu::transpose16(src + l0 * rs + f0, rs, dst + f0 * W + l0, W);
    }
    for (int64_t l = 0; l < l16; ++l)
      for (int64_t f = f16; f < F; ++f) dst[f * W + l] = static_cast<acc_t>(src[l * rs + f]);
  }
#endif
  const int64_t t8 = tv / 8 * 8, f8 = F / 8 * 8;
  for (int64_t l0 = l16; l0 < t8; l0 += 8) {
    for (int64_t f0 = 0; f0 < f8; f0 += 8)
      squash_ffi_cpu::transpose8(src + l0 * rs + f0, rs, dst + f0 * W + l0, W);
    for (int64_t f = f8; f < F; ++f)
      for (int64_t l = l0; l < l0 + 8; ++l) dst[f * W + l] = static_cast<acc_t>(src[l * rs + f]);
  }
  for (int64_t l = t8; l < tv; ++l)
    for (int64_t f = 0; f < F; ++f) dst[f * W + l] = static_cast<acc_t>(src[l * rs + f]);
  if (tv < W)
    for (int64_t f = 0; f < F; ++f) std::fill(dst + f * W + tv, dst + (f + 1) * W, acc_t(0));
}

// dst[l * ds + b] = blk[b * W + l] for b < nr, l < tv. dst: the block's first element.
// Token rows are written one 8-token group at a time, all nr values of a row together.
template <typename scalar_t, typename acc_t>
void to_token_major(const acc_t* blk, int64_t nr, int64_t W, int64_t tv, scalar_t* dst,
                    int64_t ds) {
  const PhaseTimer timer(1);
  int64_t l16 = 0;  // tokens below l16 are done
#ifdef SQUASH_FFI_AVX512
  if constexpr (std::is_same<acc_t, float>::value) {
    const int64_t r16 = nr / 16 * 16;
    l16 = tv / 16 * 16;
    for (int64_t l0 = 0; l0 < l16; l0 += 16) {
      for (int64_t b0 = 0; b0 < r16; b0 += 16)
        squash_ffi_cpu::transpose16(blk + b0 * W + l0, W, dst + l0 * ds + b0, ds);
      for (int64_t l = l0; l < l0 + 16; ++l)
        for (int64_t b = r16; b < nr; ++b) dst[l * ds + b] = static_cast<scalar_t>(blk[b * W + l]);
    }
  }
#endif
  const int64_t t8 = tv / 8 * 8, r8 = nr / 8 * 8;
  for (int64_t l0 = l16; l0 < t8; l0 += 8) {
    for (int64_t b0 = 0; b0 < r8; b0 += 8)
      squash_ffi_cpu::transpose8(blk + b0 * W + l0, W, dst + l0 * ds + b0, ds);
    for (int64_t l = l0; l < l0 + 8; ++l)
      for (int64_t b = r8; b < nr; ++b) dst[l * ds + b] = static_cast<scalar_t>(blk[b * W + l]);
  }
  for (int64_t l = t8; l < tv; ++l)
    for (int64_t b = 0; b < nr; ++b) dst[l * ds + b] = static_cast<scalar_t>(blk[b * W + l]);
}

// Rows per (tile, row block) work item when few tiles are split over threads: up to
// kRowBlock, down to 8 until there are a few items per thread.
int64_t split_rows(int64_t rows, int64_t tiles) {
  int64_t rb = kRowBlock;
  while (rb > 8 && tiles * div_up(rows, rb) < 4 * at::get_num_threads()) rb /= 2;
  return rb;
}

// ---- micro-kernels ----------------------------------------------------------------------------

// out[l] (+)= sum_{e < n} w[e] * tile[ix[e] * W + l] for l < W (adds to out when kAdd). S
// interleaved partial sums keep 8 vector FMA chains in flight for every W.
template <int W, bool kAdd, typename acc_t, typename ix_t>
inline void gather_accumulate(const acc_t* __restrict tile, const ix_t* __restrict ix,
                              const acc_t* __restrict w, int64_t n, acc_t* __restrict out) {
  using V = typename Vec<acc_t>::type;
  constexpr int L = Vec<acc_t>::lanes, NV = W / L, S = NV >= 8 ? 1 : 8 / NV;
  V acc[S][NV];
  for (int s = 0; s < S; ++s)
    for (int v = 0; v < NV; ++v) acc[s][v] = (kAdd && s == 0) ? load_vec<V>(out + v * L) : V{};
  int64_t e = 0;
  for (; e + S <= n; e += S) {
    for (int s = 0; s < S; ++s) {
      const acc_t ws = w[e + s];
      const acc_t* r = tile + static_cast<int64_t>(ix[e + s]) * W;
      for (int v = 0; v < NV; ++v) acc[s][v] += ws * load_vec<V>(r + v * L);
    }
  }
  for (; e < n; ++e) {
    const acc_t ws = w[e];
    const acc_t* r = tile + static_cast<int64_t>(ix[e]) * W;
    for (int v = 0; v < NV; ++v) acc[0][v] += ws * load_vec<V>(r + v * L);
  }
  for (int v = 0; v < NV; ++v) {
    for (int s = 1; s < S; ++s) acc[0][v] += acc[s][v];
    store_vec(out + v * L, acc[0][v]);
  }
}

// part[j] += sum_{l < W} g[l] * tile[ix[j] * W + l] for j < n.
template <int W, typename acc_t, typename ix_t>
inline void dot_rows(const acc_t* __restrict g, const acc_t* __restrict tile,
                     const ix_t* __restrict ix, int64_t n, acc_t* __restrict part) {
  using V = typename Vec<acc_t>::type;
  constexpr int L = Vec<acc_t>::lanes, NV = W / L;
  V G[NV];
  for (int v = 0; v < NV; ++v) G[v] = load_vec<V>(g + v * L);
  auto dot = [&](int64_t j) {
    const acc_t* r = tile + static_cast<int64_t>(ix[j]) * W;
    V p = G[0] * load_vec<V>(r);
    for (int v = 1; v < NV; ++v) p += G[v] * load_vec<V>(r + v * L);
    return p;
  };
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    V p[8];
    for (int q = 0; q < 8; ++q) p[q] = dot(j + q);
    squash_ffi_cpu::add_hsum8(p, part + j);
  }
  for (; j < n; ++j) {
    const V p = dot(j);
    acc_t s = 0;
    for (int l = 0; l < L; ++l) s += p[l];
    part[j] += s;
  }
}

// ---- checks -----------------------------------------------------------------------------------

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

// indices (out, k) of int16/int32 on the CPU; `what` names where (out, k) comes from.
void check_pattern(const char* op, const at::Tensor& indices, int64_t out, int64_t k,
                   const char* what = "values") {
  TORCH_CHECK_VALUE(indices.dim() == 2, op,
                    ": FFI indices must be a 2-D tensor (out_features, k), got ",
                    squash_ffi_check::shape_str(indices.sizes()));
  TORCH_CHECK_VALUE(indices.scalar_type() == at::kShort || indices.scalar_type() == at::kInt,
                    op, ": FFI indices must be int16 or int32, got ", indices.scalar_type());
  TORCH_CHECK_VALUE(indices.size(0) == out && indices.size(1) == k, op, ": FFI ", what,
                    " shape (", out, ", ", k, ") does not match indices shape ",
                    squash_ffi_check::shape_str(indices.sizes()));
  TORCH_CHECK_VALUE(indices.device().is_cpu(), op, ": indices must be on the CPU");
}

// The whole index contract (ffi_index_check.h) for rows of width in_features, before any
// memory is read through the indices: one pass over them, the message only on failure.
template <typename idx_t>
void check_indices(const char* op, const idx_t* idx, int64_t rows, int64_t k,
                   int64_t in_features) {
  const std::string shape = squash_ffi_check::shape_error<idx_t>(k, in_features);
  TORCH_CHECK_VALUE(shape.empty(), op, ": ", shape);
  if (rows == 0 || squash_ffi_check::rows_ok(idx, rows, k, in_features)) return;
  TORCH_CHECK_VALUE(false, op, ": ", squash_ffi_check::index_error(idx, rows, k, in_features));
}

void check_indices(const char* op, const at::Tensor& indices, int64_t in_features) {
  const int64_t rows = indices.size(0), k = indices.size(1);
  if (indices.scalar_type() == at::kShort)
    check_indices(op, indices.data_ptr<int16_t>(), rows, k, in_features);
  else
    check_indices(op, indices.data_ptr<int32_t>(), rows, k, in_features);
}

void check_float(const char* op, const at::Tensor& a, const char* a_name, const at::Tensor& b,
                 const char* b_name) {
  TORCH_CHECK_VALUE(is_float_type(a.scalar_type()), op, ": ", a_name,
                    " must be float32/64, bfloat16 or float16, got ", a.scalar_type());
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type(), op, ": ", a_name, " (", a.scalar_type(),
                    ") and ", b_name, " (", b.scalar_type(), ") must share a dtype");
  TORCH_CHECK_VALUE(a.device().is_cpu() && b.device().is_cpu(), op,
                    ": tensors must be on the CPU");
}

// (..., F) -> (T, F) with unit stride along F (a view when possible).
at::Tensor token_rows(const at::Tensor& t) {
  at::Tensor r = t.dim() == 2 ? t : t.reshape({-1, t.size(-1)});
  if (r.size(1) > 1 && r.stride(1) != 1) r = r.contiguous();
  return r;
}

// values as a contiguous (out, k) buffer of acc_t; no copy for contiguous fp32/fp64.
template <typename scalar_t, typename acc_t>
const acc_t* values_as_acc(const at::Tensor& values, at::Tensor& holder) {
  if (std::is_same<scalar_t, acc_t>::value && values.is_contiguous())
    return reinterpret_cast<const acc_t*>(values.data_ptr<scalar_t>());
  holder = values.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
  return holder.data_ptr<acc_t>();
}

at::Tensor acc_buffer(int64_t n, at::ScalarType acc) { return at::empty({n}, at::dtype(acc)); }

// ---- gather-SpMM: the forward and the input gradient ------------------------------------------

// A sparse matrix (rows, F) by rows: row r holds the pairs (cols[e], vals[e]) for e in
// [ptr(r), ptr(r + 1)), columns increasing. The forward's FFI matrix has rows of k (RowsOfK);
// the input gradient's transposed pattern (CSC of the FFI matrix) has rows of any length (RowPtr).
struct RowsOfK {
  int64_t k;
  int64_t operator()(int64_t r) const { return r * k; }
};
struct RowPtr {
  const int64_t* ptr;
  int64_t operator()(int64_t r) const { return ptr[r]; }
};
template <typename acc_t, typename col_t, typename Ptr>
struct Csr {
  const col_t* cols;
  const acc_t* vals;
  Ptr ptr;
  int64_t rows, nnz;
};

// dst (T, rows) = src (T, F) @ A^T, A the sparse matrix `a`: dst[t, r] = sum over r's pairs
// (c, w) of w * src[t, c]. src rows have stride ss; dst is contiguous.
template <typename scalar_t, typename acc_t, typename col_t, typename Ptr>
void gather_spmm(const scalar_t* src, int64_t T, int64_t ss, int64_t F,
                 const Csr<acc_t, col_t, Ptr>& a, scalar_t* dst) {
  constexpr at::ScalarType acc_type = c10::CppTypeToScalarType<acc_t>::value;
  const int64_t rows = a.rows, nnz = a.nnz;
  // Long rows go one block of kBlockBytes of the tile at a time (128 features at W = 64), when a
  // row holds at least kMinSegment pairs per block on average.
  const int64_t wide = wide_width<acc_t>();
  const int64_t block = kBlockBytes / (wide * static_cast<int64_t>(sizeof(acc_t)));
  const bool blocked = T >= kMinBlockedTokens && nnz * block >= kMinSegment * F * rows;
  const int64_t W = blocked ? wide : tile_width<acc_t>(F, T);
  const int64_t nt = div_up(T, W);
  const Blocks fb = blocked ? make_blocks(a.cols, rows, F, block, a.ptr) : Blocks{};

  with_width<acc_t>(W, [&](auto w_const) {
    constexpr int Wc = decltype(w_const)::value;
    // Rows [r0, r1) of one token tile, its src feature-major in sT.
    auto tile_rows = [&](const acc_t* sT, int64_t tile, int64_t r0, int64_t r1) {
      const int64_t t0 = tile * Wc, tv = std::min<int64_t>(Wc, T - t0);
      acc_t* blk = scratch<acc_t>(1, kRowBlock * Wc);
      for (int64_t rb = r0; rb < r1; rb += kRowBlock) {
        const PhaseTimer timer(2);  // includes the transpose out, which phase 1 also counts
        const int64_t nr = std::min(kRowBlock, r1 - rb);
        if (blocked) {
          std::fill(blk, blk + nr * Wc, acc_t(0));
          for (int64_t b = 0; b < fb.nb; ++b)
            for (int64_t r = 0; r < nr; ++r) {
              const int32_t* seg = fb.row(rb + r);
              const int64_t e = a.ptr(rb + r) + seg[b];
              gather_accumulate<Wc, true>(sT, a.cols + e, a.vals + e, seg[b + 1] - seg[b],
                                          blk + r * Wc);
            }
        } else {
          for (int64_t r = 0; r < nr; ++r) {
            const int64_t e = a.ptr(rb + r);
            gather_accumulate<Wc, false>(sT, a.cols + e, a.vals + e, a.ptr(rb + r + 1) - e,
                                         blk + r * Wc);
          }
        }
        to_token_major(blk, nr, Wc, tv, dst + t0 * rows + rb, rows);
      }
    };
    const double tile_ns = Wc * ((F + rows) * kNsPerCopy + nnz * kNsPerTileFma);
    if (nt >= 2 * at::get_num_threads()) {
      // Many tiles: each thread transposes its own tiles and computes all their rows.
      at::parallel_for(0, nt, grain_for(nt, tile_ns), [&](int64_t b, int64_t e) {
        acc_t* sT = scratch<acc_t>(0, F * Wc);
        for (int64_t tile = b; tile < e; ++tile) {
          to_feature_major(src + tile * Wc * ss, ss, std::min<int64_t>(Wc, T - tile * Wc), F, Wc,
                           sT);
          tile_rows(sT, tile, 0, rows);
        }
      });
      return;
    }
    // Few tiles: transpose them all once, then split (tile, row block) pairs over threads.
    at::Tensor buf = acc_buffer(nt * F * Wc, acc_type);
    acc_t* sT = buf.data_ptr<acc_t>();
    at::parallel_for(0, nt, grain_for(nt, Wc * F * kNsPerCopy), [&](int64_t b, int64_t e) {
      for (int64_t tile = b; tile < e; ++tile)
        to_feature_major(src + tile * Wc * ss, ss, std::min<int64_t>(Wc, T - tile * Wc), F, Wc,
                         sT + tile * F * Wc);
    });
    const int64_t rb = split_rows(rows, nt), nrb = div_up(rows, rb);
    const int64_t grain = grain_for(nt * nrb, tile_ns / nrb);
    at::parallel_for(0, nt * nrb, grain, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p) {
        const int64_t tile = p / nrb, r0 = (p % nrb) * rb;
        tile_rows(sT + tile * F * Wc, tile, r0, std::min(rows, r0 + rb));
      }
    });
  });
}

// ---- forward ----------------------------------------------------------------------------------

template <typename scalar_t, typename idx_t>
void forward_impl(const at::Tensor& x2, const at::Tensor& values, const idx_t* idx, int64_t out,
                  int64_t k, scalar_t* y) {
  using acc_t = typename AccType<scalar_t>::type;
  const int64_t T = x2.size(0), in = x2.size(1), sx = x2.stride(0);
  const scalar_t* x = x2.data_ptr<scalar_t>();

  if (T <= kDirectTokens) {
    // Gather straight from the token rows: no tiles, conversions or allocations. Eight
    // running sums with explicit fused multiply-adds fix the rounding for every index type.
    const scalar_t* v = values.data_ptr<scalar_t>();
    at::parallel_for(0, out, grain_for(out, k * T * kNsPerDirect), [&](int64_t o0, int64_t o1) {
      for (int64_t t = 0; t < T; ++t) {
        const scalar_t* xr = x + t * sx;
        for (int64_t o = o0; o < o1; ++o) {
          const scalar_t* vr = v + o * k;
          const idx_t* ir = idx + o * k;
          acc_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          int64_t j = 0;
          for (; j + 8 <= k; j += 8)
            for (int u = 0; u < 8; ++u)
              a[u] = fmadd(static_cast<acc_t>(vr[j + u]), static_cast<acc_t>(xr[ir[j + u]]), a[u]);
          for (int u = 0; j < k; ++j, ++u)
            a[u] = fmadd(static_cast<acc_t>(vr[j]), static_cast<acc_t>(xr[ir[j]]), a[u]);
          const acc_t sum = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
          y[t * out + o] = static_cast<scalar_t>(sum);
        }
      }
    });
    return;
  }

  at::Tensor vholder;
  const acc_t* v = values_as_acc<scalar_t, acc_t>(values, vholder);
  // Row o gathers its k pairs (values[o, j], x[:, indices[o, j]]).
  const Csr<acc_t, idx_t, RowsOfK> rows{idx, v, RowsOfK{k}, out, out * k};
  gather_spmm<scalar_t>(x, T, sx, in, rows, y);
}

at::Tensor ffi_linear_cpu(const at::Tensor& x, const at::Tensor& values,
                          const at::Tensor& indices) {
  constexpr const char* op = "squash::ffi_linear";
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have at least one dimension");
  TORCH_CHECK_VALUE(values.dim() == 2, op, ": values must be (out_features, k), got ",
                    values.sizes());
  const int64_t out = values.size(0), k = values.size(1), in = x.size(-1);
  check_pattern(op, indices, out, k);
  check_float(op, x, "x", values, "values");
  const at::Tensor idx = indices.contiguous();
  check_indices(op, idx, in);

  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out;
  at::Tensor y = at::empty(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (y.numel() == 0) return y;
  const at::Tensor x2 = token_rows(x);
  const at::Tensor v = values.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "ffi_linear", [&] {
    if (idx.scalar_type() == at::kShort)
      forward_impl<scalar_t>(x2, v, idx.data_ptr<int16_t>(), out, k, y.data_ptr<scalar_t>());
    else
      forward_impl<scalar_t>(x2, v, idx.data_ptr<int32_t>(), out, k, y.data_ptr<scalar_t>());
  });
  return y;
}

// ---- input gradient ---------------------------------------------------------------------------

template <typename scalar_t, typename idx_t>
void grad_input_impl(const at::Tensor& g2, const at::Tensor& values, const idx_t* idx,
                     int64_t in, int64_t k, scalar_t* gx) {
  using acc_t = typename AccType<scalar_t>::type;
  constexpr at::ScalarType acc_type = c10::CppTypeToScalarType<acc_t>::value;
  const int64_t T = g2.size(0), out = g2.size(1), sg = g2.stride(0), nnz = out * k;
  const scalar_t* g = g2.data_ptr<scalar_t>();
  at::Tensor vholder;
  const acc_t* v = values_as_acc<scalar_t, acc_t>(values, vholder);

  if (T <= kDirectScatterTokens) {
    // Scatter each token's rows into an accumulator row of length in; tokens in parallel.
    at::parallel_for(0, T, grain_for(T, (nnz + in) * kNsPerDirect), [&](int64_t t0, int64_t t1) {
      acc_t* acc = scratch<acc_t>(0, in);
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(acc, acc + in, acc_t(0));
        const scalar_t* gr = g + t * sg;
        for (int64_t o = 0; o < out; ++o) {
          const acc_t go = static_cast<acc_t>(gr[o]);
          const acc_t* vr = v + o * k;
          const idx_t* ir = idx + o * k;
          for (int64_t j = 0; j < k; ++j) acc[ir[j]] = fmadd(vr[j], go, acc[ir[j]]);
        }
        for (int64_t i = 0; i < in; ++i) gx[t * in + i] = static_cast<scalar_t>(acc[i]);
      }
    });
    return;
  }

  // Transposed pattern (CSC): column i holds entries [ptr[i], ptr[i + 1]) of (col_rows, col_w),
  // in increasing row order. A counting sort by column, in nc chunks of rows counted and filled
  // in parallel: chunk c writes its entries of column i from start[c * in + i] on.
  std::optional<PhaseTimer> csc_timer(std::in_place, 3);
  const int64_t nc =
      nnz * kNsPerCscEntry < kSerialNs ? 1 : std::min<int64_t>(at::get_num_threads(), out);
  at::Tensor csc_ptr = at::empty({in + 1 + nc * in}, at::kLong);
  at::Tensor csc_rows = at::empty({nnz}, at::kInt);
  at::Tensor csc_w = acc_buffer(nnz, acc_type);
  int64_t* ptr = csc_ptr.data_ptr<int64_t>();
  int64_t* start = ptr + in + 1;  // (nc, in): counts, then each chunk's first slot per column
  int32_t* col_rows = csc_rows.data_ptr<int32_t>();
  acc_t* col_w = csc_w.data_ptr<acc_t>();
  std::fill(start, start + nc * in, int64_t(0));
  at::parallel_for(0, nc, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* cnt = start + c * in;
      for (int64_t e = c * out / nc * k; e < (c + 1) * out / nc * k; ++e) ++cnt[idx[e]];
    }
  });
  ptr[0] = 0;
  for (int64_t i = 0; i < in; ++i) {
    int64_t p = ptr[i];
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t n = start[c * in + i];
      start[c * in + i] = p;
      p += n;
    }
    ptr[i + 1] = p;
  }
  at::parallel_for(0, nc, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* fill = start + c * in;
      for (int64_t o = c * out / nc; o < (c + 1) * out / nc; ++o)
        for (int64_t j = 0; j < k; ++j) {
          const int64_t p = fill[idx[o * k + j]]++;
          col_rows[p] = static_cast<int32_t>(o);
          col_w[p] = v[o * k + j];
        }
    }
  });

  // Row i of the input gradient gathers the pairs (values[o, j], grad_out[:, o]) of column i.
  const Csr<acc_t, int32_t, RowPtr> cols{col_rows, col_w, RowPtr{ptr}, in, nnz};
  csc_timer.reset();
  gather_spmm<scalar_t>(g, T, sg, out, cols, gx);
}

at::Tensor ffi_linear_grad_input_cpu(const at::Tensor& grad_out, const at::Tensor& values,
                                     const at::Tensor& indices, int64_t in_features) {
  constexpr const char* op = "squash::ffi_linear_grad_input";
  TORCH_CHECK_VALUE(grad_out.dim() >= 1, op, ": grad_out must have at least one dimension");
  TORCH_CHECK_VALUE(values.dim() == 2, op, ": values must be (out_features, k), got ",
                    values.sizes());
  const int64_t out = values.size(0), k = values.size(1);
  check_pattern(op, indices, out, k);
  TORCH_CHECK_VALUE(grad_out.size(-1) == out, op, ": grad_out ", grad_out.sizes(),
                    " must end in out_features = ", out);
  TORCH_CHECK_VALUE(in_features >= 0, op, ": in_features must be >= 0, got ", in_features);
  check_float(op, grad_out, "grad_out", values, "values");
  const at::Tensor idx = indices.contiguous();
  check_indices(op, idx, in_features);

  std::vector<int64_t> shape = grad_out.sizes().vec();
  shape.back() = in_features;
  at::Tensor gx = at::empty(shape, grad_out.options().memory_format(at::MemoryFormat::Contiguous));
  if (gx.numel() == 0) return gx;
  if (out == 0) return gx.zero_();
  const at::Tensor g2 = token_rows(grad_out);
  const at::Tensor v = values.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, grad_out.scalar_type(), "ffi_linear_grad_input", [&] {
        scalar_t* gxp = gx.data_ptr<scalar_t>();
        if (idx.scalar_type() == at::kShort)
          grad_input_impl<scalar_t>(g2, v, idx.data_ptr<int16_t>(), in_features, k, gxp);
        else
          grad_input_impl<scalar_t>(g2, v, idx.data_ptr<int32_t>(), in_features, k, gxp);
      });
  return gx;
}

// ---- values gradient --------------------------------------------------------------------------

template <typename scalar_t, typename idx_t>
void grad_values_impl(const at::Tensor& g2, const at::Tensor& x2, const idx_t* idx, int64_t k,
                      scalar_t* gv) {
  using acc_t = typename AccType<scalar_t>::type;
  constexpr at::ScalarType acc_type = c10::CppTypeToScalarType<acc_t>::value;
  const int64_t T = g2.size(0), out = g2.size(1), in = x2.size(1), nnz = out * k;
  const int64_t sg = g2.stride(0), sx = x2.stride(0);
  const scalar_t* g = g2.data_ptr<scalar_t>();
  const scalar_t* x = x2.data_ptr<scalar_t>();
  if (T <= kDirectTokens) {
    // Gather straight from the token rows, one token after the other.
    at::parallel_for(0, out, grain_for(out, k * T * kNsPerDirect), [&](int64_t o0, int64_t o1) {
      acc_t* part = scratch<acc_t>(0, k);
      for (int64_t o = o0; o < o1; ++o) {
        const idx_t* ir = idx + o * k;
        std::fill(part, part + k, acc_t(0));
        for (int64_t t = 0; t < T; ++t) {
          const acc_t go = static_cast<acc_t>(g[t * sg + o]);
          const scalar_t* xr = x + t * sx;
          for (int64_t j = 0; j < k; ++j)
            part[j] = fmadd(go, static_cast<acc_t>(xr[ir[j]]), part[j]);
        }
        for (int64_t j = 0; j < k; ++j) gv[o * k + j] = static_cast<scalar_t>(part[j]);
      }
    });
    return;
  }

  // Long rows go block by block of features, as in the forward, when threads take whole tiles.
  const int64_t nthreads = at::get_num_threads();
  const int64_t wide = wide_width<acc_t>();
  const int64_t block_features = kBlockBytes / (wide * static_cast<int64_t>(sizeof(acc_t)));
  const bool blocked = T >= kMinBlockedTokens && div_up(T, wide) >= 2 * nthreads &&
                       k * block_features >= kMinSegment * in;
  // Unblocked: up to dot_width tokens in half the L2, but no wider than 32 tokens where that
  // would leave fewer than two tiles per thread.
  int64_t W = wide;
  if (!blocked) {
    W = tile_width<acc_t>(in + out, T, dot_width<acc_t>(), std::max(kTileBytes, l2_bytes() / 2));
    while (W > 32 && div_up(T, W) < 2 * nthreads) W /= 2;
  }
  const int64_t nt = div_up(T, W);
  const Blocks fb = blocked ? make_blocks(idx, out, in, block_features,
                                          [k](int64_t o) { return o * k; })
                            : Blocks{};

  constexpr int Wmax = std::max(wide_width<acc_t>(), dot_width<acc_t>());
  with_width<acc_t, Wmax>(W, [&](auto w_const) {
    constexpr int Wc = decltype(w_const)::value;
    if (nt >= 2 * nthreads) {
      // Tiles in nc contiguous chunks run in parallel; chunk c sums into partial c.
      const double tile_ns = Wc * ((in + out) * kNsPerCopy + nnz * kNsPerTileFma);
      const int64_t nc = nt * tile_ns < kSerialNs ? 1 : std::min(nthreads, nt);
      at::Tensor parts = at::zeros({nc, nnz}, at::dtype(acc_type));
      acc_t* pp = parts.data_ptr<acc_t>();
      at::parallel_for(0, nc, 1, [&](int64_t cb, int64_t ce) {
        acc_t* xT = scratch<acc_t>(0, in * Wc);
        acc_t* gT = scratch<acc_t>(1, out * Wc);
        for (int64_t c = cb; c < ce; ++c) {
          acc_t* part = pp + c * nnz;
          for (int64_t tile = c * nt / nc; tile < (c + 1) * nt / nc; ++tile) {
            const int64_t t0 = tile * Wc, tv = std::min<int64_t>(Wc, T - t0);
            to_feature_major(x + t0 * sx, sx, tv, in, Wc, xT);
            to_feature_major(g + t0 * sg, sg, tv, out, Wc, gT);
            const PhaseTimer timer(2);
            if (!blocked) {
              for (int64_t o = 0; o < out; ++o)
                dot_rows<Wc>(gT + o * Wc, xT, idx + o * k, k, part + o * k);
              continue;
            }
            for (int64_t ob = 0; ob < out; ob += kRowBlock)
              for (int64_t b = 0; b < fb.nb; ++b)
                for (int64_t o = ob; o < std::min(out, ob + kRowBlock); ++o) {
                  const int32_t* seg = fb.row(o);
                  const int64_t j = o * k + seg[b];
                  dot_rows<Wc>(gT + o * Wc, xT, idx + j, seg[b + 1] - seg[b], part + j);
                }
          }
        }
      });
      at::parallel_for(0, nnz, grain_for(nnz, nc * kNsPerCopy), [&](int64_t b, int64_t e) {
        for (int64_t q = b; q < e; ++q) {
          acc_t s = pp[q];
          for (int64_t c = 1; c < nc; ++c) s += pp[c * nnz + q];
          gv[q] = static_cast<scalar_t>(s);
        }
      });
      return;
    }
    // Few tiles: transpose them all once, then split output rows over threads.
    at::Tensor buf = acc_buffer(nt * (in + out) * Wc, acc_type);
    acc_t* xT = buf.data_ptr<acc_t>();
    acc_t* gT = xT + nt * in * Wc;
    const int64_t copy_grain = grain_for(nt, Wc * (in + out) * kNsPerCopy);
    at::parallel_for(0, nt, copy_grain, [&](int64_t b, int64_t e) {
      for (int64_t tile = b; tile < e; ++tile) {
        const int64_t t0 = tile * Wc, tv = std::min<int64_t>(Wc, T - t0);
        to_feature_major(x + t0 * sx, sx, tv, in, Wc, xT + tile * in * Wc);
        to_feature_major(g + t0 * sg, sg, tv, out, Wc, gT + tile * out * Wc);
      }
    });
    const int64_t grain = grain_for(out, nt * k * Wc * kNsPerTileFma);
    at::parallel_for(0, out, grain, [&](int64_t o0, int64_t o1) {
      acc_t* part = scratch<acc_t>(0, k);
      const PhaseTimer timer(2);
      for (int64_t o = o0; o < o1; ++o) {
        std::fill(part, part + k, acc_t(0));
        for (int64_t tile = 0; tile < nt; ++tile)
          dot_rows<Wc>(gT + (tile * out + o) * Wc, xT + tile * in * Wc, idx + o * k, k, part);
        for (int64_t j = 0; j < k; ++j) gv[o * k + j] = static_cast<scalar_t>(part[j]);
      }
    });
  });
}

at::Tensor ffi_linear_grad_values_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                      const at::Tensor& indices) {
  constexpr const char* op = "squash::ffi_linear_grad_values";
  TORCH_CHECK_VALUE(grad_out.dim() >= 1 && x.dim() == grad_out.dim(), op, ": grad_out ",
                    grad_out.sizes(), " and x ", x.sizes(),
                    " must have the same number of dimensions (at least one)");
  TORCH_CHECK_VALUE(grad_out.sizes().slice(0, grad_out.dim() - 1) ==
                        x.sizes().slice(0, x.dim() - 1),
                    op, ": grad_out ", grad_out.sizes(), " and x ", x.sizes(),
                    " must share their leading dimensions");
  TORCH_CHECK_VALUE(indices.dim() == 2, op,
                    ": FFI indices must be a 2-D tensor (out_features, k), got ",
                    squash_ffi_check::shape_str(indices.sizes()));
  const int64_t out = grad_out.size(-1), k = indices.size(1), in = x.size(-1);
  check_pattern(op, indices, out, k, "grad_out (..., out_features), k:");
  check_float(op, x, "x", grad_out, "grad_out");
  const at::Tensor idx = indices.contiguous();
  check_indices(op, idx, in);

  at::Tensor gv =
      at::empty({out, k}, grad_out.options().memory_format(at::MemoryFormat::Contiguous));
  if (gv.numel() == 0) return gv;
  const at::Tensor g2 = token_rows(grad_out), x2 = token_rows(x);
  if (g2.size(0) == 0) return gv.zero_();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "ffi_linear_grad_values", [&] {
        scalar_t* gvp = gv.data_ptr<scalar_t>();
        if (idx.scalar_type() == at::kShort)
          grad_values_impl<scalar_t>(g2, x2, idx.data_ptr<int16_t>(), k, gvp);
        else
          grad_values_impl<scalar_t>(g2, x2, idx.data_ptr<int32_t>(), k, gvp);
      });
  return gv;
}

}  // namespace

// What this build targets, read by squash.ops.status() (through ctypes, outside the dispatcher).
extern "C" const char* squash_ffi_cpu_isa() { return SQUASH_FFI_ISA; }
extern "C" int squash_ffi_cpu_vector_bytes() { return SQUASH_FFI_VEC_BYTES; }
// Phase timing (benchmarks): turn it on or off; read the 4 counters (ns) and zero them.
extern "C" void squash_ffi_cpu_phases(int on) { g_phase_on.store(on != 0); }
extern "C" void squash_ffi_cpu_phase_ns(int64_t* out) {
  for (int i = 0; i < 4; ++i) out[i] = g_phase_ns[i].exchange(0);
}

TORCH_LIBRARY_IMPL(squash, CPU, m) {
  m.impl("ffi_linear", &ffi_linear_cpu);
  m.impl("ffi_linear_grad_input", &ffi_linear_grad_input_cpu);
  m.impl("ffi_linear_grad_values", &ffi_linear_grad_values_cpu);
}
