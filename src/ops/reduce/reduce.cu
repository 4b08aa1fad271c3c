// Sums, means, max along a dim, softmax and log-softmax with the CPU emulator's order of
// operations: every sum accumulates in f64 in the CPU's sequential order (a tree reduction
// would change the f64 rounding). Short sums take a thread per output element; long ones
// and softmax lines a warp, whose lanes load and compute the terms in parallel and add
// them in order (warp_ordered_add); softmax over many lines a warp per 32 lines, each
// lane adding its own line's terms (line_group_fold).

#ifndef MAX_DIMS
#define MAX_DIMS 6
#endif

__device__ __forceinline__ float red_exp(float x) { return (float)exp((double)x); }

// A reduction's full (input) shape, the input's strides over it, and which dims are
// summed; output element t enumerates the kept dims in row-major order.
struct SumGeometry {
    u64 shape[MAX_DIMS];
    u64 sx[MAX_DIMS];
    u32 reduced[MAX_DIMS];
};

// `off` plus the offset of index `t` over the dims that are summed (`summed` = 1) or kept
// (0), the last dim fastest.
__device__ __forceinline__ u64 sum_offset(const SumGeometry& g, u64 t, u32 summed, u64 off) {
    for (int d = MAX_DIMS - 1; d >= 0 && t; --d) {
        if (g.reduced[d] != summed || g.shape[d] == 1) continue;
        u64 c;
        t = split_dim(t, g.shape[d], &c);
        off += c * g.sx[d];
    }
    return off;
}

// init: the f64 the CPU's accumulation starts from (0.0, or -0.0 where it sums through
// Rust's `Sum`, whose identity is -0.0, or copies without adding).
extern "C" __global__ void amp_sum(const void* x, void* y, int kind, u64 n_out,
                                   SumGeometry g, u64 n_reduced, double init, double div,
                                   int has_div, u64* counts, double* partials) {
    u32 over = 0, under = 0;
    OutStats st;
    out_begin(&st, counts, partials, kind);
    grid_map<double>(
        n_out,
        [&](u64 t) {
            u64 base = sum_offset(g, t, 0, 0);
            double acc = thread_ordered_sum(init, n_reduced, [&](u64 r) {
                return (double)load_f32(x, kind, sum_offset(g, r, 1, base));
            });
            return has_div ? acc / div : acc;
        },
        [&](u64 t, double acc) {
            store_round_f64(y, kind, t, acc, &over, &under);
            out_add(&st, y, kind, t);
        });
    block_add_counts(over, under, counts);
    out_end(&st, n_out);
}

// amp_sum for sums of at least 32 terms: a warp per output element, the lanes loading and
// every lane adding in the same row-major order (warp_ordered_add).
extern "C" __global__ void amp_sum_warp(const void* x, void* y, int kind, u64 n_out,
                                        SumGeometry g, u64 n_reduced, double init, double div,
                                        int has_div, u64* counts) {
    u32 over = 0, under = 0;
    double* scratch = warp_scratch();
    u64 lane = threadIdx.x & 31u, warps = (u64)gridDim.x * (blockDim.x / 32);
    for (u64 t = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; t < n_out; t += warps) {
        u64 base = sum_offset(g, t, 0, 0);
        double acc = warp_ordered_sum(init, n_reduced, scratch, [&](u64 r) {
            return (double)load_f32(x, kind, sum_offset(g, r, 1, base));
        });
        if (has_div) acc = acc / div;
        if (lane == 0) store_round_f64(y, kind, t, acc, &over, &under);
    }
    block_add_counts(over, under, counts);
}

// The gradient of a sum or mean: g (strides sg over the full shape, 0 where summed)
// broadcast back, divided by the count (in f32) for a mean.
struct ExpandGeometry {
    u64 shape[MAX_DIMS];
    u64 sg[MAX_DIMS];
};

extern "C" __global__ void amp_expand(const void* g, void* y, int kind, u64 n, ExpandGeometry geo,
                                      float div, int has_div, u64* counts, double* partials) {
    u32 over = 0, under = 0;
    OutStats st;
    out_begin(&st, counts, partials, kind);
    grid_map<float>(
        n,
        [&](u64 i) {
            u64 rest = i, j = 0;
            for (int d = MAX_DIMS - 1; d >= 0 && rest; --d) {
                u64 c;
                rest = split_dim(rest, geo.shape[d], &c);
                j += c * geo.sg[d];
            }
            float v = load_f32(g, kind, j);
            return has_div ? v / div : v;
        },
        [&](u64 i, float v) {
            store_round(y, kind, i, v, &over, &under);
            out_add(&st, y, kind, i);
        });
    block_add_counts(over, under, counts);
    out_end(&st, n);
}

// Line l of an (outer, n, inner) split starts at (l / inner) * n * inner + l % inner and
// steps by inner.
__device__ __forceinline__ u64 line_base(u64 l, u64 n, u64 inner) {
    u64 r, q = div_rem(l, inner, &r);
    return q * n * inner + r;
}

// The first maximal element of each line (a NaN is maximal), its value and flat offset.
extern "C" __global__ void amp_argmax(const void* x, void* y, long long* idx, int kind,
                                      u64 lines, u64 n, u64 inner) {
    u32 over = 0, under = 0;
    for (u64 l = (u64)blockIdx.x * blockDim.x + threadIdx.x; l < lines;
         l += (u64)gridDim.x * blockDim.x) {
        u64 base = line_base(l, n, inner), best = base;
        for (u64 i = 1; i < n; ++i) {
            float v = load_f32(x, kind, base + i * inner), b = load_f32(x, kind, best);
            if (isnan(b)) break;
            if (v > b || isnan(v)) best = base + i * inner;
        }
        idx[l] = (long long)best;
        store_round(y, kind, l, load_f32(x, kind, best), &over, &under);
    }
}

// The gradient of max: g at each line's maximal element, zero elsewhere.
extern "C" __global__ void amp_argmax_backward(const void* g, const long long* idx, void* dx,
                                               int kind, u64 total, u64 n, u64 inner) {
    u32 over = 0, under = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        u64 l = (i / (n * inner)) * inner + i % inner;
        float v = idx[l] == (long long)i ? load_f32(g, kind, l) : 0.0f;
        store_round(dx, kind, i, v, &over, &under);
    }
}

// A line's softmax outputs from its max m and its sum's f32 b (log-softmax: the log of its
// sum), the warp's lanes across the positions; each lane tallies what it writes.
__device__ __forceinline__ void softmax_write_line(const void* x, void* y, int kind, u64 base,
                                                   u64 n, u64 inner, int log_, float m,
                                                   float b, u32* over, u32* under,
                                                   OutStats* st) {
    for (u64 i = threadIdx.x & 31u; i < n; i += 32) {
        u64 k = base + i * inner;
        float v = load_f32(x, kind, k) - m;
        store_round(y, kind, k, log_ ? v - b : red_exp(v) / b, over, under);
        out_add(st, y, kind, k);
    }
}

// A line's softmax (log-softmax) gradient from its sum's f32 sf, the warp's lanes across
// the positions; each lane tallies what it writes.
__device__ __forceinline__ void softmax_backward_write_line(const void* y, const void* g,
                                                            void* dx, int kind, u64 base, u64 n,
                                                            u64 inner, int log_, float sf,
                                                            u32* over, u32* under,
                                                            OutStats* st) {
    for (u64 i = threadIdx.x & 31u; i < n; i += 32) {
        u64 k = base + i * inner;
        float gv = load_f32(g, kind, k), yv = load_f32(y, kind, k);
        float v = log_ ? gv - red_exp(yv) * sf : yv * (gv - sf);
        store_round(dx, kind, k, v, over, under);
        out_add(st, dx, kind, k);
    }
}

// Softmax (log = 0) or log-softmax (log = 1) along lines, a warp per line: the max in f32
// (NaNs never win, as on the CPU), exponentials in f32 (through f64), their sum in f64 in
// position order, one rounding per output.
// Gathering statistics (see OutStats), each lane tallies the outputs it writes.
extern "C" __global__ void amp_softmax(const void* x, void* y, int kind, u64 lines, u64 n,
                                       u64 inner, int log_, u64* counts, double* partials) {
    u32 over = 0, under = 0;
    OutStats st;
    out_begin(&st, counts, partials, kind);
    double* scratch = warp_scratch();
    u64 lane = threadIdx.x & 31u, warps = (u64)gridDim.x * (blockDim.x / 32);
    for (u64 l = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; l < lines; l += warps) {
        u64 base = line_base(l, n, inner);
        float m = __int_as_float(0xff800000);
        for (u64 i = lane; i < n; i += 32) {
            float v = load_f32(x, kind, base + i * inner);
            m = v > m ? v : m;
        }
        m = warp_max(m);
        double s = warp_ordered_sum(0.0, n, scratch, [&](u64 i) {
            return (double)red_exp(load_f32(x, kind, base + i * inner) - m);
        });
        float b = log_ ? (float)log(s) : (float)s;
        softmax_write_line(x, y, kind, base, n, inner, log_, m, b, &over, &under, &st);
    }
    block_add_counts(over, under, counts);
    out_end(&st, lines * n);
}

// Softmax backward y·(g − Σ g·y), log-softmax backward g − exp(y)·Σ g, a warp per line,
// line sums in f64 in position order from `init` (the identity of Rust's `Sum`, as on the
// CPU).
extern "C" __global__ void amp_softmax_backward(const void* y, const void* g, void* dx, int kind,
                                                u64 lines, u64 n, u64 inner, int log_,
                                                double init, u64* counts,
                                                double* partials) {
    u32 over = 0, under = 0;
    OutStats st;
    out_begin(&st, counts, partials, kind);
    double* scratch = warp_scratch();
    u64 warps = (u64)gridDim.x * (blockDim.x / 32);
    for (u64 l = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; l < lines; l += warps) {
        u64 base = line_base(l, n, inner);
        double s = warp_ordered_sum(init, n, scratch, [&](u64 i) {
            u64 k = base + i * inner;
            float gv = load_f32(g, kind, k);
            return log_ ? (double)gv : (double)(gv * load_f32(y, kind, k));
        });
        softmax_backward_write_line(y, g, dx, kind, base, n, inner, log_, (float)s, &over,
                                    &under, &st);
    }
    block_add_counts(over, under, counts);
    out_end(&st, lines * n);
}

// Calls body(rows) for each group of LINE_GROUP lines of an (outer, n, inner) split that
// the calling warp owns (rows of them: fewer in the last group), with grp->base holding
// where its lines start. Every lane of the warp calls it.
template <typename Body>
__device__ __forceinline__ void for_line_groups(LineGroup* grp, u64 lines, u64 n, u64 inner,
                                                Body body) {
    u32 lane = threadIdx.x & 31u;
    u64 step = (u64)gridDim.x * (blockDim.x / 32) * LINE_GROUP;
    for (u64 first = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32 * LINE_GROUP;
         first < lines; first += step) {
        u32 rows = lines - first < LINE_GROUP ? (u32)(lines - first) : LINE_GROUP;
        if (lane < rows) grp->base[lane] = line_base(first + lane, n, inner);
        __syncwarp();
        body(rows);
        // The next group's bases overwrite these only after every lane is done with them.
        __syncwarp();
    }
}

// amp_softmax on line groups (LINE_GROUP lines a warp, for many lines): the same values,
// with each line's max, sum and output rounding as there; lane r forms line r's max and
// sum, the lanes write each line's outputs together.
extern "C" __global__ void amp_softmax_grouped(const void* x, void* y, int kind, u64 lines,
                                               u64 n, u64 inner, int log_, u64* counts,
                                               double* partials) {
    u32 over = 0, under = 0;
    OutStats st;
    out_begin(&st, counts, partials, kind);
    LineGroup* grp = line_group();
    u32 lane = threadIdx.x & 31u;
    for_line_groups(grp, lines, n, inner, [&](u32 rows) {
        float m = line_group_fold(
            grp, rows, n, __int_as_float(0xff800000),
            [&](u32 r, u64 i) { return load_f32(x, kind, grp->base[r] + i * inner); },
            [](float m, float v) { return v > m ? v : m; });
        if (lane < rows) grp->a[lane] = m;
        __syncwarp();
        double s = line_group_fold(
            grp, rows, n, 0.0,
            [&](u32 r, u64 i) {
                return red_exp(load_f32(x, kind, grp->base[r] + i * inner) - grp->a[r]);
            },
            [](double s, float t) { return s + (double)t; });
        if (lane < rows) grp->b[lane] = log_ ? (float)log(s) : (float)s;
        __syncwarp();
        for (u32 r = 0; r < rows; ++r)
            softmax_write_line(x, y, kind, grp->base[r], n, inner, log_, grp->a[r], grp->b[r],
                               &over, &under, &st);
    });
    block_add_counts(over, under, counts);
    out_end(&st, lines * n);
}

// amp_softmax_backward on line groups (see amp_softmax_grouped).
extern "C" __global__ void amp_softmax_backward_grouped(const void* y, const void* g, void* dx,
                                                        int kind, u64 lines, u64 n, u64 inner,
                                                        int log_, double init, u64* counts,
                                                        double* partials) {
    u32 over = 0, under = 0;
    OutStats st;
    out_begin(&st, counts, partials, kind);
    LineGroup* grp = line_group();
    u32 lane = threadIdx.x & 31u;
    for_line_groups(grp, lines, n, inner, [&](u32 rows) {
        double s = line_group_fold(
            grp, rows, n, init,
            [&](u32 r, u64 i) {
                u64 k = grp->base[r] + i * inner;
                float gv = load_f32(g, kind, k);
                return log_ ? gv : gv * load_f32(y, kind, k);
            },
            [](double s, float t) { return s + (double)t; });
        if (lane < rows) grp->a[lane] = (float)s;
        __syncwarp();
        for (u32 r = 0; r < rows; ++r)
            softmax_backward_write_line(y, g, dx, kind, grp->base[r], n, inner, log_, grp->a[r],
                                        &over, &under, &st);
    });
    block_add_counts(over, under, counts);
    out_end(&st, lines * n);
}
