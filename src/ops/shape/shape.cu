// Strided copies: every shape op that moves values (transpose, permute, slice, cat and
// their gradients) is one copy over an iteration shape, with a source and a destination
// offset per index. Values are moved as raw element bits, never converted.

#ifndef MAX_DIMS
#define MAX_DIMS 6
#endif

// The iteration shape (padded on the left with 1s), the source's and the destination's
// strides over it (0 in padding), and the offset of index 0 in each.
struct Strided {
    u64 shape[MAX_DIMS];
    u64 src[MAX_DIMS];
    u64 dst[MAX_DIMS];
    u64 src_base;
    u64 dst_base;
};

// When the copy writes every element of y once (a gather, or a scatter that covers its
// output), it may gather y's statistics as it writes (`kind`, `counts`, `partials` as in
// common.cuh's OutStats; partials null otherwise).
extern "C" __global__ void amp_strided_copy(const void* x, void* y, int bytes, u64 n,
                                            Strided g, int kind, u64* counts,
                                            double* partials) {
    OutStats st;
    out_begin(&st, counts, partials, kind);
    // Each element's value (its raw bits) and destination travel together.
    struct Moved {
        u64 bits;
        u64 dst;
    };
    grid_map<Moved>(
        n,
        [&](u64 i) {
            u64 rest = i, is = g.src_base, id = g.dst_base;
            for (int d = MAX_DIMS - 1; d >= 0 && rest; --d) {
                u64 c;
                rest = split_dim(rest, g.shape[d], &c);
                is += c * g.src[d];
                id += c * g.dst[d];
            }
            u64 v = bytes == 2   ? (u64)((const u16*)x)[is]
                    : bytes == 4 ? (u64)((const u32*)x)[is]
                                 : ((const u64*)x)[is];
            return Moved{v, id};
        },
        [&](u64, Moved m) {
            if (bytes == 2) {
                ((u16*)y)[m.dst] = (u16)m.bits;
            } else if (bytes == 4) {
                ((u32*)y)[m.dst] = (u32)m.bits;
            } else {
                ((u64*)y)[m.dst] = m.bits;
            }
            out_add(&st, y, kind, m.dst);
        });
    out_end(&st, n);
}
