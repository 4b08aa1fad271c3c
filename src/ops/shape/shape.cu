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
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        u64 rest = i, is = g.src_base, id = g.dst_base;
        for (int d = MAX_DIMS - 1; d >= 0 && rest; --d) {
            u64 c;
            rest = split_dim(rest, g.shape[d], &c);
            is += c * g.src[d];
            id += c * g.dst[d];
        }
        if (bytes == 2) {
            ((u16*)y)[id] = ((const u16*)x)[is];
        } else if (bytes == 4) {
            ((u32*)y)[id] = ((const u32*)x)[is];
        } else {
            ((u64*)y)[id] = ((const u64*)x)[is];
        }
        out_add(&st, y, kind, id);
    }
    out_end(&st, n);
}
