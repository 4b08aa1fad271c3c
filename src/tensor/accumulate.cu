// Gradient accumulation of the autograd tape: a + b for two tensors of one shape and
// storage kind, computed in f32 and rounded once (as the elementwise add).

extern "C" __global__ void amp_add_same(const void* a, const void* b, void* y, int kind, u64 n,
                                        u64* counts, double* partials) {
    u32 over = 0, under = 0;
    OutStats st;
    out_begin(&st, counts, partials, kind);
    grid_map<float>(
        n, [&](u64 i) { return load_f32(a, kind, i) + load_f32(b, kind, i); },
        [&](u64 i, float v) {
            store_round(y, kind, i, v, &over, &under);
            out_add(&st, y, kind, i);
        });
    block_add_counts(over, under, counts);
    out_end(&st, n);
}
