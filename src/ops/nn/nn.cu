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
        u64 j, r = div_rem(i, d, &j);
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

// ---- Embedding weight gradient. The CPU adds the rows of g into each id's row in position
// order; here the positions are first sorted by id, stably (a counting sort in chunks of
// 256 positions, integer work with one answer), then one thread per (id, column) adds its
// id's rows in that order in f64 and rounds once. Ids outside [0, v) add nothing.

// Per chunk (a block of 256 positions): each position's rank among the chunk's earlier
// positions of its id, and at the id's last position in the chunk, the id's count in the
// chunk (counts: chunks × v, zeroed).
extern "C" __global__ void amp_embedding_rank(const long long* ids, long long* rank,
                                              long long* counts, u64 n_ids, u64 v) {
    __shared__ long long tile[256];
    u64 p = (u64)blockIdx.x * 256 + threadIdx.x;
    long long id = p < n_ids ? ids[p] : -1;
    tile[threadIdx.x] = id;
    __syncthreads();
    if (p >= n_ids || id < 0 || (u64)id >= v) return;
    u64 m = n_ids - (u64)blockIdx.x * 256;
    if (m > 256) m = 256;
    long long r = 0;
    bool last = true;
    for (u64 k = 0; k < m; ++k) {
        if (tile[k] != id) continue;
        if (k < threadIdx.x) ++r;
        else if (k > threadIdx.x) last = false;
    }
    rank[p] = r;
    if (last) counts[(u64)blockIdx.x * v + (u64)id] = r + 1;
}

// Per id: the counts of the chunks before each chunk (in place), and the id's total.
extern "C" __global__ void amp_embedding_chunk_scan(long long* counts, long long* total,
                                                    u64 chunks, u64 v) {
    for (u64 id = (u64)blockIdx.x * blockDim.x + threadIdx.x; id < v;
         id += (u64)gridDim.x * blockDim.x) {
        long long run = 0;
        for (u64 c = 0; c < chunks; ++c) {
            long long t = counts[c * v + id];
            counts[c * v + id] = run;
            run += t;
        }
        total[id] = run;
    }
}

// Where each id's positions start in the sorted list: the exclusive prefix sum of the
// totals, by one block (each thread a contiguous run of ids).
extern "C" __global__ void amp_embedding_offsets(const long long* total, long long* offset,
                                                 u64 v) {
    __shared__ long long part[256];
    u64 per = (v + blockDim.x - 1) / blockDim.x;
    u64 lo = threadIdx.x * per, hi = lo + per < v ? lo + per : v;
    long long s = 0;
    for (u64 i = lo; i < hi; ++i) s += total[i];
    part[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        long long run = 0;
        for (u32 t = 0; t < blockDim.x; ++t) {
            long long x = part[t];
            part[t] = run;
            run += x;
        }
    }
    __syncthreads();
    long long run = part[threadIdx.x];
    for (u64 i = lo; i < hi; ++i) {
        offset[i] = run;
        run += total[i];
    }
}

// Every valid position at its place in the id-sorted list.
extern "C" __global__ void amp_embedding_scatter(const long long* ids, const long long* rank,
                                                 const long long* counts,
                                                 const long long* offset, long long* sorted,
                                                 u64 n_ids, u64 v) {
    for (u64 p = (u64)blockIdx.x * blockDim.x + threadIdx.x; p < n_ids;
         p += (u64)gridDim.x * blockDim.x) {
        long long id = ids[p];
        if (id < 0 || (u64)id >= v) continue;
        sorted[offset[id] + counts[(p / 256) * v + (u64)id] + rank[p]] = (long long)p;
    }
}

// One thread per (id, column j): the id's rows of g in position order, added in f64 from 0
// and rounded once into y (v × d), counting; the row of `pad` (padding_idx, -1: none)
// adds nothing.
extern "C" __global__ void amp_embedding_backward(const void* g, const long long* sorted,
                                                  const long long* total,
                                                  const long long* offset, void* y, int kind,
                                                  u64 d, u64 v, long long pad, u64* counts) {
    u32 over = 0, under = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < v * d;
         i += (u64)gridDim.x * blockDim.x) {
        u64 j, id = div_rem(i, d, &j);
        long long k = offset[id], end = (long long)id == pad ? k : k + total[id];
        double s = 0.0;
        // Loads a group ahead of the adds, which stay in order.
        for (; k + 8 <= end; k += 8) {
            float t[8];
            for (int u = 0; u < 8; ++u) t[u] = load_f32(g, kind, (u64)sorted[k + u] * d + j);
            for (int u = 0; u < 8; ++u) s += (double)t[u];
        }
        for (; k < end; ++k) s += (double)load_f32(g, kind, (u64)sorted[k] * d + j);
        store_round_f64(y, kind, i, s, &over, &under);
    }
    block_add_counts(over, under, counts);
}

// amp_embedding_backward for ids with long runs of positions (a relative-position bucket
// repeated over a whole attention map): a warp per (id, column), the lanes loading the
// rows and every lane adding them in position order (warp_ordered_add).
extern "C" __global__ void amp_embedding_backward_warp(const void* g, const long long* sorted,
                                                       const long long* total,
                                                       const long long* offset, void* y,
                                                       int kind, u64 d, u64 v, long long pad,
                                                       u64* counts) {
    u32 over = 0, under = 0;
    double* scratch = warp_scratch();
    u64 lane = threadIdx.x & 31u, warps = (u64)gridDim.x * (blockDim.x / 32);
    for (u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; i < v * d; i += warps) {
        u64 j, id = div_rem(i, d, &j);
        long long start = offset[id], cnt = (long long)id == pad ? 0 : total[id];
        double s = warp_ordered_sum(0.0, (u64)cnt, scratch, [&](u64 k) {
            return (double)load_f32(g, kind, (u64)sorted[start + (long long)k] * d + j);
        });
        if (lane == 0) store_round_f64(y, kind, i, s, &over, &under);
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
