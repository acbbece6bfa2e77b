// FFI sparse linear: GPU device code and raw-pointer launchers (CUDA; hipified for ROCm).
//
// This header holds everything that runs on the GPU and nothing from torch, so it compiles with
// nvcc or (after torch.utils.hipify) hipcc on its own. kernels/ffi_cuda.cu is the torch glue:
// checks, allocation, dtype dispatch, op registration. docs/gpu.md explains the designs.
//
// Layout conventions (T = tokens, i.e. all leading dims of x flattened):
//   x        (T, K)      token-major activations, K = in_features (forward) or out (grad_input)
//   entries  (nnz)       packed {col, value} of a CSR matrix with sorted columns per row
//   cptr     (rows, nchunks + 1)  cptr[r][c] = first entry of row r with col >= c * CHUNK
//   y        (T, rows)
// One thread block owns a tile of rows (8 groups x RPG rows) and a tile of kTile tokens. A group
// is 32 lanes; lane l owns tokens l * 8 .. l * 8 + 7 of the tile, so every lane of a group reads
// the same (col, value) pair at the same time and the gathered x values are 8 contiguous tokens
// of one row of the feature-major shared-memory tile xs[f][t]: one 16-byte shared load.
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>

#include <cstdint>

#if defined(USE_ROCM) || defined(__HIP_PLATFORM_AMD__)
#define SQUASH_ROCM 1
#else
#define SQUASH_ROCM 0
#endif

#if SQUASH_ROCM
#define SQUASH_LAUNCH_BOUNDS __launch_bounds__(256)
#else
// Two blocks per SM: caps registers at 128 per thread (64 accumulators + tile data fit).
#define SQUASH_LAUNCH_BOUNDS __launch_bounds__(256, 2)
#endif

namespace squash_ffi {

constexpr int kThreads = 256;                  // threads per block
constexpr int kGroup = 32;                     // lanes sharing one row at a time (a warp on CUDA)
constexpr int kGroups = kThreads / kGroup;     // 8 groups per block
constexpr int kV = 8;                          // tokens per lane
constexpr int kTile = kGroup * kV;             // 256 tokens per block tile
constexpr int kTileBytes = 32768;              // shared memory for one x tile
constexpr int kSmallTokens = 16;               // at most this many tokens: the small-T kernel

// ---- dtypes ------------------------------------------------------------------------------------
// raw: storage type in global and shared memory; acc: accumulation type.
struct F32 {
  using raw = float;
  using acc = float;
  static __device__ __forceinline__ float to_acc(float v) { return v; }
  static __device__ __forceinline__ float from_acc(float v) { return v; }
};

struct F64 {
  using raw = double;
  using acc = double;
  static __device__ __forceinline__ double to_acc(double v) { return v; }
  static __device__ __forceinline__ double from_acc(double v) { return v; }
};

// bfloat16 as its 16 bits: the upper half of an fp32. Round to nearest even on the way back
// (the rounding of torch's float -> bfloat16 conversion), NaN stays a quiet NaN.
struct BF16 {
  using raw = uint16_t;
  using acc = float;
  static __device__ __forceinline__ float to_acc(uint16_t v) {
    return __uint_as_float(static_cast<uint32_t>(v) << 16);
  }
  static __device__ __forceinline__ uint16_t from_acc(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};

struct F16 {
  using raw = uint16_t;
  using acc = float;
  static __device__ __forceinline__ float to_acc(uint16_t v) {
    return __half2float(__ushort_as_half(v));
  }
  static __device__ __forceinline__ uint16_t from_acc(float f) {
    return __half_as_ushort(__float2half_rn(f));
  }
};

// Features of x per shared-memory chunk: the tile is (CHUNK features) x (kTile tokens).
template <typename T>
constexpr int chunk_features() {
  return kTileBytes / (kTile * static_cast<int>(sizeof(typename T::raw)));
}

// Rows per group: 8 x 8 fp32 accumulators per lane (4 x 8 for fp64).
template <typename T>
constexpr int rows_per_group() {
  return sizeof(typename T::acc) == 8 ? 4 : 8;
}

template <typename T>
constexpr int rows_per_block() {
  return kGroups * rows_per_group<T>();
}

// One nonzero of a CSR matrix, value already in the accumulation type.
template <typename acc_t>
struct alignas(2 * sizeof(acc_t)) Entry {
  int32_t col;
  acc_t val;
};

// ---- small helpers -----------------------------------------------------------------------------
template <typename acc_t>
__device__ __forceinline__ acc_t shfl_xor32(acc_t v, int mask) {
#if SQUASH_ROCM
  return __shfl_xor(v, mask, 32);  // width 32: stays inside a group on wave32 and wave64
#else
  return __shfl_xor_sync(0xffffffffu, v, mask, 32);
#endif
}

// Sum over the 32 lanes of a group; every lane gets the total.
template <typename acc_t>
__device__ __forceinline__ acc_t group_sum(acc_t v) {
#pragma unroll
  for (int m = kGroup / 2; m > 0; m >>= 1) v += shfl_xor32(v, m);
  return v;
}

// Raw elements packed in 32-bit words (element i of an array of 16-, 32- or 64-bit values).
__device__ __forceinline__ uint16_t elem(const uint32_t* w, int i, uint16_t) {
  return static_cast<uint16_t>((w[i >> 1] >> ((i & 1) * 16)) & 0xffffu);
}
__device__ __forceinline__ float elem(const uint32_t* w, int i, float) {
  return __uint_as_float(w[i]);
}
__device__ __forceinline__ double elem(const uint32_t* w, int i, double) {
  return __hiloint2double(static_cast<int>(w[2 * i + 1]), static_cast<int>(w[2 * i]));
}
__device__ __forceinline__ void set_elem(uint32_t* w, int i, uint16_t v) {
  const uint32_t keep = (i & 1) ? 0x0000ffffu : 0xffff0000u;
  w[i >> 1] = (w[i >> 1] & keep) | (static_cast<uint32_t>(v) << ((i & 1) * 16));
}
__device__ __forceinline__ void set_elem(uint32_t* w, int i, float v) { w[i] = __float_as_uint(v); }
__device__ __forceinline__ void set_elem(uint32_t* w, int i, double v) {
  w[2 * i] = static_cast<uint32_t>(__double2loint(v));
  w[2 * i + 1] = static_cast<uint32_t>(__double2hiint(v));
}

// N consecutive raw elements at p (16-byte aligned, N * sizeof(raw) a multiple of 16), converted
// to acc. Works for global and shared memory.
template <typename T, int N>
__device__ __forceinline__ void load_vec(const typename T::raw* p, typename T::acc* out) {
  using raw = typename T::raw;
  constexpr int NW = N * sizeof(raw) / 16;
  static_assert(NW * 16 == N * sizeof(raw), "vector of whole 16-byte words");
  uint32_t w[NW * 4];
#pragma unroll
  for (int i = 0; i < NW; ++i) {
    const uint4 q = reinterpret_cast<const uint4*>(p)[i];
    w[4 * i] = q.x; w[4 * i + 1] = q.y; w[4 * i + 2] = q.z; w[4 * i + 3] = q.w;
  }
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = T::to_acc(elem(w, i, raw{}));
}

// Store N acc values as raw elements at p (same alignment rules as load_vec).
template <typename T, int N>
__device__ __forceinline__ void store_vec(typename T::raw* p, const typename T::acc* v) {
  using raw = typename T::raw;
  constexpr int NW = N * sizeof(raw) / 16;
  static_assert(NW * 16 == N * sizeof(raw), "vector of whole 16-byte words");
  uint32_t w[NW * 4] = {};
#pragma unroll
  for (int i = 0; i < N; ++i) set_elem(w, i, T::from_acc(v[i]));
#pragma unroll
  for (int i = 0; i < NW; ++i)
    reinterpret_cast<uint4*>(p)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
}

// Stage x[t0 : t0 + kTile, f0 : f0 + C] into xs[f][t] (feature-major), zeros outside x.
// vec: K * sizeof(raw) is a multiple of 16 and x is 16-byte aligned, so rows of x can be read
// 16 bytes at a time. Each thread then reads 16 bytes of features for TP tokens and writes them
// transposed, TP tokens per shared store (consecutive lanes: consecutive tokens, no conflicts).
template <typename T>
__device__ __forceinline__ void stage_tile(typename T::raw* xs,
                                           const typename T::raw* __restrict__ x, int64_t ntok,
                                           int64_t K, int64_t t0, int64_t f0, bool vec) {
  using raw = typename T::raw;
  constexpr int C = chunk_features<T>();
  if (vec) {
    constexpr int FV = 16 / sizeof(raw);                // features per 16-byte load
    constexpr int TP = sizeof(raw) == 2 ? 2 : 1;        // tokens per unit
    constexpr int TOK_UNITS = kTile / TP;
    constexpr int UNITS = TOK_UNITS * (C / FV);
    static_assert(UNITS % kThreads == 0, "tile must split evenly over the block");
    // Not unrolled: keeps few registers live next to the callers' accumulators.
#pragma unroll 1
    for (int i = 0; i < UNITS / kThreads; ++i) {
      const int u = threadIdx.x + i * kThreads;
      const int tu = u % TOK_UNITS;
      const int fg = u / TOK_UNITS;
      const int64_t f = f0 + static_cast<int64_t>(fg) * FV;
      uint32_t w[TP][4];
#pragma unroll
      for (int q = 0; q < TP; ++q) {
        const int64_t t = t0 + static_cast<int64_t>(tu) * TP + q;
        uint4 d = make_uint4(0u, 0u, 0u, 0u);
        if (t < ntok && f < K) d = *reinterpret_cast<const uint4*>(x + t * K + f);  // K % FV == 0
        w[q][0] = d.x; w[q][1] = d.y; w[q][2] = d.z; w[q][3] = d.w;
      }
#pragma unroll
      for (int e = 0; e < FV; ++e) {
        raw* dst = xs + (fg * FV + e) * kTile + tu * TP;
        if constexpr (TP == 2) {  // 16-bit: tokens tu*2 and tu*2+1 of feature e in one word
          const uint32_t lo = elem(w[0], e, uint16_t{});
          const uint32_t hi = elem(w[1], e, uint16_t{});
          *reinterpret_cast<uint32_t*>(dst) = lo | (hi << 16);
        } else {
          *dst = elem(w[0], e, raw{});
        }
      }
    }
  } else {
    for (int e = threadIdx.x; e < C * kTile; e += kThreads) {
      const int tl = e % kTile;
      const int fl = e / kTile;
      const int64_t t = t0 + tl;
      const int64_t f = f0 + fl;
      xs[fl * kTile + tl] = (t < ntok && f < K) ? x[t * K + f] : raw(0);
    }
  }
}

// ---- index checks -------------------------------------------------------------------------------
// flags[0] |= 1 for an index outside [0, in_features), |= 2 for a row that is not strictly
// increasing; flags[1] = smallest flat position of a bad entry (initialised to INT32_MAX).
template <typename index_t>
__global__ void validate_indices_kernel(const index_t* __restrict__ idx, int64_t rows, int64_t k,
                                        int64_t in_features, int32_t* flags) {
  const int64_t n = rows * k;
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t v = idx[p];
    int bad = (v < 0 || v >= in_features) ? 1 : 0;
    if (p % k != 0 && static_cast<int64_t>(idx[p - 1]) >= v) bad |= 2;
    if (bad) {
      atomicOr(flags, bad);
      atomicMin(flags + 1, static_cast<int32_t>(p));
    }
  }
}

// ---- CSR preparation ----------------------------------------------------------------------------
// entries[p] = {col[p], values[src[p]]} (src == nullptr: values[p]).
template <typename T, typename index_t>
__global__ void pack_entries_kernel(const index_t* __restrict__ col,
                                    const typename T::raw* __restrict__ values,
                                    const int64_t* __restrict__ src, int64_t nnz,
                                    Entry<typename T::acc>* __restrict__ entries) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < nnz;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = src ? src[p] : p;
    Entry<typename T::acc> e;
    e.col = static_cast<int32_t>(col[p]);
    e.val = T::to_acc(values[s]);
    entries[p] = e;
  }
}

// cptr[r][c] = rowptr[r] + (number of entries of row r with col < c * chunk), c = 0..nchunks,
// by binary search over the row's sorted columns. rowptr == nullptr: row r is [r * k, r * k + k).
template <typename index_t>
__global__ void chunk_ptr_kernel(const index_t* __restrict__ col,
                                 const int32_t* __restrict__ rowptr, int64_t k, int64_t rows,
                                 int nchunks, int chunk, int32_t* __restrict__ cptr) {
  const int64_t n = rows * (nchunks + 1);
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < n;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = q / (nchunks + 1);
    const int64_t c = q % (nchunks + 1);
    int64_t lo = rowptr ? rowptr[r] : r * k;
    int64_t hi = rowptr ? rowptr[r + 1] : r * k + k;
    const int64_t bound = c * chunk;
    while (lo < hi) {  // first position in [lo, hi) with col >= bound
      const int64_t mid = lo + (hi - lo) / 2;
      if (static_cast<int64_t>(col[mid]) < bound) lo = mid + 1; else hi = mid;
    }
    cptr[q] = static_cast<int32_t>(lo);
  }
}

// ---- SpMM: y[t, r] = sum_{p in row r} entries[p].val * x[t, entries[p].col] ---------------------
// Grid (1-D): row tile fastest, then token tile, then split. A split covers chunks
// [split * chunks_per_split, ...) and writes fp32/fp64 partial sums to part[split] (summed by the
// caller); without splits (part == nullptr) the block writes y directly.
template <typename T>
__global__ void SQUASH_LAUNCH_BOUNDS spmm_kernel(
    const typename T::raw* __restrict__ x, int64_t ntok, int64_t K, bool x_vec,
    const Entry<typename T::acc>* __restrict__ entries, const int32_t* __restrict__ cptr,
    int64_t rows, int nchunks, int chunks_per_split, int64_t row_tiles, int64_t tok_tiles,
    typename T::raw* __restrict__ y, typename T::acc* __restrict__ part, bool y_vec) {
  using raw = typename T::raw;
  using acc_t = typename T::acc;
  constexpr int C = chunk_features<T>();
  constexpr int RPG = rows_per_group<T>();
  __shared__ __align__(16) raw xs[C * kTile];

  const int64_t b = blockIdx.x;
  const int64_t rt = b % row_tiles;
  const int64_t tt = (b / row_tiles) % tok_tiles;
  const int split = static_cast<int>(b / (row_tiles * tok_tiles));
  const int lane = threadIdx.x % kGroup;
  const int grp = threadIdx.x / kGroup;
  const int64_t row0 = rt * rows_per_block<T>() + grp * RPG;
  const int64_t t0 = tt * kTile;

  acc_t acc[RPG][kV];
#pragma unroll
  for (int r = 0; r < RPG; ++r)
#pragma unroll
    for (int v = 0; v < kV; ++v) acc[r][v] = acc_t(0);

  const int c_begin = split * chunks_per_split;
  const int c_end = c_begin + chunks_per_split < nchunks ? c_begin + chunks_per_split : nchunks;
  for (int c = c_begin; c < c_end; ++c) {
    __syncthreads();  // every group is done with the previous chunk
    stage_tile<T>(xs, x, ntok, K, t0, static_cast<int64_t>(c) * C, x_vec);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < RPG; ++r) {
      const int64_t row = row0 + r;
      if (row < rows) {  // uniform over the group
        const int32_t* cp = cptr + row * (nchunks + 1) + c;
        const int32_t p0 = cp[0];
        const int32_t p1 = cp[1];
        for (int32_t p = p0; p < p1; ++p) {
          const Entry<acc_t> e = entries[p];
          const uint32_t f = static_cast<uint32_t>(e.col - c * C);
          if (f >= static_cast<uint32_t>(C)) continue;  // only for indices that broke the contract
          acc_t xv[kV];
          load_vec<T, kV>(xs + f * kTile + lane * kV, xv);
#pragma unroll
          for (int v = 0; v < kV; ++v) acc[r][v] += e.val * xv[v];
        }
      }
    }
  }

  // Epilogue: for each of the lane's tokens, the group's RPG rows are contiguous in y.
#pragma unroll
  for (int v = 0; v < kV; ++v) {
    const int64_t t = t0 + lane * kV + v;
    if (t >= ntok) continue;
    if (part != nullptr) {
      acc_t* dst = part + (static_cast<int64_t>(split) * ntok + t) * rows + row0;
#pragma unroll
      for (int r = 0; r < RPG; ++r)
        if (row0 + r < rows) dst[r] = acc[r][v];
    } else {
      raw* dst = y + t * rows + row0;
      if (y_vec && row0 + RPG <= rows) {
        acc_t col[RPG];
#pragma unroll
        for (int r = 0; r < RPG; ++r) col[r] = acc[r][v];
        store_vec<T, RPG>(dst, col);
      } else {
#pragma unroll
        for (int r = 0; r < RPG; ++r)
          if (row0 + r < rows) dst[r] = T::from_acc(acc[r][v]);
      }
    }
  }
}

// ---- SDDMM: part[split][p] += sum_{t in split} g[t, row(p)] * x[t, idx[p]] ----------------------
// Rows are the FFI rows (p = row * k + j). Grid (1-D): row tile fastest, then split over token
// tiles. Per token tile each lane keeps g for its 8 tokens and RPG rows in registers; per chunk
// each entry is a dot product over the tile's tokens (8 per lane, then a 32-lane sum, two entries
// per shuffle round), added by one lane to the split's fp32/fp64 partial (owned by this block
// alone: no atomics).
template <typename T, typename index_t>
__global__ void SQUASH_LAUNCH_BOUNDS sddmm_kernel(
    const typename T::raw* __restrict__ g, const typename T::raw* __restrict__ x, int64_t ntok,
    int64_t K, bool x_vec, bool g_vec, const index_t* __restrict__ idx,
    const int32_t* __restrict__ cptr, int64_t rows, int nchunks, int64_t row_tiles,
    int64_t tok_tiles, int64_t tiles_per_split, int64_t nnz, typename T::acc* __restrict__ part) {
  using raw = typename T::raw;
  using acc_t = typename T::acc;
  constexpr int C = chunk_features<T>();
  constexpr int RPG = rows_per_group<T>();
  __shared__ __align__(16) raw xs[C * kTile];

  const int64_t b = blockIdx.x;
  const int64_t rt = b % row_tiles;
  const int64_t split = b / row_tiles;
  const int lane = threadIdx.x % kGroup;
  const int grp = threadIdx.x / kGroup;
  const int64_t row0 = rt * rows_per_block<T>() + grp * RPG;
  acc_t* out = part + split * nnz;

  const int64_t tt_end =
      (split + 1) * tiles_per_split < tok_tiles ? (split + 1) * tiles_per_split : tok_tiles;
  for (int64_t tt = split * tiles_per_split; tt < tt_end; ++tt) {
    const int64_t t0 = tt * kTile;
    acc_t gr[RPG][kV];
#pragma unroll
    for (int v = 0; v < kV; ++v) {
      const int64_t t = t0 + lane * kV + v;
      const raw* src = g + t * rows + row0;
      if (t < ntok && g_vec && row0 + RPG <= rows) {
        acc_t col[RPG];
        load_vec<T, RPG>(src, col);
#pragma unroll
        for (int r = 0; r < RPG; ++r) gr[r][v] = col[r];
      } else {
#pragma unroll
        for (int r = 0; r < RPG; ++r)
          gr[r][v] = (t < ntok && row0 + r < rows) ? T::to_acc(src[r]) : acc_t(0);
      }
    }

    for (int c = 0; c < nchunks; ++c) {
      __syncthreads();
      stage_tile<T>(xs, x, ntok, K, t0, static_cast<int64_t>(c) * C, x_vec);
      __syncthreads();
#pragma unroll
      for (int r = 0; r < RPG; ++r) {
        const int64_t row = row0 + r;
        if (row < rows) {
          const int32_t* cp = cptr + row * (nchunks + 1) + c;
          const int32_t p0 = cp[0];
          const int32_t p1 = cp[1];
          // Two entries per round: lanes 0-15 finish the first sum, lanes 16-31 the second.
          for (int32_t p = p0; p < p1; p += 2) {
            const bool two = p + 1 < p1;
            const uint32_t f0 = static_cast<uint32_t>(static_cast<int32_t>(idx[p]) - c * C);
            const uint32_t f1 =
                two ? static_cast<uint32_t>(static_cast<int32_t>(idx[p + 1]) - c * C) : C;
            const bool ok0 = f0 < static_cast<uint32_t>(C);  // false only for indices that
            const bool ok1 = f1 < static_cast<uint32_t>(C);  // broke the contract
            const bool upper = (lane & 16) != 0;
            acc_t prev = acc_t(0);  // the partial so far, loaded early to hide its latency
            if (lane == 0 && ok0) prev = out[p];
            if (lane == 16 && ok1) prev = out[p + 1];
            acc_t s0 = acc_t(0), s1 = acc_t(0);
            acc_t xv[kV];
            if (ok0) {
              load_vec<T, kV>(xs + f0 * kTile + lane * kV, xv);
#pragma unroll
              for (int v = 0; v < kV; ++v) s0 += gr[r][v] * xv[v];
            }
            if (ok1) {
              load_vec<T, kV>(xs + f1 * kTile + lane * kV, xv);
#pragma unroll
              for (int v = 0; v < kV; ++v) s1 += gr[r][v] * xv[v];
            }
            acc_t a = upper ? s1 : s0;
            a += shfl_xor32(upper ? s0 : s1, 16);  // partner in the other half sends my entry
#pragma unroll
            for (int m = 8; m > 0; m >>= 1) a += shfl_xor32(a, m);
            if (lane == 0 && ok0) out[p] = prev + a;
            if (lane == 16 && ok1) out[p + 1] = prev + a;
          }
        }
      }
    }
  }
}

// ---- few tokens: one group per row, lanes over the row's k entries, 4 tokens at a time ----------
template <typename T, typename index_t>
__global__ void small_tokens_kernel(const typename T::raw* __restrict__ x, int64_t ntok, int64_t K,
                                    const typename T::raw* __restrict__ values,
                                    const index_t* __restrict__ idx, int64_t rows, int64_t k,
                                    typename T::raw* __restrict__ y) {
  using acc_t = typename T::acc;
  const int lane = threadIdx.x % kGroup;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kGroups) + threadIdx.x / kGroup;
  if (row >= rows) return;  // whole group leaves together; no barriers below
  for (int64_t t0 = 0; t0 < ntok; t0 += 4) {
    acc_t acc[4] = {acc_t(0), acc_t(0), acc_t(0), acc_t(0)};
    for (int64_t j = lane; j < k; j += kGroup) {
      const int64_t f = idx[row * k + j];
      if (f < 0 || f >= K) continue;
      const acc_t w = T::to_acc(values[row * k + j]);
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (t0 + q < ntok) acc[q] += w * T::to_acc(x[(t0 + q) * K + f]);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const acc_t s = group_sum(acc[q]);
      if (lane == 0 && t0 + q < ntok) y[(t0 + q) * rows + row] = T::from_acc(s);
    }
  }
}

// ---- launchers (the caller checks shapes, owns the buffers and checks the launch) ---------------
inline unsigned int grid_1d(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks > 65535 * 8 ? 65535 * 8 : blocks));
}

template <typename index_t>
void launch_validate(const index_t* idx, int64_t rows, int64_t k, int64_t in_features,
                     int32_t* flags, cudaStream_t stream) {
  validate_indices_kernel<index_t><<<grid_1d(rows * k, kThreads), kThreads, 0, stream>>>(
      idx, rows, k, in_features, flags);
}

template <typename T, typename index_t>
void launch_pack(const index_t* col, const typename T::raw* values, const int64_t* src,
                 int64_t nnz, Entry<typename T::acc>* entries, cudaStream_t stream) {
  pack_entries_kernel<T, index_t><<<grid_1d(nnz, kThreads), kThreads, 0, stream>>>(
      col, values, src, nnz, entries);
}

template <typename index_t>
void launch_chunk_ptr(const index_t* col, const int32_t* rowptr, int64_t k, int64_t rows,
                      int nchunks, int chunk, int32_t* cptr, cudaStream_t stream) {
  chunk_ptr_kernel<index_t><<<grid_1d(rows * (nchunks + 1), kThreads), kThreads, 0, stream>>>(
      col, rowptr, k, rows, nchunks, chunk, cptr);
}

// Blocks for the tiled kernels: row_tiles * tok_tiles * splits (the caller keeps it < 2^31).
template <typename T>
void launch_spmm(const typename T::raw* x, int64_t ntok, int64_t K, bool x_vec,
                 const Entry<typename T::acc>* entries, const int32_t* cptr, int64_t rows,
                 int nchunks, int chunks_per_split, int splits, typename T::raw* y,
                 typename T::acc* part, bool y_vec, cudaStream_t stream) {
  const int64_t row_tiles = (rows + rows_per_block<T>() - 1) / rows_per_block<T>();
  const int64_t tok_tiles = (ntok + kTile - 1) / kTile;
  const unsigned int blocks = static_cast<unsigned int>(row_tiles * tok_tiles * splits);
  spmm_kernel<T><<<blocks, kThreads, 0, stream>>>(x, ntok, K, x_vec, entries, cptr, rows,
                                                 nchunks, chunks_per_split, row_tiles, tok_tiles,
                                                 y, part, y_vec);
}

template <typename T, typename index_t>
void launch_sddmm(const typename T::raw* g, const typename T::raw* x, int64_t ntok, int64_t K,
                  bool x_vec, bool g_vec, const index_t* idx, const int32_t* cptr, int64_t rows,
                  int nchunks, int64_t tiles_per_split, int64_t splits, int64_t nnz,
                  typename T::acc* part, cudaStream_t stream) {
  const int64_t row_tiles = (rows + rows_per_block<T>() - 1) / rows_per_block<T>();
  const int64_t tok_tiles = (ntok + kTile - 1) / kTile;
  const unsigned int blocks = static_cast<unsigned int>(row_tiles * splits);
  sddmm_kernel<T, index_t><<<blocks, kThreads, 0, stream>>>(g, x, ntok, K, x_vec, g_vec, idx,
                                                           cptr, rows, nchunks, row_tiles,
                                                           tok_tiles, tiles_per_split, nnz, part);
}

template <typename T, typename index_t>
void launch_small_tokens(const typename T::raw* x, int64_t ntok, int64_t K,
                         const typename T::raw* values, const index_t* idx, int64_t rows,
                         int64_t k, typename T::raw* y, cudaStream_t stream) {
  const unsigned int blocks = static_cast<unsigned int>((rows + kGroups - 1) / kGroups);
  small_tokens_kernel<T, index_t><<<blocks, kThreads, 0, stream>>>(x, ntok, K, values, idx, rows,
                                                                  k, y);
}

}  // namespace squash_ffi
