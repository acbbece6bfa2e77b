// Host emulation of the HIP runtime subset used by squash's FFI kernels (tests only).
// Every thread of a block is a fiber (ucontext) on one OS thread; fibers switch only at
// __syncthreads and at warp shuffles, in a random order per phase, so a missing barrier shows up
// as wrong values and a barrier or shuffle not reached by every thread aborts with a message.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3_ { unsigned x, y, z; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) double2 { double x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
typedef void* hipStream_t;
typedef int hipError_t;

template <typename A, typename B>
inline A emu_bitcast(const B& b) {
  static_assert(sizeof(A) == sizeof(B), "bit cast of equal sizes");
  A a;
  std::memcpy(&a, &b, sizeof(A));
  return a;
}
inline float __uint_as_float(unsigned u) { return emu_bitcast<float>(u); }
inline unsigned __float_as_uint(float f) { return emu_bitcast<unsigned>(f); }
inline double __hiloint2double(int hi, int lo) {
  return emu_bitcast<double>((static_cast<uint64_t>(static_cast<uint32_t>(hi)) << 32) |
                             static_cast<uint32_t>(lo));
}
inline int __double2loint(double d) { return static_cast<int>(emu_bitcast<uint64_t>(d)); }
inline int __double2hiint(double d) { return static_cast<int>(emu_bitcast<uint64_t>(d) >> 32); }

namespace emu {

constexpr int kWarp = 32;  // emulated wavefront (RDNA wave32 / a CUDA warp)
enum State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone };

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  uint3_ tid;
  State state = kRunnable;
  std::function<void()> body;
};

struct Runtime {
  ucontext_t sched;
  std::vector<Fiber> fibers;
  Fiber* cur = nullptr;
  uint3_ block{0, 0, 0};
  dim3 block_dim, grid_dim;
  std::vector<unsigned char> slots;  // shuffle exchange, 8 bytes per thread
  std::mt19937 rng{12345};
};
inline Runtime& rt() {
  static Runtime r;
  return r;
}

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "emulator: %s (block %u)\n", what, rt().block.x);
  std::exit(3);
}

inline void yield_as(State s) {
  Runtime& r = rt();
  r.cur->state = s;
  swapcontext(&r.cur->ctx, &r.sched);
}

inline void entry(unsigned lo, unsigned hi) {
  Fiber* f = reinterpret_cast<Fiber*>((static_cast<uintptr_t>(hi) << 32) | lo);
  f->body();
  f->state = kDone;
  swapcontext(&f->ctx, &rt().sched);
}

inline void run_block(const std::function<void()>& kernel) {
  Runtime& r = rt();
  const unsigned n = r.block_dim.x;
  if (n % kWarp != 0) fail("block size must be a multiple of 32");
  r.fibers.assign(n, Fiber{});
  r.slots.assign(8 * n, 0);
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = r.fibers[t];
    f.stack.resize(1 << 16);
    f.tid = {t, 0, 0};
    f.body = kernel;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    const uintptr_t p = reinterpret_cast<uintptr_t>(&f);
    makecontext(&f.ctx, reinterpret_cast<void (*)()>(entry), 2, static_cast<unsigned>(p),
                static_cast<unsigned>(p >> 32));
  }
  std::vector<unsigned> order(n);
  for (unsigned t = 0; t < n; ++t) order[t] = t;
  for (;;) {
    std::shuffle(order.begin(), order.end(), r.rng);
    bool ran = false;
    for (unsigned t : order) {
      Fiber& f = r.fibers[t];
      if (f.state != kRunnable) continue;
      ran = true;
      r.cur = &f;
      swapcontext(&r.sched, &f.ctx);
    }
    if (ran) continue;
    unsigned done = 0, at_block = 0;
    for (auto& f : r.fibers) {
      done += f.state == kDone;
      at_block += f.state == kAtBlockBarrier;
    }
    if (done == n) return;
    bool released = false;
    for (unsigned w = 0; w < n / kWarp; ++w) {  // a warp barrier opens when all 32 lanes wait
      unsigned waiting = 0;
      for (unsigned l = 0; l < kWarp; ++l)
        waiting += r.fibers[w * kWarp + l].state == kAtWarpBarrier;
      if (waiting == kWarp) {
        for (unsigned l = 0; l < kWarp; ++l) r.fibers[w * kWarp + l].state = kRunnable;
        released = true;
      }
    }
    if (released) continue;
    if (at_block == n) {
      for (auto& f : r.fibers) f.state = kRunnable;
      continue;
    }
    fail("deadlock: __syncthreads or a shuffle not reached by every thread that should");
  }
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args... args) {
  Runtime& r = rt();
  if (grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1) fail("1-D launches only");
  r.grid_dim = grid;
  r.block_dim = block;
  std::function<void()> body = [=]() { kernel(static_cast<Params>(args)...); };
  for (unsigned b = 0; b < grid.x; ++b) {
    r.block = {b, 0, 0};
    run_block(body);
  }
}

template <typename V>
V shfl_xor(V v, int mask, int width) {
  static_assert(sizeof(V) <= 8, "8-byte shuffles at most");
  Runtime& r = rt();
  const unsigned t = r.cur->tid.x;
  const unsigned lane = t % kWarp;
  const unsigned src_lane = (lane & ~(width - 1u)) | ((lane ^ mask) & (width - 1u));
  std::memcpy(&r.slots[8 * t], &v, sizeof(V));
  yield_as(kAtWarpBarrier);  // every lane has written
  V out;
  std::memcpy(&out, &r.slots[8 * (t - lane + src_lane)], sizeof(V));
  yield_as(kAtWarpBarrier);  // every lane has read
  return out;
}

}  // namespace emu

#define threadIdx (::emu::rt().cur->tid)
#define blockIdx (::emu::rt().block)
#define blockDim (::emu::rt().block_dim)
#define gridDim (::emu::rt().grid_dim)
#define __syncthreads() ::emu::yield_as(::emu::kAtBlockBarrier)
#define __shfl_xor(v, m, w) ::emu::shfl_xor((v), (m), (w))
#define hipLaunchKernelGGL(kernel, grid, block, smem, stream, ...) \
  ::emu::launch(kernel, grid, block, __VA_ARGS__)

inline int atomicOr(int* p, int v) { const int old = *p; *p |= v; return old; }
inline int atomicMin(int* p, int v) { const int old = *p; *p = std::min(old, v); return old; }
