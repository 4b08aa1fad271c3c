// The optimizer phase of an AMP step on the device: unscale with the inf check
// (ATen's _amp_foreach_non_finite_check_and_unscale_), gradient-norm clipping, the SGD and
// Adam/AdamW updates, the loss-scale update (ATen's _amp_update_scale_ and the Megatron-style
// hysteresis variant) and the step's scalars copied into the probe arena for the one read.
//
// Every formula is the CPU emulator's (src/optim, src/amp/scaler.rs), operation by operation:
// where the CPU writes `a.mul_add(b, c)` (PyTorch's CPU optimizers fuse there) the kernel
// calls fmaf, and nowhere else; `--fmad=false` keeps the compiler from contracting the rest.
// Sums that decide bits (the norms) run sequentially in f64 in the CPU's order, so the
// device's results are the emulator's bit for bit; on a real GPU those few one-thread
// kernels are the slow spots of the phase.

// The scaler's state on the device, in u32 words (AMP_* indices).
#define AMP_FOUND_INF 0   // nonzero once a gradient held inf/NaN this step
#define AMP_GROWTH 1      // growth tracker (i32)
#define AMP_HYST 2        // hysteresis tracker (i32)
#define AMP_ERROR 3       // 1: overflow at the floor with error_at_floor
#define AMP_UNSCALE_OVER 4
#define AMP_UNSCALE_UNDER 5
#define AMP_TOTAL_NORM 6  // f32 bits
#define AMP_CLIP_COEF 7   // f32 bits
#define AMP_STATE_WORDS 8

// Scaler kinds (amprobe's ScalerKind).
#define SK_DEFAULT 0
#define SK_MAXCLIP 1
#define SK_HYSTERESIS 2
#define SK_FIXED 3

__device__ __forceinline__ float round_kind(int kind, float x) {
    if (kind == KIND_F16) return f16_bits_to_f32(f32_to_f16_bits(x));
    if (kind == KIND_BF16) return bf16_bits_to_f32(f32_to_bf16_bits(x));
    return x;
}

__device__ __forceinline__ bool first_thread() {
    return blockIdx.x == 0 && threadIdx.x == 0;
}

// A launch over many tensors: descriptor k owns blocks first_block .. first_block +
// nblocks. The descriptor whose blocks hold this block (descriptors in block order).
template <typename D>
__device__ __forceinline__ const D* desc_of_block(const D* d, u32 count) {
    u32 lo = 0, hi = count;
    while (hi - lo > 1) {
        u32 mid = (lo + hi) / 2;
        if (d[mid].first_block <= blockIdx.x) lo = mid; else hi = mid;
    }
    return &d[lo];
}

// One gradient of a launch over all of a step's gradients.
struct GradDesc {
    void* g;
    u64 n;
    int kind;
    u32 first_block;
    u32 nblocks;
    u32 pad;
};

// g = round(g * (1/scale)) in place, the reciprocal in f64 rounded to f32 as PyTorch's
// `scale.double().reciprocal().float()`; any inf/NaN element sets found_inf. Over- and
// underflow are counted for finite elements only, as the scaler reports them.
// Every gradient of the step in one launch (GradDesc).
extern "C" __global__ void amp_unscale_multi(const GradDesc* descs, u32 count,
                                             const float* scale, u32* state) {
    const GradDesc* d = desc_of_block(descs, count);
    void* g = d->g;
    int kind = d->kind;
    u64 n = d->n;
    u32 block = blockIdx.x - d->first_block;
    float inv = (float)(1.0 / (double)scale[0]);
    u32 found = 0, over = 0, under = 0;
    for (u64 i = (u64)block * blockDim.x + threadIdx.x; i < n;
         i += (u64)d->nblocks * blockDim.x) {
        float x = load_f32(g, kind, i);
        bool finite = isfinite(x);
        found |= finite ? 0u : 1u;
        float y = round_kind(kind, x * inv);
        if (kind == KIND_F32) ((float*)g)[i] = y;
        else ((u16*)g)[i] = kind == KIND_F16 ? f32_to_f16_bits(y) : f32_to_bf16_bits(y);
        if (finite) {
            over += isinf(y) ? 1u : 0u;
            under += (x != 0.0f && y == 0.0f) ? 1u : 0u;
        }
    }
    if (found) atomicOr(&state[AMP_FOUND_INF], 1u);
    if (over) atomicAdd(&state[AMP_UNSCALE_OVER], over);
    if (under) atomicAdd(&state[AMP_UNSCALE_UNDER], under);
}

// A norm as clip.rs computes it: L2 with squares summed in f64 (inf when the sum leaves
// the f32 range), or the largest |x| with NaN propagating. One thread, in element order.
__device__ float seq_norm(const void* p, int kind, u64 n, int inf_norm) {
    if (inf_norm) {
        float m = 0.0f;
        for (u64 i = 0; i < n; ++i) {
            float x = load_f32(p, kind, i);
            if (isnan(x)) return __int_as_float(0x7fc00000);
            m = fmaxf(m, fabsf(x));
        }
        return m;
    }
    double s = 0.0;
    for (u64 i = 0; i < n; ++i) {
        double x = (double)load_f32(p, kind, i);
        s = s + x * x;
    }
    return isinf((float)s) ? __int_as_float(0x7f800000) : (float)sqrt(s);
}

// The norm of each gradient, rounded to the gradient's dtype, into out[k]: one thread
// per gradient.
extern "C" __global__ void amp_grad_norm_multi(const GradDesc* descs, u32 count, int inf_norm,
                                               float* out) {
    for (u32 k = blockIdx.x * blockDim.x + threadIdx.x; k < count;
         k += gridDim.x * blockDim.x) {
        const GradDesc* d = &descs[k];
        out[k] = round_kind(d->kind, seq_norm(d->g, d->kind, d->n, inf_norm));
    }
}

// The total norm of `count` per-gradient norms, in `norm_kind` (the promoted dtype), and
// the clip coefficient min((total + 1e-6)^-1 * max_norm, 1), each op rounded to norm_kind.
extern "C" __global__ void amp_clip_coef(const float* norms, u64 count, int norm_kind,
                                         int inf_norm, float max_norm, u32* state) {
    if (!first_thread()) return;
    float total = round_kind(norm_kind, seq_norm(norms, KIND_F32, count, inf_norm));
    float shifted = round_kind(norm_kind, total + 1e-6f);
    float recip = round_kind(norm_kind, 1.0f / shifted);
    float coef = round_kind(norm_kind, recip * max_norm);
    float clamped = coef > 1.0f ? 1.0f : coef;
    state[AMP_TOTAL_NORM] = __float_as_uint(total);
    state[AMP_CLIP_COEF] = __float_as_uint(clamped);
}

// g = round(g * coef) in place (every gradient, even when coef is 1, as PyTorch does).
extern "C" __global__ void amp_clip_apply_multi(const GradDesc* descs, u32 count,
                                                const u32* state) {
    const GradDesc* d = desc_of_block(descs, count);
    void* g = d->g;
    int kind = d->kind;
    u64 n = d->n;
    u32 block = blockIdx.x - d->first_block;
    float coef = __uint_as_float(state[AMP_CLIP_COEF]);
    for (u64 i = (u64)block * blockDim.x + threadIdx.x; i < n;
         i += (u64)d->nblocks * blockDim.x) {
        float y = round_kind(kind, load_f32(g, kind, i) * coef);
        if (kind == KIND_F32) ((float*)g)[i] = y;
        else ((u16*)g)[i] = kind == KIND_F16 ? f32_to_f16_bits(y) : f32_to_bf16_bits(y);
    }
}

// SGD hyper-parameters, rounded on the host exactly as sgd.rs rounds them.
struct SgdArgs {
    float neg_lr;
    float wd;
    float momentum_alpha;
    float momentum;
    float one_minus_damp;
    int od;          // the kind each intermediate op rounds to
    int use_wd;
    int use_momentum;
    int first;       // the momentum buffer is fresh: it takes the gradient
    int nesterov;
    int maximize;
    int pad;
};

// Where an update leaves its parameter's record (params.rs `ParamRecord::from_stats`):
// the statistics of the gradient as the update reads it and of the parameter as it writes
// it, each in an arena slot with its partial sums, and the gradient's values that the
// step's loss scale flushes to zero in fp16, counted into the gradient slot's
// SCALED_FLUSHES word. The update then runs on the statistics pass's launch shape, so
// that it is the only pass over either tensor.
#define SCALED_FLUSHES 293
struct RecordArgs {
    u64* g_slot;
    double* g_partials;
    u64* p_slot;
    double* p_partials;
    float scale;
    u32 pad;
};

struct RecordAcc {
    StatsAcc g, p;
    u32 flushes;
};

__device__ __forceinline__ void record_begin(RecordAcc* r, int kind) {
    stats_begin(&r->g, kind_sub_limit(kind), stats_shared());
    stats_begin(&r->p, kind_sub_limit(kind), stats_shared_second());
    r->flushes = 0;
}

// Finite nonzero g whose g * scale (f32) is at most 2^-25, i.e. zero in fp16 (params.rs
// `scaled_f16_flushes`).
__device__ __forceinline__ void record_add(RecordAcc* r, const RecordArgs& a, const void* g,
                                           const void* p_out, int kind, u64 j) {
    u32 gb = widened_bits(g, kind, j);
    stats_add(&r->g, gb);
    u32 ga = gb & 0x7fffffffu;
    u32 s = __float_as_uint(__uint_as_float(gb) * a.scale) & 0x7fffffffu;
    r->flushes += (ga != 0 && ga < 0x7f800000u && s <= 0x33000000u) ? 1u : 0u;
    stats_add(&r->p, widened_bits(p_out, kind, j));
}

__device__ void record_end(RecordAcc* r, const RecordArgs& a, u64 n, u32 block, u32 nblocks) {
    stats_end(&r->g, a.g_slot, a.g_partials, block, nblocks, n);
    stats_end(&r->p, a.p_slot, a.p_partials, block, nblocks, n);
    if (r->flushes) atomicAdd(&a.g_slot[SCALED_FLUSHES], (u64)r->flushes);
}

// One SGD update of one parameter (sgd.rs) by block `block` of `nblocks`: reads p, writes
// p_out (skipped steps copy p), and gathers the parameter's record.
__device__ void sgd_blocks(const void* p, void* p_out, const void* g, int kind, float* buf,
                           u64 n, const SgdArgs& a, bool skip, const RecordArgs& rec,
                           u32 block, u32 nblocks) {
    RecordAcc r;
    record_begin(&r, kind);
    for (u64 j = (u64)block * blockDim.x + threadIdx.x; j < n;
         j += (u64)nblocks * blockDim.x) {
        float pv = load_f32(p, kind, j);
        if (!skip) {
            float g0 = load_f32(g, kind, j);
            float gv = a.maximize ? -g0 : g0;
            if (a.use_wd) gv = round_kind(a.od, fmaf(pv, a.wd, gv));
            if (a.use_momentum) {
                float b = a.first ? gv
                                  : round_kind(a.od, fmaf(gv, a.one_minus_damp,
                                                          round_kind(a.od, buf[j] * a.momentum)));
                buf[j] = b;
                gv = a.nesterov ? round_kind(a.od, fmaf(b, a.momentum_alpha, gv)) : b;
            }
            pv = fmaf(gv, a.neg_lr, pv);
        }
        u32 o = 0, u = 0;
        store_round(p_out, kind, j, pv, &o, &u);
        record_add(&r, rec, g, p_out, kind, j);
    }
    record_end(&r, rec, n, block, nblocks);
}

// Adam/AdamW hyper-parameters of this step, computed on the host as adam.rs does.
struct AdamArgs {
    float decay_factor;
    float lerp_weight;
    float beta2;
    float one_minus_beta2;
    float eps;
    float wd;
    float bc2_sqrt;
    float neg_step_size;
    int od;
    int use_wd;
    int decoupled;
    int amsgrad;
    int maximize;
    int pad;
};

__device__ __forceinline__ float amp_lerp(float start, float end, float weight) {
    float diff = end - start;
    return fabsf(weight) < 0.5f ? fmaf(weight, diff, start) : fmaf(weight - 1.0f, diff, end);
}

__device__ __forceinline__ float amp_maximum(float a, float b) {
    if (isnan(a) || isnan(b)) return __int_as_float(0x7fc00000);
    return a >= b ? a : b;
}

// One Adam/AdamW update of one parameter (adam.rs) by block `block` of `nblocks`: reads p,
// writes p_out; the state buffers are updated in place (not at all on a skipped step).
// Gathers the parameter's record.
__device__ void adam_blocks(const void* p, void* p_out, const void* g, int kind,
                            float* exp_avg, float* exp_avg_sq, float* max_sq, u64 n,
                            const AdamArgs& a, bool skip, const RecordArgs& rec, u32 block,
                            u32 nblocks) {
    RecordAcc r;
    record_begin(&r, kind);
    for (u64 j = (u64)block * blockDim.x + threadIdx.x; j < n;
         j += (u64)nblocks * blockDim.x) {
        float pv = load_f32(p, kind, j);
        if (!skip) {
            float g0 = load_f32(g, kind, j);
            float gv = a.maximize ? -g0 : g0;
            if (a.use_wd) {
                if (a.decoupled) pv = round_kind(a.od, pv * a.decay_factor);
                else gv = round_kind(a.od, fmaf(pv, a.wd, gv));
            }
            float m = round_kind(a.od, amp_lerp(exp_avg[j], gv, a.lerp_weight));
            exp_avg[j] = m;
            float v = round_kind(a.od, fmaf(a.one_minus_beta2 * gv, gv,
                                            round_kind(a.od, exp_avg_sq[j] * a.beta2)));
            exp_avg_sq[j] = v;
            float second = v;
            if (a.amsgrad) {
                max_sq[j] = amp_maximum(max_sq[j], v);
                second = max_sq[j];
            }
            float denom = round_kind(a.od, round_kind(a.od, round_kind(a.od, sqrtf(second)) /
                                                                a.bc2_sqrt) + a.eps);
            pv = pv + (a.neg_step_size * m) / denom;
        }
        u32 o = 0, u = 0;
        store_round(p_out, kind, j, pv, &o, &u);
        record_add(&r, rec, g, p_out, kind, j);
    }
    record_end(&r, rec, n, block, nblocks);
}

// Every parameter's update in one launch: parameter k gets blocks first_block ..
// first_block + nblocks (the statistics pass's shape for its length), so each runs as a
// launch of its own would, bit for bit. `a`, `b`, `c` are SGD's momentum buffer or Adam's
// moments and AMSGrad maximum (null where unused).
struct UpdateDesc {
    const void* p;
    void* p_out;
    const void* g;
    float* a;
    float* b;
    float* c;
    u64 n;
    RecordArgs rec;
    SgdArgs sgd;
    AdamArgs adam;
    int kind;
    u32 first_block;
    u32 nblocks;
    u32 pad;
};


extern "C" __global__ void amp_sgd_multi(const UpdateDesc* descs, u32 count, const u32* state) {
    const UpdateDesc* d = desc_of_block(descs, count);
    sgd_blocks(d->p, d->p_out, d->g, d->kind, d->a, d->n, d->sgd, state[AMP_FOUND_INF] != 0,
               d->rec, blockIdx.x - d->first_block, d->nblocks);
}

extern "C" __global__ void amp_adam_multi(const UpdateDesc* descs, u32 count, const u32* state) {
    const UpdateDesc* d = desc_of_block(descs, count);
    adam_blocks(d->p, d->p_out, d->g, d->kind, d->a, d->b, d->c, d->n, d->adam,
                state[AMP_FOUND_INF] != 0, d->rec, blockIdx.x - d->first_block, d->nblocks);
}

// Scale-update parameters (amprobe's ScalerConfig).
struct ScalerArgs {
    double growth_factor;
    double backoff_factor;
    float max_scale;   // kind maxclip
    float min_scale;   // kind hysteresis
    int kind;
    int growth_interval;
    int hysteresis;
    int error_at_floor;
};

// The scale update after a step's inf checks (scaler.rs `apply_policy`): ATen's
// _amp_update_scale_ for the default kind (scale times an f64 factor, rounded once; growth
// only when the grown scale is finite), a cap for maxclip, Megatron's hysteresis with a
// floor. One thread.
extern "C" __global__ void amp_update_scale(float* scale, u32* state, ScalerArgs a) {
    if (!first_thread()) return;
    bool found = state[AMP_FOUND_INF] != 0;
    int* growth = (int*)&state[AMP_GROWTH];
    int* hyst = (int*)&state[AMP_HYST];
    float s = scale[0];
    if (a.kind == SK_DEFAULT || a.kind == SK_MAXCLIP) {
        float cap = a.kind == SK_MAXCLIP ? a.max_scale : __int_as_float(0x7f800000);
        if (found) {
            s = (float)((double)s * a.backoff_factor);
            *growth = 0;
        } else if (*growth + 1 == a.growth_interval) {
            float grown = (float)((double)s * a.growth_factor);
            if (isfinite(grown)) s = grown < cap ? grown : cap;
            *growth = 0;
        } else {
            *growth += 1;
        }
    } else if (a.kind == SK_HYSTERESIS) {
        if (found) {
            int h = *hyst - 1;
            if (h <= 0) {
                if (a.error_at_floor && s <= a.min_scale) {
                    state[AMP_ERROR] = 1;
                    return;
                }
                float b = s * (float)a.backoff_factor;
                s = b > a.min_scale ? b : a.min_scale;
            }
            *hyst = h;
            *growth = 0;
        } else {
            *growth += 1;
            if (*growth == a.growth_interval) {
                *growth = 0;
                *hyst = a.hysteresis;
                float grown = s * (float)a.growth_factor;
                if (isfinite(grown)) s = grown;
            }
        }
    }
    scale[0] = s;
}

// Arena words of the step's scalars slot (a slot no probe writes; words from 16 on).
#define SS_FOUND_INF 16
#define SS_SCALE 17
#define SS_GROWTH 18
#define SS_HYST 19
#define SS_ERROR 20
#define SS_UNSCALE_OVER 21
#define SS_UNSCALE_UNDER 22
#define SS_TOTAL_NORM 23
#define SS_CLIP_COEF 24

// Copies the scaler's state into the step's scalars slot and clears the per-step words
// for the next step. One thread.
extern "C" __global__ void amp_step_summary(const float* scale, u32* state, u64* slot) {
    if (!first_thread()) return;
    slot[SS_FOUND_INF] = state[AMP_FOUND_INF];
    slot[SS_SCALE] = __float_as_uint(scale[0]);
    slot[SS_GROWTH] = (u64)(unsigned)state[AMP_GROWTH];
    slot[SS_HYST] = (u64)(unsigned)state[AMP_HYST];
    slot[SS_ERROR] = state[AMP_ERROR];
    slot[SS_UNSCALE_OVER] = state[AMP_UNSCALE_OVER];
    slot[SS_UNSCALE_UNDER] = state[AMP_UNSCALE_UNDER];
    slot[SS_TOTAL_NORM] = state[AMP_TOTAL_NORM];
    slot[SS_CLIP_COEF] = state[AMP_CLIP_COEF];
    state[AMP_FOUND_INF] = 0;
    state[AMP_ERROR] = 0;
    state[AMP_UNSCALE_OVER] = 0;
    state[AMP_UNSCALE_UNDER] = 0;
}

// Element 0 of a tensor as f64 bits into an arena word (a loss for the step's one read).
extern "C" __global__ void amp_scalar_to_word(const void* x, int kind, u64* word) {
    if (!first_thread()) return;
    word[0] = (u64)__double_as_longlong((double)load_f32(x, kind, 0));
}

