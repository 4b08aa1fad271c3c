// Unary maps with their derivatives, and broadcasting binary arithmetic.
// Each computes in f32 (transcendentals in f64, rounded once to f32, so they stay within
// one ulp of a correctly rounded result) and rounds once to the output kind.

#define MAX_DIMS 6

// Unary op codes (the order of amprobe's `Unary` enum).
#define U_NEG 0
#define U_RELU 1
#define U_GELU_ERF 2
#define U_GELU_TANH 3
#define U_SILU 4
#define U_TANH 5
#define U_SIGMOID 6
#define U_EXP 7
#define U_LOG 8
#define U_SQRT 9
#define U_RSQRT 10
#define U_POW 11
#define U_CLAMP 12
#define U_MUL_SCALAR 13
#define U_ADD_SCALAR 14

__device__ __forceinline__ float d_exp(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float d_tanh(float x) { return (float)tanh((double)x); }
__device__ __forceinline__ float d_erf(float x) { return (float)erf((double)x); }
__device__ __forceinline__ float d_log(float x) { return (float)log((double)x); }
__device__ __forceinline__ float d_pow(float x, float p) { return (float)pow((double)x, (double)p); }

// Scalars arrive as f64 and are rounded to f32 like the CPU emulator's `T::of`.
__device__ float unary_f(int op, float x, double p0, double p1, int has0, int has1) {
    const float half = 0.5f, one = 1.0f;
    switch (op) {
        case U_NEG: return -x;
        case U_RELU: return (x > 0.0f || isnan(x)) ? x : 0.0f;
        case U_GELU_ERF: return half * x * (one + d_erf(x * 0.70710678118654752440f));
        case U_GELU_TANH: {
            const float k = 0.79788456080286535588f;
            return half * x * (one + d_tanh(k * (x + 0.044715f * x * x * x)));
        }
        case U_SILU: return x / (one + d_exp(-x));
        case U_TANH: return d_tanh(x);
        case U_SIGMOID: return one / (one + d_exp(-x));
        case U_EXP: return d_exp(x);
        case U_LOG: return d_log(x);
        case U_SQRT: return sqrtf(x);
        case U_RSQRT: return one / sqrtf(x);
        case U_POW: {
            float p = (float)p0;
            if (p0 == 2.0) return x * x;
            if (p0 == 3.0) return x * x * x;
            if (p0 == 0.5) return sqrtf(x);
            if (p0 == 1.0) return x;
            return d_pow(x, p);
        }
        case U_CLAMP: {
            float y = x;
            if (has0) { float l = (float)p0; y = y < l ? l : y; }
            if (has1) { float h = (float)p1; y = y > h ? h : y; }
            return y;
        }
        case U_MUL_SCALAR: return x * (float)p0;
        case U_ADD_SCALAR: return x + (float)p0;
    }
    return __int_as_float(0x7fc00000);
}

__device__ float unary_df(int op, float x, float y, float g, double p0, double p1, int has0,
                          int has1) {
    const float half = 0.5f, one = 1.0f;
    switch (op) {
        case U_NEG: return -g;
        case U_RELU: return y > 0.0f ? g : 0.0f;
        case U_GELU_ERF: {
            float cdf = half * (one + d_erf(x * 0.70710678118654752440f));
            float pdf = d_exp(-half * x * x) * 0.39894228040143267794f;
            return g * (cdf + x * pdf);
        }
        case U_GELU_TANH: {
            const float k = 0.79788456080286535588f;
            const float c = 0.044715f;
            float inner = k * (x + c * x * x * x);
            float t = d_tanh(inner);
            float dinner = k * (one + 3.0f * c * x * x);
            return g * (half * (one + t) + half * x * (one - t * t) * dinner);
        }
        case U_SILU: {
            float s = one / (one + d_exp(-x));
            return g * s * (one + x * (one - s));
        }
        case U_TANH: return g * (one - y * y);
        case U_SIGMOID: return g * y * (one - y);
        case U_EXP: return g * y;
        case U_LOG: return g / x;
        case U_SQRT: return g / (2.0f * y);
        case U_RSQRT: return -0.5f * g * y * y * y;
        case U_POW: {
            if (p0 == 2.0) return g * (2.0f * x);
            if (p0 == 3.0) return g * (3.0f * (x * x));
            if (p0 == 1.0) return g;
            return g * ((float)p0 * d_pow(x, (float)(p0 - 1.0)));
        }
        case U_CLAMP: {
            int ok_lo = !has0 || x >= (float)p0;
            int ok_hi = !has1 || x <= (float)p1;
            return (ok_lo && ok_hi) ? g : 0.0f;
        }
        case U_MUL_SCALAR: return g * (float)p0;
        case U_ADD_SCALAR: return g;
    }
    return __int_as_float(0x7fc00000);
}

// `flag` (null: none) switches the scalar parameters: while it is set, q0 and q1 replace
// p0 and p1 (transformers' T5 clamp, whose bound depends on whether an inf was seen).
extern "C" __global__ void amp_unary(const void* x, void* y, int kind, u64 n, int op,
                                     double p0, double p1, int has0, int has1, const u32* flag,
                                     double q0, double q1, u64* counts, double* partials) {
    u32 over = 0, under = 0;
    OutStats st;
    out_begin(&st, counts, partials, kind);
    if (flag && flag[0]) { p0 = q0; p1 = q1; }
    grid_map<float>(
        n, [&](u64 i) { return unary_f(op, load_f32(x, kind, i), p0, p1, has0, has1); },
        [&](u64 i, float v) {
            store_round(y, kind, i, v, &over, &under);
            out_add(&st, y, kind, i);
        });
    block_add_counts(over, under, counts);
    out_end(&st, n);
}

extern "C" __global__ void amp_unary_backward(const void* x, const void* y, const void* g,
                                              void* dx, int kind, u64 n, int op, double p0,
                                              double p1, int has0, int has1, const u32* flag,
                                              double q0, double q1, u64* counts,
                                              double* partials) {
    u32 over = 0, under = 0;
    OutStats st;
    out_begin(&st, counts, partials, kind);
    if (flag && flag[0]) { p0 = q0; p1 = q1; }
    grid_map<float>(
        n,
        [&](u64 i) {
            return unary_df(op, load_f32(x, kind, i), load_f32(y, kind, i), load_f32(g, kind, i),
                            p0, p1, has0, has1);
        },
        [&](u64 i, float d) {
            store_round(dx, kind, i, d, &over, &under);
            out_add(&st, dx, kind, i);
        });
    block_add_counts(over, under, counts);
    out_end(&st, n);
}

// transformers' T5 fp16 clamp, decided on the device: `flag` is set when any value of x is
// infinite, and the clamp bound is then `on_inf`, else `clean` (torch.where on the device,
// no host read). Cleared by one thread, set by atomics, read by amp_unary and its backward
// as their switch.
extern "C" __global__ void amp_inf_flag_clear(u32* flag) {
    if (blockIdx.x == 0 && threadIdx.x == 0) flag[0] = 0;
}

extern "C" __global__ void amp_inf_flag(const void* x, int kind, u64 n, u32* flag) {
    u32 any = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        any |= isinf(load_f32(x, kind, i)) ? 1u : 0u;
    if (any) atomicOr(flag, 1u);
}

// Broadcast geometry: the output shape and each operand's strides over it (0 where the
// operand is broadcast), padded on the left to MAX_DIMS.
struct Geometry {
    u64 shape[MAX_DIMS];
    u64 sa[MAX_DIMS];
    u64 sb[MAX_DIMS];
};

#define B_ADD 0
#define B_SUB 1
#define B_MUL 2
#define B_DIV 3

__device__ __forceinline__ float binary_f(int op, float a, float b) {
    switch (op) {
        case B_ADD: return a + b;
        case B_SUB: return a - b;
        case B_MUL: return a * b;
        default: return a / b;
    }
}

extern "C" __global__ void amp_binary(const void* a, const void* b, void* y, int kind, u64 n,
                                      int op, Geometry geo, u64* counts, double* partials) {
    u32 over = 0, under = 0;
    OutStats st;
    out_begin(&st, counts, partials, kind);
    grid_map<float>(
        n,
        [&](u64 i) {
            u64 rest = i, ia = 0, ib = 0;
            for (int d = MAX_DIMS - 1; d >= 0 && rest; --d) {
                u64 c;
                rest = split_dim(rest, geo.shape[d], &c);
                ia += c * geo.sa[d];
                ib += c * geo.sb[d];
            }
            return binary_f(op, load_f32(a, kind, ia), load_f32(b, kind, ib));
        },
        [&](u64 i, float v) {
            store_round(y, kind, i, v, &over, &under);
            out_add(&st, y, kind, i);
        });
    block_add_counts(over, under, counts);
    out_end(&st, n);
}

// Gradient terms h(a, b, g) of the binary ops (the CPU emulator's closures).
#define H_G 0
#define H_NEG_G 1
#define H_G_MUL_B 2
#define H_G_DIV_B 3
#define H_G_MUL_A 4
#define H_DIV_RHS 5

__device__ __forceinline__ float grad_term(int h, float a, float b, float g) {
    switch (h) {
        case H_G: return g;
        case H_NEG_G: return -g;
        case H_G_MUL_B: return g * b;
        case H_G_DIV_B: return g / b;
        case H_G_MUL_A: return g * a;
        default: return -g * a / (b * b);
    }
}

// grad_term of the elements at ia, ib, ig, loading only the operands the term reads (an
// add's or a subtraction's gradient reads g alone).
__device__ __forceinline__ float grad_term_at(int h, const void* a, const void* b,
                                              const void* g, int kind, u64 ia, u64 ib,
                                              u64 ig) {
    float gv = load_f32(g, kind, ig);
    float av = (h == H_G_MUL_A || h == H_DIV_RHS) ? load_f32(a, kind, ia) : 0.0f;
    float bv = (h == H_G_MUL_B || h == H_G_DIV_B || h == H_DIV_RHS) ? load_f32(b, kind, ib) : 0.0f;
    return grad_term(h, av, bv, gv);
}

// Geometry of a gradient summed down to an operand's shape: the full (output) shape, the
// operands' broadcast strides and g's row-major strides over it, and which dims are summed.
struct GradGeometry {
    u64 shape[MAX_DIMS];
    u64 sa[MAX_DIMS];
    u64 sb[MAX_DIMS];
    u64 sg[MAX_DIMS];
    u32 reduced[MAX_DIMS];
};

// Adds to the offsets the coordinates of index `t` over the dims that are summed
// (`summed` = 1) or kept (0), the last dim fastest.
__device__ __forceinline__ void grad_coords(const GradGeometry& geo, u64 t, u32 summed, u64* ia,
                                            u64* ib, u64* ig) {
    for (int d = MAX_DIMS - 1; d >= 0 && t; --d) {
        if (geo.reduced[d] != summed || geo.shape[d] == 1) continue;
        u64 c;
        t = split_dim(t, geo.shape[d], &c);
        *ia += c * geo.sa[d];
        *ib += c * geo.sb[d];
        *ig += c * geo.sg[d];
    }
}

// One output element per thread: the f32 terms over the reduced dims, summed in f64 in
// row-major order (the CPU emulator's order, so the sum is bit-identical), rounded once.
extern "C" __global__ void amp_binary_grad(const void* a, const void* b, const void* g,
                                           void* out, int kind, u64 n_out, int h,
                                           GradGeometry geo, u64 n_reduced, double init,
                                           u64* counts, double* partials) {
    u32 over = 0, under = 0;
    OutStats st;
    out_begin(&st, counts, partials, kind);
    grid_map<double>(
        n_out,
        [&](u64 t) {
            u64 base_a = 0, base_b = 0, base_g = 0;
            grad_coords(geo, t, 0, &base_a, &base_b, &base_g);
            auto term = [&](u64 r) {
                u64 ia = base_a, ib = base_b, ig = base_g;
                grad_coords(geo, r, 1, &ia, &ib, &ig);
                return (double)grad_term_at(h, a, b, g, kind, ia, ib, ig);
            };
            // The CPU's sums: one term as it is (its zero's sign kept), more from `init`.
            return n_reduced == 1 ? term(0) : thread_ordered_sum(init, n_reduced, term);
        },
        [&](u64 t, double acc) {
            store_round_f64(out, kind, t, acc, &over, &under);
            out_add(&st, out, kind, t);
        });
    block_add_counts(over, under, counts);
    out_end(&st, n_out);
}

// The gradient where a, b, g and the output share one shape: one term per element.
extern "C" __global__ void amp_binary_grad_same(const void* a, const void* b, const void* g,
                                                void* out, int kind, u64 n, int h,
                                                u64* counts, double* partials) {
    u32 over = 0, under = 0;
    OutStats st;
    out_begin(&st, counts, partials, kind);
    grid_map<float>(
        n,
        [&](u64 t) {
            return grad_term_at(h, a, b, g, kind, t, t, t);
        },
        [&](u64 t, float v) {
            store_round_f64(out, kind, t, (double)v, &over, &under);
            out_add(&st, out, kind, t);
        });
    block_add_counts(over, under, counts);
    out_end(&st, n);
}

// amp_binary_grad for sums of at least 32 terms: a warp per output element, the terms
// computed by the lanes and added in the same row-major order (warp_ordered_add).
extern "C" __global__ void amp_binary_grad_warp(const void* a, const void* b, const void* g,
                                                void* out, int kind, u64 n_out, int h,
                                                GradGeometry geo, u64 n_reduced, double init,
                                                u64* counts) {
    u32 over = 0, under = 0;
    double* scratch = warp_scratch();
    u64 lane = threadIdx.x & 31u, warps = (u64)gridDim.x * (blockDim.x / 32);
    for (u64 t = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; t < n_out; t += warps) {
        u64 base_a = 0, base_b = 0, base_g = 0;
        grad_coords(geo, t, 0, &base_a, &base_b, &base_g);
        double acc = warp_ordered_sum(init, n_reduced, scratch, [&](u64 r) {
            u64 ia = base_a, ib = base_b, ig = base_g;
            grad_coords(geo, r, 1, &ia, &ib, &ig);
            return (double)grad_term_at(h, a, b, g, kind, ia, ib, ig);
        });
        if (lane == 0) store_round_f64(out, kind, t, acc, &over, &under);
    }
    block_add_counts(over, under, counts);
}
