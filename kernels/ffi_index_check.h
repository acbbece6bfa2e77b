// The FFI index contract, as every native kernel words it: the messages are those of
// squash.sparsity.validate_ffi (the one place that states the rules), so a bad pattern raises the
// same ValueError on the reference, the CPU kernel and the GPU kernel.
//
// Rules: the fan-in k lies in [1, in_features]; int16 indices address at most 32767 features;
// every row is strictly increasing (no duplicate, no decrease) within [0, in_features).
// Plain C++ (no torch, no CUDA): the CPU kernel, the GPU glue and the GPU emulator's driver
// include it.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

namespace squash_ffi_check {

constexpr int64_t kInt16MaxFeatures = 32767;

// A shape as Python prints it: (2, 3).
template <typename Sizes>
std::string shape_str(const Sizes& sizes) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i)
    s += (i ? ", " : "") + std::to_string(static_cast<int64_t>(sizes[i]));
  return s + (sizes.size() == 1 ? ",)" : ")");
}

// validate_ffi's message for a fan-in or index-width rule broken by the shape alone, or "".
template <typename index_t>
std::string shape_error(int64_t k, int64_t in_features) {
  if (std::is_same<index_t, int16_t>::value && in_features > kInt16MaxFeatures)
    return "int16 FFI indices cannot address in_features=" + std::to_string(in_features);
  if (k < 1 || k > in_features)
    return "FFI fan-in must be in [1, in_features=" + std::to_string(in_features) + "], got " +
           std::to_string(k);
  return "";
}

// One pass over idx (rows, k), k >= 1: true when every row is strictly increasing within
// [0, in_features). A row that increases is in range when its ends are, so the pass costs one
// comparison per index; the caller asks index_error for the message only when this fails.
template <typename index_t>
bool rows_ok(const index_t* idx, int64_t rows, int64_t k, int64_t in_features) {
  int bad = 0;
  for (int64_t o = 0; o < rows; ++o) {
    const index_t* r = idx + o * k;
    bad |= (r[0] < 0) | (static_cast<int64_t>(r[k - 1]) >= in_features);
    for (int64_t j = 1; j < k; ++j) bad |= r[j] <= r[j - 1];
  }
  return bad == 0;
}

// validate_ffi's message for the first broken rule of idx (rows, k), or "" if none: the first
// out-of-range index in row-major order, else the first step that does not increase.
template <typename index_t>
std::string index_error(const index_t* idx, int64_t rows, int64_t k, int64_t in_features) {
  for (int64_t p = 0; p < rows * k; ++p) {
    const int64_t v = idx[p];
    if (v < 0 || v >= in_features)
      return "FFI index out of range [0, " + std::to_string(in_features) + "): indices[" +
             std::to_string(p / k) + ", " + std::to_string(p % k) + "] = " + std::to_string(v);
  }
  for (int64_t o = 0; o < rows; ++o)
    for (int64_t j = 1; j < k; ++j) {
      const index_t a = idx[o * k + j - 1], b = idx[o * k + j];
      if (b <= a)
        return "FFI indices must be strictly increasing in each row: row " + std::to_string(o) +
               " is " + (a == b ? "duplicated" : "not sorted") + " at positions " +
               std::to_string(j - 1) + ", " + std::to_string(j);
    }
  return "";
}

}  // namespace squash_ffi_check
