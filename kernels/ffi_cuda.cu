// FFI sparse linear: GPU kernels for the squash::ffi_linear ops (CUDA; ROCm through hipify).
//
// Torch glue only: argument checks, index validation, allocation, dtype dispatch and op
// registration. The device code and its launchers live in ffi_cuda_kernels.cuh (no torch there).
// Everything runs on the current stream of the inputs' device. docs/gpu.md has the designs.
//
//   ffi_linear             y[..., o] = sum_j values[o, j] * x[..., indices[o, j]]      (SpMM)
//   ffi_linear_grad_input  gx = SpMM with the transposed pattern, built per call by a stable
//                          sort of the indices (CSC of W = CSR of W^T): no atomics
//   ffi_linear_grad_values gv[o, j] = sum_t g[t, o] * x[t, indices[o, j]]              (SDDMM)
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/accumulate.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "ffi_cuda_kernels.cuh"
#include "ffi_index_check.h"

namespace {

using namespace squash_ffi;

// ---- dispatch -----------------------------------------------------------------------------------
bool is_supported_float(at::ScalarType st) {
  return st == at::kFloat || st == at::kDouble || st == at::kBFloat16 || st == at::kHalf;
}

template <typename F>
void dispatch_float(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kFloat: f(F32{}); break;
    case at::kDouble: f(F64{}); break;
    case at::kBFloat16: f(BF16{}); break;
    case at::kHalf: f(F16{}); break;
    default: TORCH_CHECK_VALUE(false, "FFI ops take float32/64, bfloat16 or float16, got ", st);
  }
}

template <typename F>
void dispatch_index(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kShort: f(int16_t{}); break;
    case at::kInt: f(int32_t{}); break;
    default: TORCH_CHECK_VALUE(false, "FFI indices must be int16 or int32, got ", st);
  }
}

template <typename T>
at::ScalarType acc_dtype() {
  return sizeof(typename T::acc) == 8 ? at::kDouble : at::kFloat;
}

template <typename T>
const typename T::raw* raw_ptr(const at::Tensor& t) {
  return reinterpret_cast<const typename T::raw*>(t.const_data_ptr());
}

template <typename T>
typename T::raw* raw_mut_ptr(at::Tensor& t) {
  return reinterpret_cast<typename T::raw*>(t.mutable_data_ptr());
}

// Rows of a (T, width) row-major buffer can be read/written 16 bytes at a time.
bool rows_16b(const at::Tensor& t, int64_t width) {
  return (width * t.element_size()) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 1-D grids only: no 65535 limit, but HIP wants blocks * threads < 2^32.
constexpr int64_t kMaxBlocks = (int64_t{1} << 32) / kThreads - 1;

int sm_count(int device) {
  static std::mutex mu;
  static std::unordered_map<int, int> counts;
  std::lock_guard<std::mutex> lock(mu);
  auto it = counts.find(device);
  if (it != counts.end()) return it->second;
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  counts[device] = n > 0 ? n : 1;
  return counts[device];
}

// ---- argument checks ----------------------------------------------------------------------------
void check_tensors(const char* op, const at::Tensor& a, const char* a_name,
                   const at::Tensor& indices) {
  TORCH_CHECK_VALUE(a.is_cuda() && indices.is_cuda(), op, ": ", a_name,
                    " and indices must be on a CUDA/ROCm device, got ", a.device(), " and ",
                    indices.device());
  TORCH_CHECK_VALUE(a.device() == indices.device(), op, ": ", a_name, " (", a.device(),
                    ") and indices (", indices.device(), ") must be on the same device");
  TORCH_CHECK_VALUE(a.dim() >= 1, op, ": ", a_name, " must have at least one dimension");
  TORCH_CHECK_VALUE(is_supported_float(a.scalar_type()), op,
                    ": FFI ops take float32/64, bfloat16 or float16, got ", a.scalar_type());
  TORCH_CHECK_VALUE(indices.dim() == 2, op,
                    ": FFI indices must be a 2-D tensor (out_features, k), got ",
                    squash_ffi_check::shape_str(indices.sizes()));
  TORCH_CHECK_VALUE(indices.scalar_type() == at::kShort || indices.scalar_type() == at::kInt,
                    op, ": FFI indices must be int16 or int32, got ", indices.scalar_type());
  TORCH_CHECK_VALUE(indices.numel() < std::numeric_limits<int32_t>::max(), op,
                    ": at most 2^31 - 1 nonzeros, got ", indices.numel());
}

void check_values(const char* op, const at::Tensor& a, const char* a_name,
                  const at::Tensor& values, const at::Tensor& indices) {
  check_tensors(op, a, a_name, indices);
  TORCH_CHECK_VALUE(values.device() == a.device(), op, ": values (", values.device(),
                    ") must be on ", a.device());
  TORCH_CHECK_VALUE(values.dim() == 2 && indices.sizes() == values.sizes(), op,
                    ": FFI values shape ", squash_ffi_check::shape_str(values.sizes()),
                    " does not match indices shape ", squash_ffi_check::shape_str(indices.sizes()));
  TORCH_CHECK_VALUE(a.scalar_type() == values.scalar_type(), op, ": ", a_name, " (",
                    a.scalar_type(), ") and values (", values.scalar_type(),
                    ") must share a dtype");
}

int64_t leading_numel(const at::Tensor& t) {
  return c10::multiply_integers(t.sizes().begin(), t.sizes().end() - 1);
}

// ---- index validation ---------------------------------------------------------------------------
// Indices are checked on the device (range and strictly increasing rows) and the 8-byte verdict
// is copied back: one synchronisation. A tensor that passed is remembered by its TensorImpl
// (held weakly, so the address is not reused while remembered), version counter, data pointer
// and in_features; any in-place change bumps the version and brings a new check. Kernels never
// read out of bounds even for indices that were not checked (inference tensors, which keep no
// version, are checked on every call; during CUDA-graph capture no check can run).
struct Checked {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  uint32_t version;
  const void* data;
  int64_t in_features;
  int64_t rows;
  int64_t k;
};

std::mutex checked_mu;
std::unordered_map<const c10::TensorImpl*, Checked> checked;
constexpr size_t kMaxChecked = 4096;

bool was_checked(const at::Tensor& idx, int64_t in_features) {
  if (idx.is_inference()) return false;
  std::lock_guard<std::mutex> lock(checked_mu);
  auto it = checked.find(idx.unsafeGetTensorImpl());
  if (it == checked.end()) return false;
  const Checked& c = it->second;
  return !c.impl.expired() &&
         c.version == idx.unsafeGetTensorImpl()->version_counter().current_version() &&
         c.data == idx.const_data_ptr() && c.in_features == in_features &&
         c.rows == idx.size(0) && c.k == idx.size(1);
}

void remember_checked(const at::Tensor& idx, int64_t in_features) {
  if (idx.is_inference()) return;
  std::lock_guard<std::mutex> lock(checked_mu);
  if (checked.size() >= kMaxChecked) {
    for (auto it = checked.begin(); it != checked.end();) {
      it = it->second.impl.expired() ? checked.erase(it) : std::next(it);
    }
    if (checked.size() >= kMaxChecked) checked.clear();
  }
  checked.insert_or_assign(
      idx.unsafeGetTensorImpl(),
      Checked{c10::weak_intrusive_ptr<c10::TensorImpl>(idx.getIntrusivePtr()),
              idx.unsafeGetTensorImpl()->version_counter().current_version(),
              idx.const_data_ptr(), in_features, idx.size(0), idx.size(1)});
}

// `given` is the caller's tensor (its identity and version are remembered), `idx` its contiguous
// copy or itself.
void check_indices(const char* op, const at::Tensor& given, const at::Tensor& idx,
                   int64_t in_features) {
  const std::string shape = idx.scalar_type() == at::kShort
      ? squash_ffi_check::shape_error<int16_t>(idx.size(1), in_features)
      : squash_ffi_check::shape_error<int32_t>(idx.size(1), in_features);
  TORCH_CHECK_VALUE(shape.empty(), op, ": ", shape);
  if (idx.numel() == 0 || was_checked(given, in_features)) return;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return;

  const int64_t rows = idx.size(0), k = idx.size(1);
  at::Tensor flags =
      at::tensor({0, std::numeric_limits<int32_t>::max()}, at::TensorOptions().dtype(at::kInt))
          .to(idx.device());
  dispatch_index(idx.scalar_type(), [&](auto tag) {
    using index_t = decltype(tag);
    launch_validate<index_t>(idx.const_data_ptr<index_t>(), rows, k, in_features,
                             flags.mutable_data_ptr<int32_t>(), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor host = flags.cpu();
  const int32_t bits = host.const_data_ptr<int32_t>()[0];
  if (bits != 0) {
    // The verdict says which rule broke; the message (validate_ffi's words, naming the first
    // bad position as it does) is found on the host, only on this error path.
    const at::Tensor host_idx = idx.cpu();
    const std::string msg = idx.scalar_type() == at::kShort
        ? squash_ffi_check::index_error(host_idx.const_data_ptr<int16_t>(), rows, k, in_features)
        : squash_ffi_check::index_error(host_idx.const_data_ptr<int32_t>(), rows, k, in_features);
    TORCH_CHECK_VALUE(false, op, ": ", msg);
  }
  remember_checked(given, in_features);
}

// ---- SpMM driver --------------------------------------------------------------------------------
// y (ntok, rows) = SpMM of x (ntok, K) with the packed CSR (entries, cptr). When the row and token
// tiles alone give fewer blocks than two per SM, the chunks are split over more blocks that write
// fp32/fp64 partial sums, added up here.
template <typename T>
at::Tensor run_spmm(const at::Tensor& x, int64_t ntok, int64_t K, const at::Tensor& entries,
                    const at::Tensor& cptr, int64_t rows, int nchunks) {
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t row_tiles = ceil_div(rows, rows_per_block<T>());
  const int64_t tok_tiles = ceil_div(ntok, kTile);
  const int64_t base = row_tiles * tok_tiles;
  const int64_t target = 2 * static_cast<int64_t>(sm_count(x.get_device()));
  int64_t splits = 1;
  if (base < target) splits = std::min<int64_t>(nchunks, ceil_div(target, base));
  const int64_t per_split = ceil_div(nchunks, splits);
  splits = ceil_div(nchunks, per_split);
  TORCH_CHECK(base * splits <= kMaxBlocks, "squash FFI: ", ntok, " tokens x ", rows,
              " rows need ", base * splits, " thread blocks, more than ", kMaxBlocks,
              "; split the input");

  const auto* ent = reinterpret_cast<const Entry<typename T::acc>*>(entries.const_data_ptr());
  const bool x_vec = rows_16b(x, K);
  if (splits == 1) {
    at::Tensor y = at::empty({ntok, rows}, x.options());
    launch_spmm<T>(raw_ptr<T>(x), ntok, K, x_vec, ent, cptr.const_data_ptr<int32_t>(), rows,
                   nchunks, static_cast<int>(per_split), 1, raw_mut_ptr<T>(y), nullptr,
                   rows_16b(y, rows), stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
  }
  at::Tensor part = at::empty({splits, ntok, rows}, x.options().dtype(acc_dtype<T>()));
  launch_spmm<T>(raw_ptr<T>(x), ntok, K, x_vec, ent, cptr.const_data_ptr<int32_t>(), rows,
                 nchunks, static_cast<int>(per_split), static_cast<int>(splits), nullptr,
                 part.mutable_data_ptr<typename T::acc>(), false, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return part.sum(0).to(x.scalar_type());
}

template <typename T>
at::Tensor empty_entries(int64_t nnz, const at::Tensor& like) {
  return at::empty({nnz * static_cast<int64_t>(sizeof(Entry<typename T::acc>))},
                   like.options().dtype(at::kByte));
}

template <typename T>
Entry<typename T::acc>* entries_ptr(at::Tensor& entries) {
  return reinterpret_cast<Entry<typename T::acc>*>(entries.mutable_data_ptr());
}

// ---- ops ----------------------------------------------------------------------------------------
at::Tensor ffi_linear_cuda(const at::Tensor& x_in, const at::Tensor& values_in,
                           const at::Tensor& indices_in) {
  const char* op = "squash::ffi_linear";
  check_values(op, x_in, "x", values_in, indices_in);
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor values = values_in.contiguous();
  const at::Tensor indices = indices_in.contiguous();
  const int64_t K = x.size(-1), rows = values.size(0), k = values.size(1);
  const int64_t ntok = leading_numel(x);
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = rows;
  check_indices(op, indices_in, indices, K);  // before any shortcut: one contract for all shapes
  if (ntok == 0 || rows == 0) return at::empty(out_shape, x.options());

  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor y;
  dispatch_float(x.scalar_type(), [&](auto ttag) {
    using T = decltype(ttag);
    dispatch_index(indices.scalar_type(), [&](auto itag) {
      using index_t = decltype(itag);
      const index_t* idx = indices.const_data_ptr<index_t>();
      if (ntok <= kSmallTokens) {
        TORCH_CHECK(ceil_div(rows, kGroups) <= kMaxBlocks, op, ": too many rows (", rows, ")");
        y = at::empty({ntok, rows}, x.options());
        launch_small_tokens<T, index_t>(raw_ptr<T>(x), ntok, K, raw_ptr<T>(values), idx, rows,
                                        k, raw_mut_ptr<T>(y), stream);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return;
      }
      constexpr int C = chunk_features<T>();
      const int nchunks = static_cast<int>(ceil_div(K, C));
      at::Tensor entries = empty_entries<T>(rows * k, x);
      launch_pack<T, index_t>(idx, raw_ptr<T>(values), nullptr, rows * k, entries_ptr<T>(entries),
                              stream);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      at::Tensor cptr = at::empty({rows * (nchunks + 1)}, x.options().dtype(at::kInt));
      launch_chunk_ptr<index_t>(idx, nullptr, k, rows, nchunks, C, cptr.mutable_data_ptr<int32_t>(),
                                stream);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      y = run_spmm<T>(x, ntok, K, entries, cptr, rows, nchunks);
    });
  });
  return y.view(out_shape);
}

at::Tensor ffi_linear_grad_input_cuda(const at::Tensor& grad_in, const at::Tensor& values_in,
                                      const at::Tensor& indices_in, int64_t in_features) {
  const char* op = "squash::ffi_linear_grad_input";
  check_values(op, grad_in, "grad_out", values_in, indices_in);
  TORCH_CHECK_VALUE(grad_in.size(-1) == values_in.size(0), op, ": grad_out has ",
                    grad_in.size(-1), " features, values has ", values_in.size(0), " rows");
  TORCH_CHECK_VALUE(in_features >= 0, op, ": in_features must be >= 0, got ", in_features);
  c10::cuda::CUDAGuard guard(grad_in.device());
  const at::Tensor g = grad_in.contiguous();
  const at::Tensor values = values_in.contiguous();
  const at::Tensor indices = indices_in.contiguous();
  const int64_t out = values.size(0), k = values.size(1), nnz = out * k;
  const int64_t ntok = leading_numel(g);
  std::vector<int64_t> out_shape = g.sizes().vec();
  out_shape.back() = in_features;
  check_indices(op, indices_in, indices, in_features);
  if (ntok == 0) return at::empty(out_shape, g.options());
  if (nnz == 0) return at::zeros(out_shape, g.options());

  // CSR of W^T: entries sorted by column of W (stable, so rows of W stay ascending within each).
  const auto sorted = at::sort(indices.reshape({-1}).to(at::kInt), /*stable=*/true, /*dim=*/0,
                               /*descending=*/false);
  const at::Tensor keys = std::get<0>(sorted);
  const at::Tensor perm = std::get<1>(sorted).contiguous();  // int64 positions in W
  const at::Tensor rowptr =
      at::searchsorted(keys, at::arange(in_features + 1, g.options().dtype(at::kInt)),
                       /*out_int32=*/true, /*right=*/false);
  const at::Tensor col = at::floor_divide(perm, k).to(at::kInt).contiguous();  // rows of W

  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor gx;
  dispatch_float(g.scalar_type(), [&](auto ttag) {
    using T = decltype(ttag);
    constexpr int C = chunk_features<T>();
    const int nchunks = static_cast<int>(ceil_div(out, C));
    at::Tensor entries = empty_entries<T>(nnz, g);
    launch_pack<T, int32_t>(col.const_data_ptr<int32_t>(), raw_ptr<T>(values),
                            perm.const_data_ptr<int64_t>(), nnz, entries_ptr<T>(entries), stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    at::Tensor cptr = at::empty({in_features * (nchunks + 1)}, g.options().dtype(at::kInt));
    launch_chunk_ptr<int32_t>(col.const_data_ptr<int32_t>(), rowptr.const_data_ptr<int32_t>(), 0,
                              in_features, nchunks, C, cptr.mutable_data_ptr<int32_t>(), stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    gx = run_spmm<T>(g, ntok, out, entries, cptr, in_features, nchunks);
  });
  return gx.view(out_shape);
}

at::Tensor ffi_linear_grad_values_cuda(const at::Tensor& grad_in, const at::Tensor& x_in,
                                       const at::Tensor& indices_in) {
  const char* op = "squash::ffi_linear_grad_values";
  check_tensors(op, grad_in, "grad_out", indices_in);
  check_tensors(op, x_in, "x", indices_in);
  TORCH_CHECK_VALUE(grad_in.scalar_type() == x_in.scalar_type(), op, ": grad_out (",
                    grad_in.scalar_type(), ") and x (", x_in.scalar_type(),
                    ") must share a dtype");
  TORCH_CHECK_VALUE(grad_in.size(-1) == indices_in.size(0), op, ": grad_out has ",
                    grad_in.size(-1), " features, indices has ", indices_in.size(0), " rows");
  TORCH_CHECK_VALUE(grad_in.sizes().slice(0, grad_in.dim() - 1) ==
                        x_in.sizes().slice(0, x_in.dim() - 1),
                    op, ": grad_out ", grad_in.sizes(), " and x ", x_in.sizes(),
                    " must share their leading dimensions");
  c10::cuda::CUDAGuard guard(grad_in.device());
  const at::Tensor g = grad_in.contiguous();
  const at::Tensor x = x_in.contiguous();
  const at::Tensor indices = indices_in.contiguous();
  const int64_t rows = indices.size(0), k = indices.size(1), nnz = rows * k;
  const int64_t K = x.size(-1);
  const int64_t ntok = leading_numel(x);
  check_indices(op, indices_in, indices, K);
  if (nnz == 0) return at::empty({rows, k}, g.options());
  if (ntok == 0) return at::zeros({rows, k}, g.options());

  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor gv;
  dispatch_float(g.scalar_type(), [&](auto ttag) {
    using T = decltype(ttag);
    dispatch_index(indices.scalar_type(), [&](auto itag) {
      using index_t = decltype(itag);
      constexpr int C = chunk_features<T>();
      const int nchunks = static_cast<int>(ceil_div(K, C));
      const index_t* idx = indices.const_data_ptr<index_t>();
      at::Tensor cptr = at::empty({rows * (nchunks + 1)}, g.options().dtype(at::kInt));
      launch_chunk_ptr<index_t>(idx, nullptr, k, rows, nchunks, C, cptr.mutable_data_ptr<int32_t>(),
                                stream);
      C10_CUDA_KERNEL_LAUNCH_CHECK();

      // Split the tokens over more blocks while the row tiles alone give fewer than two per SM.
      const int64_t row_tiles = ceil_div(rows, rows_per_block<T>());
      const int64_t tok_tiles = ceil_div(ntok, kTile);
      const int64_t target = 2 * static_cast<int64_t>(sm_count(g.get_device()));
      int64_t splits = std::min<int64_t>(tok_tiles, ceil_div(target, row_tiles));
      splits = std::max<int64_t>(1, splits);
      const int64_t per_split = ceil_div(tok_tiles, splits);
      splits = ceil_div(tok_tiles, per_split);
      TORCH_CHECK(row_tiles * splits <= kMaxBlocks, "squash FFI: ", rows, " rows need ",
                  row_tiles * splits, " thread blocks, more than ", kMaxBlocks);
      at::Tensor part = at::zeros({splits, nnz}, g.options().dtype(acc_dtype<T>()));
      launch_sddmm<T, index_t>(raw_ptr<T>(g), raw_ptr<T>(x), ntok, K, rows_16b(x, K),
                               rows_16b(g, rows), idx, cptr.const_data_ptr<int32_t>(), rows,
                               nchunks, per_split, splits, nnz,
                               part.mutable_data_ptr<typename T::acc>(), stream);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      gv = part.sum(0).to(g.scalar_type()).view({rows, k});
    });
  });
  return gv;
}

}  // namespace

TORCH_LIBRARY_IMPL(squash, CUDA, m) {
  m.impl("ffi_linear", &ffi_linear_cuda);
  m.impl("ffi_linear_grad_input", &ffi_linear_grad_input_cuda);
  m.impl("ffi_linear_grad_values", &ffi_linear_grad_values_cuda);
}
