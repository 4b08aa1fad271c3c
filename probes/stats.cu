// Probe statistics of one tensor per slot of a device-side arena, in one pass.
//
// Every value is classified by its bit pattern as f32 (fp16 and bf16 widen exactly), so
// NaN payloads, signed zeros and subnormals are counted exactly and nothing is flushed.
// Counts are integer atomics (one per block and counter) and extremes are integer
// atomicMax on bit patterns, so they do not depend on scheduling. The sum of squares is
// per-block f64 partials, combined by `amp_stats_finish` in block order, so it is
// reproducible run to run. Needs common.cuh.

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

// A tensor to probe: data, length, storage kind, the dtype's smallest normal (bit
// pattern; 0 = nothing counts as subnormal) and its arena slot.
struct ProbeDesc {
    const void* data;
    u64 n;
    u32 kind;
    u32 sub_limit;
    u32 slot;
    u32 pad;
};

__device__ __forceinline__ u32 widened_bits(const void* p, int kind, u64 i) {
    if (kind == KIND_F32) return ((const u32*)p)[i];
    u16 h = ((const u16*)p)[i];
    if (kind == KIND_BF16) return ((u32)h) << 16;
    return __float_as_uint(f16_bits_to_f32(h));
}

// The pass over one tensor by one block, covering elements block, block + nblocks, ...
// (in units of STATS_THREADS), writing counts, extremes and histogram into the slot and
// the block's sum of squares into its partial.
__device__ void stats_block(const ProbeDesc d, u32 block, u32 nblocks, u64* arena,
                            double* partials) {
    __shared__ u32 hist[WARPS][HIST_BINS];
    __shared__ u32 cnt[N_COUNTERS];
    __shared__ u32 s_max, s_min_rev;
    __shared__ double s_sq[STATS_THREADS];
    u32 warp = threadIdx.x / 32;
    for (u32 k = threadIdx.x; k < WARPS * HIST_BINS; k += blockDim.x)
        (&hist[0][0])[k] = 0;
    if (threadIdx.x < N_COUNTERS) cnt[threadIdx.x] = 0;
    if (threadIdx.x == 0) { s_max = 0; s_min_rev = 0; }
    __syncthreads();

    u32 c[N_COUNTERS];
    for (int k = 0; k < N_COUNTERS; ++k) c[k] = 0;
    u32 mx = 0, mn_rev = 0;
    double sq = 0.0;
    for (u64 i = (u64)block * blockDim.x + threadIdx.x; i < d.n;
         i += (u64)nblocks * blockDim.x) {
        u32 b = widened_bits(d.data, d.kind, i);
        u32 a = b & 0x7fffffffu;
        if (a > 0x7f800000u) { c[ST_NAN]++; continue; }
        if (a == 0x7f800000u) { c[b == a ? ST_POS_INF : ST_NEG_INF]++; continue; }
        if (a == 0) { c[ST_ZEROS]++; continue; }
        mx = max(mx, a);
        mn_rev = max(mn_rev, 0x7fffffffu - a);
        float v = __uint_as_float(a);
        sq += (double)v * (double)v;
        if (a < d.sub_limit) c[ST_SUBNORMAL]++;
        if (a >= 0x477ff000u) c[ST_F16_OVER]++;
        if (a <= 0x33000000u) c[ST_F16_UNDER]++;
        if (a >= 0x7f7f8000u) c[ST_BF16_OVER]++;
        if (a <= 0x00008000u) c[ST_BF16_UNDER]++;
        u32 field = a >> 23;
        int e = field ? (int)field - 127 : -149 + (31 - __clz(a));
        atomicAdd(&hist[warp][e + 149], 1u);
    }
    for (int k = 0; k < N_COUNTERS; ++k)
        if (c[k]) atomicAdd(&cnt[k], c[k]);
    if (mx) atomicMax(&s_max, mx);
    if (mn_rev) atomicMax(&s_min_rev, mn_rev);
    s_sq[threadIdx.x] = sq;
    __syncthreads();
    // Fixed-shape tree: the partial depends only on the data and the launch shape.
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) s_sq[threadIdx.x] += s_sq[threadIdx.x + s];
        __syncthreads();
    }
    u64* slot = arena + (u64)d.slot * SLOT_WORDS;
    if (threadIdx.x == 0) {
        partials[(u64)d.slot * MAX_PARTIALS + block] = s_sq[0];
        if (s_max) atomicMax(&slot[ST_MAX_BITS], (u64)s_max);
        if (s_min_rev) atomicMax(&slot[ST_MIN_BITS_REV], (u64)s_min_rev);
        if (block == 0) {
            slot[ST_BLOCKS] = nblocks;
            slot[ST_NUMEL] = d.n;
        }
    }
    if (threadIdx.x < N_COUNTERS && cnt[threadIdx.x])
        atomicAdd(&slot[threadIdx.x], (u64)cnt[threadIdx.x]);
    for (u32 k = threadIdx.x; k < HIST_BINS; k += blockDim.x) {
        u32 total = 0;
        for (int w = 0; w < WARPS; ++w) total += hist[w][k];
        if (total) atomicAdd(&slot[ST_HIST + k], (u64)total);
    }
}

// One large tensor over `gridDim.x` blocks (at most MAX_PARTIALS).
extern "C" __global__ void amp_stats(ProbeDesc d, u64* arena, double* partials) {
    stats_block(d, blockIdx.x, gridDim.x, arena, partials);
}

// Many small tensors in one launch: block k probes descs[k] alone.
extern "C" __global__ void amp_stats_batch(const ProbeDesc* descs, u32 count, u64* arena,
                                           double* partials) {
    if (blockIdx.x < count) stats_block(descs[blockIdx.x], 0, 1, arena, partials);
}

// Sums each slot's partials in block order into ST_SUM_SQ.
extern "C" __global__ void amp_stats_finish(u64* arena, const double* partials, u32 slots) {
    for (u32 s = blockIdx.x * blockDim.x + threadIdx.x; s < slots; s += gridDim.x * blockDim.x) {
        u64* slot = arena + (u64)s * SLOT_WORDS;
        double sum = 0.0;
        for (u64 k = 0; k < slot[ST_BLOCKS]; ++k) sum += partials[(u64)s * MAX_PARTIALS + k];
        slot[ST_SUM_SQ] = (u64)__double_as_longlong(sum);
    }
}
