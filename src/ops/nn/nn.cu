// Layer norm, embedding and dropout with the CPU emulator's order of operations: row
// statistics and column sums walk their elements sequentially in f64 (one thread per row
// or column; slow for long rows on a real GPU, but a parallel sum would change the f64
// rounding), everything else in f32, rounded once.

// Per row of d: mean and 1/√(var + eps) in f64 (sums from `init`, the identity of Rust's
// `Sum`), stored as f32.
extern "C" __global__ void amp_ln_stats(const void* x, int kind, u64 rows, u64 d, double eps,
                                        double init, float* mean, float* rstd) {
    for (u64 r = (u64)blockIdx.x * blockDim.x + threadIdx.x; r < rows;
         r += (u64)gridDim.x * blockDim.x) {
        double s = init;
        for (u64 j = 0; j < d; ++j) s += (double)load_f32(x, kind, r * d + j);
        double m = s / (double)d;
        double v = init;
        for (u64 j = 0; j < d; ++j) {
            double e = (double)load_f32(x, kind, r * d + j) - m;
            v += e * e;
        }
        v = v / (double)d;
        mean[r] = (float)m;
        rstd[r] = (float)(1.0 / sqrt(v + eps));
    }
}

// y = (x − mean)·rstd [·w] [+ b], in f32, rounded once. w and b may be null.
extern "C" __global__ void amp_ln_forward(const void* x, const void* w, const void* b, void* y,
                                          int kind, u64 n, u64 d, const float* mean,
                                          const float* rstd, u64* counts) {
    u32 over = 0, under = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        u64 r = i / d, j = i % d;
        float o = (load_f32(x, kind, i) - mean[r]) * rstd[r];
        if (w) o = o * load_f32(w, kind, j);
        if (b) o = o + load_f32(b, kind, j);
        store_round(y, kind, i, o, &over, &under);
    }
    block_add_counts(over, under, counts);
}

// Input gradient, one thread per row: rstd·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂)) with ĝ = g·w.
extern "C" __global__ void amp_ln_backward_x(const void* x, const void* w, const void* g,
                                             void* dx, int kind, u64 rows, u64 d,
                                             const float* mean, const float* rstd,
                                             u64* counts) {
    u32 over = 0, under = 0;
    for (u64 r = (u64)blockIdx.x * blockDim.x + threadIdx.x; r < rows;
         r += (u64)gridDim.x * blockDim.x) {
        float m = mean[r], s = rstd[r];
        double s1 = 0.0, s2 = 0.0;
        for (u64 j = 0; j < d; ++j) {
            float xh = (load_f32(x, kind, r * d + j) - m) * s;
            float gh = load_f32(g, kind, r * d + j);
            if (w) gh = gh * load_f32(w, kind, j);
            s1 += (double)gh;
            s2 += (double)(gh * xh);
        }
        float a = (float)(s1 / (double)d), c = (float)(s2 / (double)d);
        for (u64 j = 0; j < d; ++j) {
            float xh = (load_f32(x, kind, r * d + j) - m) * s;
            float gh = load_f32(g, kind, r * d + j);
            if (w) gh = gh * load_f32(w, kind, j);
            store_round(dx, kind, r * d + j, s * (gh - a - xh * c), &over, &under);
        }
    }
    block_add_counts(over, under, counts);
}

// Weight and bias gradients, one thread per column: Σ g·x̂ and Σ g over rows in f64 from
// 0.0, rounded once. gw or gb may be null.
extern "C" __global__ void amp_ln_backward_wb(const void* x, const void* g, void* gw, void* gb,
                                              int kind, u64 rows, u64 d, const float* mean,
                                              const float* rstd, u64* counts_w,
                                              u64* counts_b) {
    u32 ow = 0, uw = 0, ob = 0, ub = 0;
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < d;
         j += (u64)gridDim.x * blockDim.x) {
        double sw = 0.0, sb = 0.0;
        for (u64 r = 0; r < rows; ++r) {
            float gv = load_f32(g, kind, r * d + j);
            float xh = (load_f32(x, kind, r * d + j) - mean[r]) * rstd[r];
            sw += (double)(gv * xh);
            sb += (double)gv;
        }
        if (gw) store_round_f64(gw, kind, j, sw, &ow, &uw);
        if (gb) store_round_f64(gb, kind, j, sb, &ob, &ub);
    }
    block_add_counts(ow, uw, counts_w);
    block_add_counts(ob, ub, counts_b);
}

// Embedding rows: y[p, j] = w[ids[p], j]; an id outside 0..v gives a NaN row (the host
// path refuses it; a device path cannot without reading the ids back).
extern "C" __global__ void amp_embedding(const void* w, const long long* ids, void* y, int kind,
                                         u64 n, u64 d, u64 v) {
    u32 over = 0, under = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        long long id = ids[i / d];
        float o = (id >= 0 && (u64)id < v) ? load_f32(w, kind, (u64)id * d + i % d)
                                           : __int_as_float(0x7fc00000);
        store_round(y, kind, i, o, &over, &under);
    }
}

// Embedding weight gradient, one thread per column j: the rows of g added in position
// order into f64 accumulators acc (v × d, zeroed), so each sum has the CPU's order.
extern "C" __global__ void amp_embedding_backward(const void* g, const long long* ids,
                                                  double* acc, int kind, u64 n_ids, u64 d,
                                                  u64 v) {
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < d;
         j += (u64)gridDim.x * blockDim.x) {
        for (u64 p = 0; p < n_ids; ++p) {
            long long id = ids[p];
            if (id < 0 || (u64)id >= v) continue;
            acc[(u64)id * d + j] += (double)load_f32(g, kind, p * d + j);
        }
    }
}

// Rounds f64 accumulators once to the storage kind, counting.
extern "C" __global__ void amp_round_f64(const double* acc, void* y, int kind, u64 n,
                                         u64* counts) {
    u32 over = 0, under = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        store_round_f64(y, kind, i, acc[i], &over, &under);
    }
    block_add_counts(over, under, counts);
}

// Dropout: element i is kept when the (i+1)-th SplitMix64 draw after `state` (the
// stream's state after its derivation, as in the CPU's `Rng`), as a 53-bit uniform, is
// below `keep`; kept values are scaled, dropped ones multiplied by zero (NaN stays NaN).
extern "C" __global__ void amp_dropout(const void* x, void* y, int kind, u64 n, u64 state,
                                       double keep, double scale, u64* counts) {
    u32 over = 0, under = 0;
    float s = (float)scale;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        u64 z = state + (i + 1ull) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z = z ^ (z >> 31);
        double u = (double)(z >> 11) * (1.0 / 9007199254740992.0);
        float v = load_f32(x, kind, i);
        store_round(y, kind, i, u < keep ? v * s : v * 0.0f, &over, &under);
    }
    block_add_counts(over, under, counts);
}
