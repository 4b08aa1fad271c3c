// The CUDA execution model on the host, for running the project's kernel sources on a CPU.
//
// Every thread of a block is a fiber; a block's fibers run on one OS thread and switch only
// at barriers (`__syncthreads`, and the warp-level operations, which run in lockstep over
// the 32 lanes of a warp), so no thread passes a barrier before every live thread of its
// block (or warp) has reached it. `__shared__` variables are per block: blocks run one at a
// time on an OS thread, and shared variables are thread_local statics of that thread.
// Arithmetic is IEEE f32/f64 with no contraction (the library is compiled with
// -ffp-contract=off, matching NVRTC's --fmad=false).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

struct dim3 {
    unsigned int x, y, z;
};
struct uint3 {
    unsigned int x, y, z;
};

namespace cudasim {

// What a running fiber knows about itself.
struct ThreadCtx {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
    unsigned lane;        // index within its warp
    unsigned warp;        // warp index within the block
    void* dynamic_shared; // the block's dynamic shared memory
};

// The fiber now running on this OS thread.
ThreadCtx* current();
// Waits until every live thread of the block reaches this barrier.
void sync_block();
// Waits until every live lane of the calling thread's warp reaches this point, after the
// lane published `value`; returns the values of all 32 lanes (lanes not live read 0) and
// the mask of live lanes.
void warp_exchange(uint64_t value, uint64_t out[32], unsigned* live_mask);
// Reports a fault inside a kernel (named by the launcher) and ends the fiber's block.
[[noreturn]] void fault(const char* what);

}  // namespace cudasim

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __shared__ static thread_local
#define __launch_bounds__(...)

#define threadIdx (cudasim::current()->thread_idx)
#define blockIdx (cudasim::current()->block_idx)
#define blockDim (cudasim::current()->block_dim)
#define gridDim (cudasim::current()->grid_dim)
#define warpSize 32

inline void __syncthreads() { cudasim::sync_block(); }
inline int __syncthreads_count(int p) {
    // Counted through a block-wide exchange of shared counters.
    __shared__ int count;
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) count = 0;
    __syncthreads();
    if (p) count += 1;
    __syncthreads();
    int r = count;
    __syncthreads();
    return r;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() {}
inline void __syncwarp(unsigned = 0xffffffffu) {
    uint64_t v[32];
    unsigned live;
    cudasim::warp_exchange(0, v, &live);
}

// ---- atomics (global memory may be shared with blocks on other OS threads)
template <class T>
inline T atomicAdd(T* p, T v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline float atomicAdd(float* p, float v) {
    float old = *p, want;
    do {
        want = old + v;
    } while (!__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return old;
}
inline double atomicAdd(double* p, double v) {
    double old = *p, want;
    do {
        want = old + v;
    } while (!__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return old;
}
template <class T>
inline T atomicSub(T* p, T v) {
    return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED);
}
template <class T>
inline T atomicMax(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
template <class T>
inline T atomicMin(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old > v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
template <class T>
inline T atomicExch(T* p, T v) {
    return __atomic_exchange_n(p, v, __ATOMIC_RELAXED);
}
template <class T>
inline T atomicCAS(T* p, T cmp, T v) {
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return cmp;
}
template <class T>
inline T atomicOr(T* p, T v) {
    return __atomic_fetch_or(p, v, __ATOMIC_RELAXED);
}
template <class T>
inline T atomicAnd(T* p, T v) {
    return __atomic_fetch_and(p, v, __ATOMIC_RELAXED);
}

// ---- warp-level operations, in lockstep over the warp's live lanes
template <class T>
inline uint64_t cudasim_bits(T v) {
    static_assert(sizeof(T) <= 8, "warp values are at most 8 bytes");
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T>
inline T cudasim_from_bits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}
template <class T>
inline T cudasim_shfl(T v, int src_lane, unsigned mask) {
    (void)mask;
    uint64_t all[32];
    unsigned live;
    cudasim::warp_exchange(cudasim_bits(v), all, &live);
    unsigned s = (unsigned)src_lane & 31u;
    if (!(live >> s & 1u)) return v;  // an inactive source lane: the caller's own value
    return cudasim_from_bits<T>(all[s]);
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    unsigned lane = cudasim::current()->lane;
    int base = (int)(lane / (unsigned)width) * width;
    return cudasim_shfl(v, base + (src % width), mask);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    unsigned lane = cudasim::current()->lane;
    unsigned seg = lane % (unsigned)width;
    int src = (seg + d < (unsigned)width) ? (int)(lane + d) : (int)lane;
    return cudasim_shfl(v, src, mask);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    unsigned lane = cudasim::current()->lane;
    unsigned seg = lane % (unsigned)width;
    int src = (seg >= d) ? (int)(lane - d) : (int)lane;
    return cudasim_shfl(v, src, mask);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int x, int width = 32) {
    unsigned lane = cudasim::current()->lane;
    unsigned src = lane ^ (unsigned)x;
    if (src / (unsigned)width != lane / (unsigned)width) src = lane;
    return cudasim_shfl(v, (int)src, mask);
}
inline unsigned __ballot_sync(unsigned mask, int p) {
    uint64_t all[32];
    unsigned live;
    cudasim::warp_exchange(p ? 1 : 0, all, &live);
    unsigned r = 0;
    for (unsigned i = 0; i < 32; i++)
        if ((live >> i & 1u) && all[i]) r |= 1u << i;
    return r & mask;
}
inline int __any_sync(unsigned mask, int p) { return __ballot_sync(mask, p) != 0; }
inline int __all_sync(unsigned mask, int p) {
    uint64_t all[32];
    unsigned live;
    cudasim::warp_exchange(p ? 1 : 0, all, &live);
    for (unsigned i = 0; i < 32; i++)
        if ((live & mask) >> i & 1u && !all[i]) return 0;
    return 1;
}
template <class T>
inline unsigned __match_any_sync(unsigned mask, T v) {
    uint64_t all[32];
    unsigned live;
    uint64_t mine = cudasim_bits(v);
    cudasim::warp_exchange(mine, all, &live);
    unsigned r = 0;
    for (unsigned i = 0; i < 32; i++)
        if (((live & mask) >> i & 1u) && all[i] == mine) r |= 1u << i;
    return r;
}
inline unsigned __activemask() {
    uint64_t all[32];
    unsigned live;
    cudasim::warp_exchange(0, all, &live);
    return live;
}

// ---- bit reinterpretation and integer intrinsics
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
inline long long __double_as_longlong(double d) { long long i; std::memcpy(&i, &d, 8); return i; }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; i++) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}

// ---- IEEE arithmetic with explicit rounding (round-to-nearest forms only)
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
using std::isinf;
using std::isnan;
using std::isfinite;

// ---- conversions with an explicit rounding direction
inline float __double2float_rn(double v) { return (float)v; }
inline float __double2float_rz(double v) {
    float f = (float)v;  // nearest
    if (std::isnan(v)) return f;
    if (std::fabs((double)f) > std::fabs(v)) f = std::nextafter(f, 0.0f);
    return f;
}
inline float __double2float_rd(double v) {
    float f = (float)v;
    if ((double)f > v) f = std::nextafter(f, -INFINITY);
    return f;
}
inline float __double2float_ru(double v) {
    float f = (float)v;
    if ((double)f < v) f = std::nextafter(f, INFINITY);
    return f;
}

// ---- min / max as CUDA overloads them
#define CUDASIM_MINMAX(T)                                  \
    inline T max(T a, T b) { return a > b ? a : b; }       \
    inline T min(T a, T b) { return a < b ? a : b; }
CUDASIM_MINMAX(int)
CUDASIM_MINMAX(unsigned int)
CUDASIM_MINMAX(long long)
CUDASIM_MINMAX(unsigned long long)
CUDASIM_MINMAX(long)
CUDASIM_MINMAX(unsigned long)
#undef CUDASIM_MINMAX
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
