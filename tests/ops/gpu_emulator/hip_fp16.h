// Host emulation of the HIP fp16 subset used by squash's FFI kernels (tests only).
#pragma once
#include <cstdint>
#include <cstring>

struct __half {
  uint16_t bits;
};
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return static_cast<float>(f);
}
inline __half __float2half_rn(float v) {
  const _Float16 f = static_cast<_Float16>(v);  // round to nearest even
  __half h;
  std::memcpy(&h.bits, &f, 2);
  return h;
}
