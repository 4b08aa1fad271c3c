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

// ---- Probe statistics of a tensor, gathered element by element (one arena slot per
// tensor; layout read by the arena's `parse_slot`). The arena's own pass (probes/stats.cu)
// and every kernel that gathers its output's statistics while writing it use these same
// steps over the same launch shape, so both give the same slot bit for bit.
//
// Every value is classified by its bit pattern as f32 (fp16 and bf16 widen exactly), so
// NaN payloads, signed zeros and subnormals are counted exactly and nothing is flushed.
// Counts are integer atomics (one per block and counter) and extremes are integer
// atomicMax on bit patterns, so they do not depend on scheduling. The sum of squares is
// per-block f64 partials, combined by `amp_stats_finish` in block order, so it is
// reproducible run to run.

#define ST_NAN 0
#define ST_POS_INF 1
#define ST_NEG_INF 2
#define ST_ZEROS 3
#define ST_SUBNORMAL 4
#define ST_F16_OVER 5
#define ST_F16_UNDER 6
#define ST_BF16_OVER 7
#define ST_BF16_UNDER 8
#define ST_ROUND_OVER 9
#define ST_ROUND_UNDER 10
#define ST_MAX_BITS 11
#define ST_MIN_BITS_REV 12  // max of (0x7fffffff - |x| bits) over finite nonzero: 0 = none
#define ST_SUM_SQ 13        // f64 bits, written by amp_stats_finish
#define ST_BLOCKS 14        // number of partials of the slot
#define ST_NUMEL 15
#define ST_HIST 16          // floor(log2|x|) + 149 for -149..=127: 277 bins
#define HIST_BINS 277
#define SLOT_WORDS 296
#define MAX_PARTIALS 1024
#define STATS_THREADS 256
#define WARPS (STATS_THREADS / 32)
#define N_COUNTERS 9

__device__ __forceinline__ u32 widened_bits(const void* p, int kind, u64 i) {
    if (kind == KIND_F32) return ((const u32*)p)[i];
    u16 h = ((const u16*)p)[i];
    if (kind == KIND_BF16) return ((u32)h) << 16;
    return __float_as_uint(f16_bits_to_f32(h));
}

// The smallest normal of a storage kind as an f32 bit pattern.
__device__ __forceinline__ u32 kind_sub_limit(int kind) {
    return kind == KIND_F16 ? 0x38800000u : 0x00800000u;
}

// A block's shared tallies.
struct StatsShared {
    u32 hist[WARPS][HIST_BINS];
    u32 cnt[N_COUNTERS];
    u32 mx, mn_rev;
    double sq[STATS_THREADS];
};

// The block's tallies for a kernel's tensor.
__device__ StatsShared* stats_shared() {
    __shared__ StatsShared s;
    return &s;
}

// The block's tallies for a second tensor the same kernel gathers at the same time (an
// update's gradient beside its new parameter); apart, so that kernels gathering one tensor
// do not reserve its shared memory.
__device__ StatsShared* stats_shared_second() {
    __shared__ StatsShared s;
    return &s;
}

// One thread's tallies, and the block's they go to.
struct StatsAcc {
    u32 c[N_COUNTERS];
    u32 mx, mn_rev, sub_limit;
    double sq;
    StatsShared* sh;
};

// Clears the block's tallies `sh` and the thread's (every thread of the block calls it).
__device__ void stats_begin(StatsAcc* a, u32 sub_limit, StatsShared* sh) {
    StatsShared* s = sh;
    a->sh = sh;
    for (u32 k = threadIdx.x; k < WARPS * HIST_BINS; k += blockDim.x) (&s->hist[0][0])[k] = 0;
    if (threadIdx.x < N_COUNTERS) s->cnt[threadIdx.x] = 0;
    if (threadIdx.x == 0) { s->mx = 0; s->mn_rev = 0; }
    for (int k = 0; k < N_COUNTERS; ++k) a->c[k] = 0;
    a->mx = 0;
    a->mn_rev = 0;
    a->sub_limit = sub_limit;
    a->sq = 0.0;
    __syncthreads();
}

// Tallies one value, given as its f32 bit pattern.
__device__ __forceinline__ void stats_add(StatsAcc* a, u32 b) {
    u32 x = b & 0x7fffffffu;
    if (x > 0x7f800000u) { a->c[ST_NAN]++; return; }
    if (x == 0x7f800000u) { a->c[b == x ? ST_POS_INF : ST_NEG_INF]++; return; }
    if (x == 0) { a->c[ST_ZEROS]++; return; }
    a->mx = max(a->mx, x);
    a->mn_rev = max(a->mn_rev, 0x7fffffffu - x);
    float v = __uint_as_float(x);
    a->sq += (double)v * (double)v;
    if (x < a->sub_limit) a->c[ST_SUBNORMAL]++;
    if (x >= 0x477ff000u) a->c[ST_F16_OVER]++;
    if (x <= 0x33000000u) a->c[ST_F16_UNDER]++;
    if (x >= 0x7f7f8000u) a->c[ST_BF16_OVER]++;
    if (x <= 0x00008000u) a->c[ST_BF16_UNDER]++;
    u32 field = x >> 23;
    int e = field ? (int)field - 127 : -149 + (31 - __clz(x));
    atomicAdd(&a->sh->hist[threadIdx.x / 32][e + 149], 1u);
}

// Adds the block's tallies to `slot` and leaves its sum of squares in `partials[block]`
// (`block` of `nblocks`, which covered `n` values in all). Every thread calls it.
__device__ void stats_end(StatsAcc* a, u64* slot, double* partials, u32 block, u32 nblocks,
                          u64 n) {
    StatsShared* s = a->sh;
    for (int k = 0; k < N_COUNTERS; ++k)
        if (a->c[k]) atomicAdd(&s->cnt[k], a->c[k]);
    if (a->mx) atomicMax(&s->mx, a->mx);
    if (a->mn_rev) atomicMax(&s->mn_rev, a->mn_rev);
    s->sq[threadIdx.x] = a->sq;
    __syncthreads();
    // Fixed-shape tree: the partial depends only on the data and the launch shape.
    for (u32 h = blockDim.x / 2; h > 0; h >>= 1) {
        if (threadIdx.x < h) s->sq[threadIdx.x] += s->sq[threadIdx.x + h];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        partials[block] = s->sq[0];
        if (s->mx) atomicMax(&slot[ST_MAX_BITS], (u64)s->mx);
        if (s->mn_rev) atomicMax(&slot[ST_MIN_BITS_REV], (u64)s->mn_rev);
        if (block == 0) {
            slot[ST_BLOCKS] = nblocks;
            slot[ST_NUMEL] = n;
        }
    }
    if (threadIdx.x < N_COUNTERS && s->cnt[threadIdx.x])
        atomicAdd(&slot[threadIdx.x], (u64)s->cnt[threadIdx.x]);
    for (u32 k = threadIdx.x; k < HIST_BINS; k += blockDim.x) {
        u32 total = 0;
        for (int w = 0; w < WARPS; ++w) total += s->hist[w][k];
        if (total) atomicAdd(&slot[ST_HIST + k], (u64)total);
    }
}

// ---- The check-only mode: in a step whose op records are not kept, a slot gathers only
// its tensor's NaN, +inf and -inf counts (ST_NAN, ST_POS_INF, ST_NEG_INF) and its length;
// every other word stays zero (ST_BLOCKS too, so amp_stats_finish leaves a zero sum).

// Clears the block's three shared counters and the thread's.
__device__ void check_begin(StatsAcc* a, StatsShared* sh) {
    a->sh = sh;
    if (threadIdx.x < 3) sh->cnt[threadIdx.x] = 0;
    a->c[ST_NAN] = a->c[ST_POS_INF] = a->c[ST_NEG_INF] = 0;
    __syncthreads();
}

// Counts one value, given as its f32 bit pattern, if it is not finite.
__device__ __forceinline__ void check_add(StatsAcc* a, u32 b) {
    u32 x = b & 0x7fffffffu;
    if (x >= 0x7f800000u) a->c[x > 0x7f800000u ? ST_NAN : (b == x ? ST_POS_INF : ST_NEG_INF)]++;
}

// Adds the block's counts to `slot` (block 0 also writes the length). Every thread calls it.
__device__ void check_end(StatsAcc* a, u64* slot, u32 block, u64 n) {
    StatsShared* s = a->sh;
    for (int k = 0; k < 3; ++k)
        if (a->c[k]) atomicAdd(&s->cnt[k], a->c[k]);
    __syncthreads();
    if (threadIdx.x < 3 && s->cnt[threadIdx.x]) atomicAdd(&slot[threadIdx.x], (u64)s->cnt[threadIdx.x]);
    if (threadIdx.x == 0 && block == 0) slot[ST_NUMEL] = n;
}

// An op kernel's output statistics: `counts` is word ST_ROUND_OVER of the op's slot and
// `partials` the slot's partial sums, or null when the arena does not gather them in this
// kernel (the output is then probed by the arena's own pass, or not at all). The kernel
// runs on the arena's launch shape when they are gathered. A partials address with its
// lowest bit set (f64 partials are 8-byte aligned) asks for the check-only mode.
struct OutStats {
    StatsAcc acc;
    u64* slot;
    double* partials;
    u32 check;
};

__device__ __forceinline__ void out_begin(OutStats* o, u64* counts, double* partials,
                                          int kind) {
    u64 p = (u64)partials;
    o->check = (u32)(p & 1u);
    o->partials = (double*)(p & ~(u64)1);
    o->slot = (counts && o->partials) ? counts - ST_ROUND_OVER : 0;
    if (!o->slot) return;
    if (o->check) {
        check_begin(&o->acc, stats_shared());
    } else {
        stats_begin(&o->acc, kind_sub_limit(kind), stats_shared());
    }
}

// Tallies element i of the output as stored.
__device__ __forceinline__ void out_add(OutStats* o, const void* y, int kind, u64 i) {
    if (!o->slot) return;
    if (o->check) {
        check_add(&o->acc, widened_bits(y, kind, i));
    } else {
        stats_add(&o->acc, widened_bits(y, kind, i));
    }
}

__device__ __forceinline__ void out_end(OutStats* o, u64 n) {
    if (!o->slot) return;
    if (o->check) {
        check_end(&o->acc, o->slot, blockIdx.x, n);
    } else {
        stats_end(&o->acc, o->slot, o->partials, blockIdx.x, gridDim.x, n);
    }
}

// x / m and x % m, in 32 bits where both fit (64-bit division is many times slower).
__device__ __forceinline__ u64 div_rem(u64 x, u64 m, u64* rem) {
    if (((x | m) >> 32) == 0) {
        u32 q = (u32)x / (u32)m;
        *rem = (u32)x - q * (u32)m;
        return q;
    }
    *rem = x % m;
    return x / m;
}

// One dim of a row-major index: `rest` split by the dim's size `m` into the coordinate
// (`*c`) and what is left for the outer dims; no division at all where rest < m (the
// innermost dim of a contiguous op, after the host merged its dims).
__device__ __forceinline__ u64 split_dim(u64 rest, u64 m, u64* c) {
    if (rest < m) {
        *c = rest;
        return 0;
    }
    return div_rem(rest, m, c);
}

// ---- Grid-stride loops that keep several loads in flight. Element kernels give each
// thread the elements i, i + G, i + 2G, ... (G the grid's thread count), as a plain
// grid-stride loop does, but take them GRID_UNROLL at a time: the values of a group are
// all loaded (and computed) before the first is stored, so a thread waits on memory once
// per group rather than once per element. Each thread still finishes its elements in the
// same order, so statistics gathered on the way are the same bit for bit.
#define GRID_UNROLL 4

// For every element i < n: v = value(i), then finish(i, v).
template <typename T, typename Value, typename Finish>
__device__ __forceinline__ void grid_map(u64 n, Value value, Finish finish) {
    const u64 step = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += GRID_UNROLL * step) {
        T v[GRID_UNROLL];
#ifdef __CUDACC_RTC__
#pragma unroll
#endif
        for (int u = 0; u < GRID_UNROLL; ++u) {
            u64 j = i + (u64)u * step;
            if (j < n) v[u] = value(j);
        }
#ifdef __CUDACC_RTC__
#pragma unroll
#endif
        for (int u = 0; u < GRID_UNROLL; ++u) {
            u64 j = i + (u64)u * step;
            if (j < n) finish(j, v[u]);
        }
    }
}

// ---- A sum in one thread's order: init + term(0) + ... + term(n - 1), added in that order,
// the terms computed eight at a time before the first of them is added, so that their loads
// wait on memory together rather than one after another.
template <typename Term>
__device__ __forceinline__ double thread_ordered_sum(double s, u64 n, Term term) {
    for (u64 c = 0; c < n; c += 8) {
        double t[8];
#ifdef __CUDACC_RTC__
#pragma unroll
#endif
        for (int u = 0; u < 8; ++u) t[u] = c + u < n ? term(c + u) : 0.0;
        for (int u = 0; u < 8 && c + u < n; ++u) s += t[u];
    }
    return s;
}

// ---- Sums in one thread's order, spread over a warp. Each lane computes the terms of its
// positions of a chunk of 32 (the expensive part: loads, exponentials, index arithmetic);
// every lane then adds the chunk's terms in position order from shared memory, so each
// lane holds the sum a single thread would have formed, bit for bit, and the warp reads
// memory coalesced. Blocks are multiples of 32 threads.

// This warp's 32 slots of shared scratch.
__device__ double* warp_scratch() {
    __shared__ double s[STATS_THREADS];
    return &s[threadIdx.x & ~31u];
}

// `s` plus the chunk's `count` terms (lane k holds term k; lanes past count are ignored),
// added in lane order. Every lane of the warp calls it.
__device__ __forceinline__ double warp_ordered_add(double s, double term, u32 count,
                                                   double* scratch) {
    __syncwarp();
    scratch[threadIdx.x & 31u] = term;
    __syncwarp();
    if (count == 32) {
        // Unrolled, the loads issue ahead of the chain of adds.
#ifdef __CUDACC_RTC__
#pragma unroll
#endif
        for (u32 k = 0; k < 32; ++k) s += scratch[k];
    } else {
        for (u32 k = 0; k < count; ++k) s += scratch[k];
    }
    return s;
}

// `s` plus term(0), ..., term(n - 1), added in that order (warp_ordered_add, a chunk of
// 32 at a time). The lanes compute eight chunks' terms before the first of them is added,
// so their loads wait on memory together rather than one chunk after another. Every lane
// of the warp calls it and gets the sum.
template <typename Term>
__device__ __forceinline__ double warp_ordered_sum(double s, u64 n, double* scratch,
                                                   Term term) {
    u64 lane = threadIdx.x & 31u;
    for (u64 c = 0; c < n; c += 8 * 32) {
        double t[8];
#ifdef __CUDACC_RTC__
#pragma unroll
#endif
        for (int u = 0; u < 8; ++u) {
            u64 i = c + (u64)u * 32 + lane;
            t[u] = i < n ? term(i) : 0.0;
        }
        for (int u = 0; u < 8 && c + (u64)u * 32 < n; ++u) {
            u64 left = n - (c + (u64)u * 32);
            s = warp_ordered_add(s, t[u], (u32)(left < 32 ? left : 32), scratch);
        }
    }
    return s;
}

// warp_ordered_add of the terms whose lane has `take` set: the others are skipped, not
// added as zeros (which would turn a -0.0 sum into +0.0).
__device__ __forceinline__ double warp_ordered_add_taken(double s, double term, bool take,
                                                         u32 count, double* scratch) {
    u32 mask = __ballot_sync(0xffffffffu, take);
    __syncwarp();
    scratch[threadIdx.x & 31u] = term;
    __syncwarp();
    for (u32 k = 0; k < count; ++k)
        if ((mask >> k) & 1u) s += scratch[k];
    return s;
}

// The largest of the lanes' `m` (NaN-free values), in every lane.
__device__ __forceinline__ float warp_max(float m) {
    for (int off = 16; off > 0; off >>= 1) {
        float o = __shfl_xor_sync(0xffffffffu, m, off);
        m = o > m ? o : m;
    }
    return m;
}

// ---- Line groups: a warp owns 32 consecutive lines, lane r the line first + r, so each
// line's sum is one lane's chain in position order (the sum a single thread forms, bit for
// bit) with one add per value, where warp_ordered_sum has every lane add every term. The
// values go through a per-warp 32 × 32 tile of shared memory: the lanes compute a chunk of
// 32 positions of every line (each line's chunk read along the line), then lane r reads
// its line's row. Worth it where there are enough lines to give every SM several warps.

#define LINE_GROUP 32

// A warp's tile (row r, column k at r * 32 + ((k + r) & 31): neither the writes along a
// row nor the reads down a column meet a bank twice) and two values per line.
struct LineGroup {
    float tile[LINE_GROUP * 32];
    u64 base[LINE_GROUP];
    float a[LINE_GROUP], b[LINE_GROUP];
};

// The calling warp's LineGroup.
__device__ LineGroup* line_group() {
    __shared__ LineGroup s[WARPS];
    return &s[threadIdx.x / 32];
}

__device__ __forceinline__ u32 tile_at(u32 r, u32 k) { return r * 32u + ((k + r) & 31u); }

// Lane r < rows folds value(r, 0), ..., value(r, n - 1) into `acc` in that order and gets
// the result; other lanes get `acc` back. value(r, i) is computed by lane i % 32 for every
// r < rows. Every lane of the warp calls it.
template <typename Acc, typename Value, typename Fold>
__device__ __forceinline__ Acc line_group_fold(LineGroup* g, u32 rows, u64 n, Acc acc,
                                               Value value, Fold fold) {
    u32 lane = threadIdx.x & 31u;
    for (u64 c = 0; c < n; c += 32) {
        u64 i = c + lane;
        if (i < n) {
#ifdef __CUDACC_RTC__
#pragma unroll 8
#endif
            for (u32 r = 0; r < rows; ++r) g->tile[tile_at(r, lane)] = value(r, i);
        }
        __syncwarp();
        u32 count = n - c < 32 ? (u32)(n - c) : 32u;
        if (lane < rows) {
            for (u32 k = 0; k < count; ++k) acc = fold(acc, g->tile[tile_at(lane, k)]);
        }
        __syncwarp();
    }
    return acc;
}
