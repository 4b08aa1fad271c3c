// Probe statistics of one tensor per slot of a device-side arena, in one pass: the
// arena's own pass over a tensor that no kernel gathered statistics for while writing it.
// The per-element steps and the slot layout (ST_*) are in common.cuh.

// A tensor to probe: data, length, storage kind, the dtype's smallest normal (bit
// pattern; 0 = nothing counts as subnormal), its arena slot, and whether only its
// non-finite values are counted (the check-only mode, common.cuh).
struct ProbeDesc {
    const void* data;
    u64 n;
    u32 kind;
    u32 sub_limit;
    u32 slot;
    u32 check;
};

// The pass over one tensor by one block, covering elements block, block + nblocks, ...
// (in units of STATS_THREADS).
__device__ void stats_block(const ProbeDesc d, u32 block, u32 nblocks, u64* arena,
                            double* partials) {
    StatsAcc a;
    if (d.check) {
        check_begin(&a, stats_shared());
        for (u64 i = (u64)block * blockDim.x + threadIdx.x; i < d.n;
             i += (u64)nblocks * blockDim.x)
            check_add(&a, widened_bits(d.data, d.kind, i));
        check_end(&a, arena + (u64)d.slot * SLOT_WORDS, block, d.n);
        return;
    }
    stats_begin(&a, d.sub_limit, stats_shared());
    for (u64 i = (u64)block * blockDim.x + threadIdx.x; i < d.n;
         i += (u64)nblocks * blockDim.x)
        stats_add(&a, widened_bits(d.data, d.kind, i));
    stats_end(&a, arena + (u64)d.slot * SLOT_WORDS, partials + (u64)d.slot * MAX_PARTIALS,
              block, nblocks, d.n);
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
