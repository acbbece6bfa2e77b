// Runs squash's hipified FFI kernels on the host emulator, in the steps of ffi_cuda.cu.
//   driver ops DT IT DIR ntok in out k sms    x, values, indices, g -> y, gx, gv
//   driver validate IT DIR rows k in          indices -> prints "flags position", then (when a
//                                             flag is set) the glue's message on the next line
// DT: f32 f64 bf16 f16; IT: i16 i32; tensors are raw little-endian files DIR/<name>.bin;
// sms: the SM count the split heuristics assume.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <new>
#include <string>
#include <vector>

#include "ffi_cuda_kernels.cuh"
#include "ffi_index_check.h"

using namespace squash_ffi;

template <typename E>
std::vector<E> read(const std::string& dir, const char* name, int64_t n) {
  std::vector<E> v(n);
  std::ifstream f(dir + "/" + name + ".bin", std::ios::binary);
  f.read(reinterpret_cast<char*>(v.data()), n * sizeof(E));
  if (!f) { std::fprintf(stderr, "cannot read %s\n", name); std::exit(2); }
  return v;
}

template <typename E>
void write(const std::string& dir, const char* name, const std::vector<E>& v) {
  std::ofstream f(dir + "/" + name + ".bin", std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(E));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Host buffers of exactly n elements, 16-byte aligned (the device vector paths rely on it), so
// AddressSanitizer reports any read past the end.
template <typename E>
struct Buf {
  E* p;
  int64_t n;
  explicit Buf(int64_t n_) : n(n_) {
    p = static_cast<E*>(::operator new(std::max<int64_t>(n, 1) * sizeof(E), std::align_val_t(16)));
  }
  explicit Buf(const std::vector<E>& v) : Buf(static_cast<int64_t>(v.size())) {
    std::copy(v.begin(), v.end(), p);
  }
  ~Buf() { ::operator delete(p, std::align_val_t(16)); }
  Buf(const Buf&) = delete;
  E* data() { return p; }
  std::vector<E> vec() { return std::vector<E>(p, p + n); }
};

bool vec16(int64_t width, size_t elem) { return (width * elem) % 16 == 0; }

// As run_spmm in ffi_cuda.cu.
template <typename T>
std::vector<typename T::raw> run_spmm(Buf<typename T::raw>& x, int64_t ntok, int64_t K,
                                      Buf<Entry<typename T::acc>>& entries,
                                      Buf<int32_t>& cptr, int64_t rows, int nchunks, int sms) {
  using raw = typename T::raw;
  using acc = typename T::acc;
  const int64_t row_tiles = ceil_div(rows, rows_per_block<T>());
  const int64_t tok_tiles = ceil_div(ntok, kTile);
  const int64_t base = row_tiles * tok_tiles;
  const int64_t target = 2 * sms;
  int64_t splits = 1;
  if (base < target) splits = std::min<int64_t>(nchunks, ceil_div(target, base));
  const int64_t per_split = ceil_div(nchunks, splits);
  splits = ceil_div(nchunks, per_split);
  std::fprintf(stderr, "spmm: %lld blocks, %lld splits\n", (long long)(base * splits),
               (long long)splits);
  Buf<raw> y(ntok * rows);
  const bool x_vec = vec16(K, sizeof(raw));
  if (splits == 1) {
    launch_spmm<T>(x.data(), ntok, K, x_vec, entries.data(), cptr.data(), rows, nchunks,
                   static_cast<int>(per_split), 1, y.data(), nullptr, vec16(rows, sizeof(raw)),
                   nullptr);
    return y.vec();
  }
  Buf<acc> part(splits * ntok * rows);
  launch_spmm<T>(x.data(), ntok, K, x_vec, entries.data(), cptr.data(), rows, nchunks,
                 static_cast<int>(per_split), static_cast<int>(splits), nullptr, part.data(),
                 false, nullptr);
  std::vector<raw> out(ntok * rows);
  for (int64_t i = 0; i < ntok * rows; ++i) {
    acc s = acc(0);
    for (int64_t p = 0; p < splits; ++p) s += part.data()[p * ntok * rows + i];
    out[i] = T::from_acc(s);
  }
  return out;
}

template <typename T, typename I>
int forward(const std::string& dir, int64_t ntok, int64_t K, int64_t rows, int64_t k, int sms) {
  using raw = typename T::raw;
  Buf<raw> x(read<raw>(dir, "x", ntok * K));
  Buf<raw> values(read<raw>(dir, "values", rows * k));
  Buf<I> idx(read<I>(dir, "indices", rows * k));
  if (ntok <= kSmallTokens) {
    Buf<raw> y(ntok * rows);
    launch_small_tokens<T, I>(x.data(), ntok, K, values.data(), idx.data(), rows, k, y.data(),
                              nullptr);
    write(dir, "y", y.vec());
    return 0;
  }
  constexpr int C = chunk_features<T>();
  const int nchunks = static_cast<int>(ceil_div(K, C));
  Buf<Entry<typename T::acc>> entries(rows * k);
  launch_pack<T, I>(idx.data(), values.data(), nullptr, rows * k, entries.data(), nullptr);
  Buf<int32_t> cptr(rows * (nchunks + 1));
  launch_chunk_ptr<I>(idx.data(), nullptr, k, rows, nchunks, C, cptr.data(), nullptr);
  write(dir, "y", run_spmm<T>(x, ntok, K, entries, cptr, rows, nchunks, sms));
  return 0;
}

template <typename T, typename I>
int grad_input(const std::string& dir, int64_t ntok, int64_t out, int64_t k, int64_t in,
               int sms) {
  using raw = typename T::raw;
  const int64_t nnz = out * k;
  Buf<raw> g(read<raw>(dir, "g", ntok * out));
  Buf<raw> values(read<raw>(dir, "values", nnz));
  std::vector<I> idx = read<I>(dir, "indices", nnz);
  // Stable sort of positions by column (at::sort(stable=true)), CSR of W^T.
  std::vector<int64_t> perm(nnz);
  for (int64_t p = 0; p < nnz; ++p) perm[p] = p;
  std::stable_sort(perm.begin(), perm.end(),
                   [&](int64_t a, int64_t b) { return idx[a] < idx[b]; });
  std::vector<int32_t> keys(nnz), rowptr(in + 1), col(nnz);
  for (int64_t p = 0; p < nnz; ++p) {
    keys[p] = idx[perm[p]];
    col[p] = static_cast<int32_t>(perm[p] / k);
  }
  for (int64_t i = 0; i <= in; ++i)
    rowptr[i] = static_cast<int32_t>(std::lower_bound(keys.begin(), keys.end(), i) - keys.begin());
  Buf<int64_t> perm_b(perm);
  Buf<int32_t> col_b(col), rowptr_b(rowptr);
  constexpr int C = chunk_features<T>();
  const int nchunks = static_cast<int>(ceil_div(out, C));
  Buf<Entry<typename T::acc>> entries(nnz);
  launch_pack<T, int32_t>(col_b.data(), values.data(), perm_b.data(), nnz, entries.data(),
                          nullptr);
  Buf<int32_t> cptr(in * (nchunks + 1));
  launch_chunk_ptr<int32_t>(col_b.data(), rowptr_b.data(), 0, in, nchunks, C, cptr.data(),
                            nullptr);
  write(dir, "gx", run_spmm<T>(g, ntok, out, entries, cptr, in, nchunks, sms));
  return 0;
}

template <typename T, typename I>
int grad_values(const std::string& dir, int64_t ntok, int64_t K, int64_t rows, int64_t k,
                int sms) {
  using raw = typename T::raw;
  using acc = typename T::acc;
  const int64_t nnz = rows * k;
  Buf<raw> g(read<raw>(dir, "g", ntok * rows));
  Buf<raw> x(read<raw>(dir, "x", ntok * K));
  Buf<I> idx(read<I>(dir, "indices", nnz));
  constexpr int C = chunk_features<T>();
  const int nchunks = static_cast<int>(ceil_div(K, C));
  Buf<int32_t> cptr(rows * (nchunks + 1));
  launch_chunk_ptr<I>(idx.data(), nullptr, k, rows, nchunks, C, cptr.data(), nullptr);
  const int64_t row_tiles = ceil_div(rows, rows_per_block<T>());
  const int64_t tok_tiles = ceil_div(ntok, kTile);
  const int64_t target = 2 * static_cast<int64_t>(sms);
  int64_t splits = std::max<int64_t>(1, std::min<int64_t>(tok_tiles, ceil_div(target, row_tiles)));
  const int64_t per_split = ceil_div(tok_tiles, splits);
  splits = ceil_div(tok_tiles, per_split);
  std::fprintf(stderr, "sddmm: %lld blocks, %lld splits\n", (long long)(row_tiles * splits),
               (long long)splits);
  Buf<acc> part(splits * nnz);
  std::fill(part.data(), part.data() + splits * nnz, acc(0));
  launch_sddmm<T, I>(g.data(), x.data(), ntok, K, vec16(K, sizeof(raw)),
                     vec16(rows, sizeof(raw)), idx.data(), cptr.data(), rows, nchunks, per_split,
                     splits, nnz, part.data(), nullptr);
  std::vector<raw> gv(nnz);
  for (int64_t p = 0; p < nnz; ++p) {
    acc s = acc(0);
    for (int64_t q = 0; q < splits; ++q) s += part.data()[q * nnz + p];
    gv[p] = T::from_acc(s);
  }
  write(dir, "gv", gv);
  return 0;
}

template <typename I>
int validate(const std::string& dir, int64_t rows, int64_t k, int64_t in) {
  Buf<I> idx(read<I>(dir, "indices", rows * k));
  int32_t flags[2] = {0, 0x7fffffff};
  launch_validate<I>(idx.data(), rows, k, in, flags, nullptr);
  std::printf("%d %d\n", flags[0], flags[1]);
  // As ffi_cuda.cu's check_indices: the device verdict, then the message found on the host.
  if (flags[0] != 0)
    std::printf("%s\n", squash_ffi_check::index_error(idx.data(), rows, k, in).c_str());
  return 0;
}

template <typename T, typename I>
int ops(const std::string& dir, char** a) {
  const auto n = [&](int i) { return static_cast<int64_t>(std::atoll(a[i])); };
  const int64_t ntok = n(0), in = n(1), out = n(2), k = n(3);
  const int sms = static_cast<int>(n(4));
  forward<T, I>(dir, ntok, in, out, k, sms);
  grad_input<T, I>(dir, ntok, out, k, in, sms);
  grad_values<T, I>(dir, ntok, in, out, k, sms);
  return 0;
}

template <typename T>
int ops_i(const std::string& it, const std::string& dir, char** a) {
  if (it == "i16") return ops<T, int16_t>(dir, a);
  if (it == "i32") return ops<T, int32_t>(dir, a);
  return 2;
}

int main(int argc, char** argv) {
  const std::string op = argc > 1 ? argv[1] : "";
  if (op == "validate" && argc == 7) {
    const std::string it = argv[2], dir = argv[3];
    const int64_t rows = std::atoll(argv[4]), k = std::atoll(argv[5]), in = std::atoll(argv[6]);
    if (it == "i16") return validate<int16_t>(dir, rows, k, in);
    if (it == "i32") return validate<int32_t>(dir, rows, k, in);
    return 2;
  }
  if (op != "ops" || argc != 10) return 2;
  const std::string dt = argv[2], it = argv[3], dir = argv[4];
  if (dt == "f32") return ops_i<F32>(it, dir, argv + 5);
  if (dt == "f64") return ops_i<F64>(it, dir, argv + 5);
  if (dt == "bf16") return ops_i<BF16>(it, dir, argv + 5);
  if (dt == "f16") return ops_i<F16>(it, dir, argv + 5);
  return 2;
}
