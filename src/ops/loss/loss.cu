// Losses with the CPU emulator's order of operations: per-row terms in f32 (one thread
// per row), their mean summed in f64 by one thread in row order (slow for many rows on a
// real GPU, but a parallel sum would change the f64 rounding).

__device__ __forceinline__ float loss_exp(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float loss_log(float x) { return (float)log((double)x); }

// log Σ exp over a row in f32, the sum in f64 (a NaN or an infinite max is returned as is).
__device__ float loss_lse(const void* x, int kind, u64 base, u64 c) {
    float m = __int_as_float(0xff800000);
    for (u64 j = 0; j < c; ++j) {
        float v = load_f32(x, kind, base + j);
        if (v > m || isnan(v)) m = v;
    }
    if (isnan(m) || isinf(m)) return m;
    double s = 0.0;
    for (u64 j = 0; j < c; ++j) s += (double)loss_exp(load_f32(x, kind, base + j) - m);
    return m + loss_log((float)s);
}

__device__ __forceinline__ int loss_ignored(long long y, long long ignore, int has_ignore) {
    return has_ignore && y == ignore;
}

// Per row: lse(row) − row[y] (ce = 1) or row[y] (ce = 0); NaN for a label outside 0..c.
extern "C" __global__ void amp_loss_terms(const void* x, int kind, const long long* t, u64 rows,
                                          u64 c, long long ignore, int has_ignore, int ce,
                                          float* terms) {
    for (u64 r = (u64)blockIdx.x * blockDim.x + threadIdx.x; r < rows;
         r += (u64)gridDim.x * blockDim.x) {
        long long y = t[r];
        if (loss_ignored(y, ignore, has_ignore)) {
            terms[r] = 0.0f;
            continue;
        }
        if (y < 0 || (u64)y >= c) {
            terms[r] = __int_as_float(0x7fc00000);
            continue;
        }
        float v = load_f32(x, kind, r * c + (u64)y);
        terms[r] = ce ? loss_lse(x, kind, r * c, c) - v : v;
    }
}

// The mean over non-ignored rows: Σ terms (negated for nll) in f64 from `init`, divided by
// the count of non-ignored labels (also stored in valid[0] for the backward).
extern "C" __global__ void amp_loss_mean(const float* terms, const long long* t, u64 rows,
                                         long long ignore, int has_ignore, int negate,
                                         double init, void* out, int kind, long long* valid,
                                         u64* counts) {
    u32 over = 0, under = 0;
    double* scratch = warp_scratch();
    // The first warp: the lanes load the rows, every lane adds them in row order.
    if (blockIdx.x == 0 && threadIdx.x < 32) {
        double total = init;
        long long k = 0;
        for (u64 c = 0; c < rows; c += 32) {
            u64 r = c + threadIdx.x;
            bool take = r < rows && !loss_ignored(t[r], ignore, has_ignore);
            double v = take ? (double)terms[r] : 0.0;
            total = warp_ordered_add_taken(total, negate ? -v : v, take,
                                           (u32)(rows - c < 32 ? rows - c : 32), scratch);
            k += __popc(__ballot_sync(0xffffffffu, take));
        }
        if (threadIdx.x == 0) {
            valid[0] = k;
            store_round_f64(out, kind, 0, total / (double)k, &over, &under);
        }
    }
    block_add_counts(over, under, counts);
}

// Cross-entropy gradient, one thread per row: (softmax − onehot)·g/valid, zero for
// ignored rows.
extern "C" __global__ void amp_ce_backward(const void* x, const long long* t, const void* g,
                                           const long long* valid, void* dx, int kind, u64 rows,
                                           u64 c, long long ignore, int has_ignore,
                                           u64* counts) {
    u32 over = 0, under = 0;
    float scale = load_f32(g, kind, 0) / (float)valid[0];
    for (u64 r = (u64)blockIdx.x * blockDim.x + threadIdx.x; r < rows;
         r += (u64)gridDim.x * blockDim.x) {
        long long y = t[r];
        if (loss_ignored(y, ignore, has_ignore)) {
            for (u64 j = 0; j < c; ++j) store_round(dx, kind, r * c + j, 0.0f, &over, &under);
            continue;
        }
        float l = loss_lse(x, kind, r * c, c);
        for (u64 j = 0; j < c; ++j) {
            float p = loss_exp(load_f32(x, kind, r * c + j) - l);
            float onehot = (long long)j == y ? 1.0f : 0.0f;
            store_round(dx, kind, r * c + j, (p - onehot) * scale, &over, &under);
        }
    }
    block_add_counts(over, under, counts);
}

// NLL gradient: −g/valid at each row's label, zero elsewhere.
extern "C" __global__ void amp_nll_backward(const long long* t, const void* g,
                                            const long long* valid, void* dx, int kind, u64 n,
                                            u64 c, long long ignore, int has_ignore,
                                            u64* counts) {
    u32 over = 0, under = 0;
    float v = -load_f32(g, kind, 0) / (float)valid[0];
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        long long y = t[i / c];
        int hit = !loss_ignored(y, ignore, has_ignore) && (long long)(i % c) == y;
        store_round(dx, kind, i, hit ? v : 0.0f, &over, &under);
    }
    block_add_counts(over, under, counts);
}

// Mean squared error: Σ (a − b)² in f64 from `init`, in element order, by one thread.
extern "C" __global__ void amp_mse(const void* a, const void* b, int kind, u64 n, double init,
                                   void* out, u64* counts) {
    u32 over = 0, under = 0;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        double s = init;
        for (u64 i = 0; i < n; ++i) {
            float d = load_f32(a, kind, i) - load_f32(b, kind, i);
            s += (double)(d * d);
        }
        store_round_f64(out, kind, 0, s / (double)n, &over, &under);
    }
    block_add_counts(over, under, counts);
}

// Mean squared error gradients: (a − b)·(2g/n) for a, its negation for b.
extern "C" __global__ void amp_mse_backward(const void* a, const void* b, const void* g,
                                            void* ga, void* gb, int kind, u64 n,
                                            u64* counts_a, u64* counts_b) {
    u32 oa = 0, ua = 0, ob = 0, ub = 0;
    float k = 2.0f * load_f32(g, kind, 0) / (float)n;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        float v = (load_f32(a, kind, i) - load_f32(b, kind, i)) * k;
        store_round(ga, kind, i, v, &oa, &ua);
        store_round(gb, kind, i, -v, &ob, &ub);
    }
    block_add_counts(oa, ua, counts_a);
    block_add_counts(ob, ub, counts_b);
}
