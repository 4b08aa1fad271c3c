// Casts between storage kinds: computed in f32 and rounded once (RNE), counting overflow
// and underflow.

// y = round(x) from one storage kind to another.
extern "C" __global__ void amp_cast(const void* x, int xk, void* y, int yk, u64 n,
                                    u64* counts, double* partials) {
    u32 over = 0, under = 0;
    OutStats st;
    out_begin(&st, counts, partials, yk);
    grid_map<float>(
        n, [&](u64 i) { return load_f32(x, xk, i); },
        [&](u64 i, float v) {
            store_round(y, yk, i, v, &over, &under);
            out_add(&st, y, yk, i);
        });
    block_add_counts(over, under, counts);
    out_end(&st, n);
}
