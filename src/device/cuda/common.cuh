// Shared helpers of amprobe's CUDA kernels: storage kinds, exact conversions and
// round-to-nearest-even to fp16 / bf16 by bit manipulation (the same rules as the CPU
// emulator, so no header from the toolkit is needed and no intrinsic's rounding mode
// has to be trusted). Compiled without fast-math, flush-to-zero or FMA contraction.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

#define KIND_F32 0
#define KIND_F16 1
#define KIND_BF16 2

__device__ __forceinline__ float f16_bits_to_f32(u16 h) {
    u32 sign = ((u32)h & 0x8000u) << 16;
    u32 e = ((u32)h >> 10) & 0x1fu;
    u32 m = (u32)h & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    if (e != 0) return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
    if (m == 0) return __uint_as_float(sign);
    // Subnormal: m * 2^-24, exact in f32.
    float v = (float)m * 5.9604644775390625e-8f;
    return sign ? -v : v;
}

__device__ __forceinline__ u16 f32_to_f16_bits(float f) {
    u32 x = __float_as_uint(f);
    u32 sign = (x >> 16) & 0x8000u;
    u32 a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (u16)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // 65520 and up round to inf
    if (a >= 0x38800000u) {                               // normal in fp16
        u32 r = a - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return (u16)(sign | (r >> 13));
    }
    if (a <= 0x33000000u) return (u16)sign;              // 2^-25 and below tie to zero
    u32 e = a >> 23;
    u32 m = (a & 0x7fffffu) | 0x800000u;
    u32 shift = 126u - e;
    u32 q = m >> shift;
    u32 rem = m & ((1u << shift) - 1u);
    u32 half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q += 1u;
    return (u16)(sign | q);
}

__device__ __forceinline__ float bf16_bits_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

__device__ __forceinline__ u16 f32_to_bf16_bits(float f) {
    u32 b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (u16)((b | 0x00400000u) >> 16);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (u16)(b >> 16);
}

// Element i of a tensor of storage kind `kind`, as f32 (exact).
__device__ __forceinline__ float load_f32(const void* p, int kind, u64 i) {
    if (kind == KIND_F32) return ((const float*)p)[i];
    u16 h = ((const u16*)p)[i];
    return kind == KIND_F16 ? f16_bits_to_f32(h) : bf16_bits_to_f32(h);
}

// Rounds v once to the storage kind, stores it, and counts overflow (finite to inf) and
// underflow (nonzero to zero) in the caller's per-thread counters.
__device__ __forceinline__ void store_round(void* p, int kind, u64 i, float v, u32* over,
                                            u32* under) {
    u32 a = __float_as_uint(v) & 0x7fffffffu;
    if (kind == KIND_F32) {
        ((float*)p)[i] = v;
        return;
    }
    u16 h = kind == KIND_F16 ? f32_to_f16_bits(v) : f32_to_bf16_bits(v);
    ((u16*)p)[i] = h;
    u32 ha = (u32)h & 0x7fffu;
    u32 inf = kind == KIND_F16 ? 0x7c00u : 0x7f80u;
    *over += (a < 0x7f800000u && ha == inf) ? 1u : 0u;
    *under += (a != 0 && ha == 0) ? 1u : 0u;
}

// Rounds an f64 once to the storage kind (through round-to-odd to f32 for the narrow
// kinds, so there is no double rounding), stores it and counts.
__device__ __forceinline__ void store_round_f64(void* p, int kind, u64 i, double v, u32* over,
                                                u32* under) {
    float f;
    if (kind == KIND_F32) {
        f = (float)v;
        u64 a = (u64)__double_as_longlong(v) & 0x7fffffffffffffffull;
        u32 fa = __float_as_uint(f) & 0x7fffffffu;
        *over += (a < 0x7ff0000000000000ull && fa == 0x7f800000u) ? 1u : 0u;
        *under += (a != 0 && fa == 0) ? 1u : 0u;
        ((float*)p)[i] = f;
        return;
    }
    f = __double2float_rz(v);
    if (isfinite(v) && (double)f != v && isfinite(f)) {
        u32 b = __float_as_uint(f);
        b |= 1u;  // round to odd: a sticky bit below every narrower format's last bit
        f = __uint_as_float(b);
    }
    u64 a = (u64)__double_as_longlong(v) & 0x7fffffffffffffffull;
    u16 h = kind == KIND_F16 ? f32_to_f16_bits(f) : f32_to_bf16_bits(f);
    ((u16*)p)[i] = h;
    u32 ha = (u32)h & 0x7fffu;
    u32 inf = kind == KIND_F16 ? 0x7c00u : 0x7f80u;
    *over += (a < 0x7ff0000000000000ull && ha == inf) ? 1u : 0u;
    *under += (a != 0 && ha == 0) ? 1u : 0u;
}

// Adds a block's counts to two u64 counters: one atomic per block and counter, in any
// order (integer sums are order-independent, so results are deterministic).
__device__ __forceinline__ void block_add_counts(u32 over, u32 under, u64* counts) {
    __shared__ u32 s_over, s_under;
    if (threadIdx.x == 0) { s_over = 0; s_under = 0; }
    __syncthreads();
    if (over) atomicAdd(&s_over, over);
    if (under) atomicAdd(&s_under, under);
    __syncthreads();
    if (threadIdx.x == 0 && counts) {
        if (s_over) atomicAdd(&counts[0], (u64)s_over);
        if (s_under) atomicAdd(&counts[1], (u64)s_under);
    }
}
