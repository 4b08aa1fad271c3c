// torch.where and masked_fill: values are picked (as raw element bits for where), so
// nothing rounds but the gradients of where, which are summed in f64 in the CPU's order.

#ifndef MAX_DIMS
#define MAX_DIMS 6
#endif

#define SEL_KIND_I64 3

// Truth of element i of a condition or mask (f32/f16/bf16 or int64): nonzero, NaN true.
__device__ __forceinline__ int sel_truth(const void* c, int kind, u64 i) {
    if (kind == SEL_KIND_I64) return ((const long long*)c)[i] != 0;
    return load_f32(c, kind, i) != 0.0f;
}

// The output shape and the strides over it of the condition and both branches.
struct WhereGeometry {
    u64 shape[MAX_DIMS];
    u64 sc[MAX_DIMS];
    u64 sa[MAX_DIMS];
    u64 sb[MAX_DIMS];
};

extern "C" __global__ void amp_where(const void* c, int ckind, const void* a, const void* b,
                                     void* y, int bytes, u64 n, WhereGeometry g) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        u64 rest = i, ic = 0, ia = 0, ib = 0;
        for (int d = MAX_DIMS - 1; d >= 0; --d) {
            u64 k;
            rest = split_dim(rest, g.shape[d], &k);
            ic += k * g.sc[d];
            ia += k * g.sa[d];
            ib += k * g.sb[d];
        }
        int t = sel_truth(c, ckind, ic);
        if (bytes == 2) {
            ((u16*)y)[i] = t ? ((const u16*)a)[ia] : ((const u16*)b)[ib];
        } else if (bytes == 4) {
            ((u32*)y)[i] = t ? ((const u32*)a)[ia] : ((const u32*)b)[ib];
        } else {
            ((u64*)y)[i] = t ? ((const u64*)a)[ia] : ((const u64*)b)[ib];
        }
    }
}

// The output shape, the condition's broadcast strides and g's strides over it, and the
// dims summed down to the branch's shape.
struct WhereGradGeometry {
    u64 shape[MAX_DIMS];
    u64 sc[MAX_DIMS];
    u64 sg[MAX_DIMS];
    u32 reduced[MAX_DIMS];
};

// One branch's gradient: g where the condition equals `branch`, summed from `init` in
// f64 in row-major order over the reduced dims, rounded once.
extern "C" __global__ void amp_where_grad(const void* c, int ckind, const void* g, void* out,
                                          int kind, u64 n_out, int branch, WhereGradGeometry geo,
                                          u64 n_reduced, double init, u64* counts) {
    u32 over = 0, under = 0;
    for (u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x; t < n_out;
         t += (u64)gridDim.x * blockDim.x) {
        u64 bc = 0, bg = 0, rest = t;
        for (int d = MAX_DIMS - 1; d >= 0; --d) {
            if (geo.reduced[d]) continue;
            u64 k;
            rest = split_dim(rest, geo.shape[d], &k);
            bc += k * geo.sc[d];
            bg += k * geo.sg[d];
        }
        double acc = init;
        for (u64 r = 0; r < n_reduced; ++r) {
            u64 ic = bc, ig = bg, rr = r;
            for (int d = MAX_DIMS - 1; d >= 0; --d) {
                if (!geo.reduced[d]) continue;
                u64 k;
                rr = split_dim(rr, geo.shape[d], &k);
                ic += k * geo.sc[d];
                ig += k * geo.sg[d];
            }
            float v = (sel_truth(c, ckind, ic) != 0) == (branch != 0) ? load_f32(g, kind, ig)
                                                                      : 0.0f;
            acc += (double)v;
        }
        store_round_f64(out, kind, t, acc, &over, &under);
    }
    block_add_counts(over, under, counts);
}

// The input shape and the mask's broadcast strides over it.
struct MaskGeometry {
    u64 shape[MAX_DIMS];
    u64 sm[MAX_DIMS];
};

__device__ __forceinline__ u64 sel_mask_index(const MaskGeometry& g, u64 i) {
    u64 rest = i, im = 0;
    for (int d = MAX_DIMS - 1; d >= 0; --d) {
        u64 k;
        rest = split_dim(rest, g.shape[d], &k);
        im += k * g.sm[d];
    }
    return im;
}

// x with v (exact in the dtype) where the mask is true. The fill value was rounded on the
// host: `fill_underflowed` says it underflowed there, and each masked element counts one
// underflow (as the CPU counts). Masked elements filled with -inf are counted into
// neg_inf[0] (the slot's masked -inf word) when neg_inf is not null.
extern "C" __global__ void amp_masked_fill(const void* x, const void* m, int mkind, void* y,
                                           int kind, u64 n, MaskGeometry g, float v,
                                           int fill_underflowed, u64* counts, u64* neg_inf) {
    u32 over = 0, under = 0, ninf = 0;
    int fill_neg_inf = __float_as_uint(v) == 0xff800000u;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        int masked = sel_truth(m, mkind, sel_mask_index(g, i));
        float o = masked ? v : load_f32(x, kind, i);
        store_round(y, kind, i, o, &over, &under);
        under += (masked && fill_underflowed) ? 1u : 0u;
        ninf += (masked && fill_neg_inf) ? 1u : 0u;
    }
    block_add_counts(over, under, counts);
    block_add_counts(ninf, 0, neg_inf);
}
