// Kernels with known answers that exercise the simulated execution model: barriers,
// warp-level operations, atomics and shared memory; and kernels that must fail.

typedef unsigned int u32;
typedef unsigned long long u64;

// Sum of each block's elements by a tree reduction in shared memory (blockDim.x = 256).
extern "C" __global__ void sim_block_sum(const float* x, float* out, u32 n) {
    __shared__ float buf[256];
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    buf[threadIdx.x] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = buf[0];
}

// Sum of each warp's values by shuffles (no shared memory, no block barrier).
extern "C" __global__ void sim_warp_sum(const int* x, int* out) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    int v = x[i];
    for (int d = 16; d > 0; d >>= 1) v += __shfl_down_sync(0xffffffffu, v, d);
    if ((threadIdx.x & 31u) == 0) out[i / 32] = v;
}

// Every thread adds 1 to one counter `reps` times.
extern "C" __global__ void sim_atomic_count(u64* counter, u32 reps) {
    for (u32 r = 0; r < reps; r++) atomicAdd(counter, 1ull);
}

// Transpose of an n×n matrix through a 32×33 shared tile (blockDim = 32×32).
extern "C" __global__ void sim_transpose(const float* in, float* out, u32 n) {
    __shared__ float tile[32][33];
    u32 x = blockIdx.x * 32 + threadIdx.x, y = blockIdx.y * 32 + threadIdx.y;
    if (x < n && y < n) tile[threadIdx.y][threadIdx.x] = in[y * n + x];
    __syncthreads();
    x = blockIdx.y * 32 + threadIdx.x;
    y = blockIdx.x * 32 + threadIdx.y;
    if (x < n && y < n) out[y * n + x] = tile[threadIdx.x][threadIdx.y];
}

// Each block reverses its slice through dynamic shared memory.
extern "C" __global__ void sim_reverse_dynamic(const int* x, int* out) {
    extern __shared__ int rev[];
    u32 base = blockIdx.x * blockDim.x;
    rev[threadIdx.x] = x[base + threadIdx.x];
    __syncthreads();
    out[base + threadIdx.x] = rev[blockDim.x - 1 - threadIdx.x];
}

// Per lane: the ballot of odd values and the mask of lanes holding the same value.
extern "C" __global__ void sim_vote(const int* x, u32* ballot, u32* match) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    int v = x[i];
    ballot[i] = __ballot_sync(0xffffffffu, v & 1);
    match[i] = __match_any_sync(0xffffffffu, v);
}

// Writes one element past the end of `x` (must be reported).
extern "C" __global__ void sim_write_past_end(float* x, u32 n) {
    if (blockIdx.x == 0 && threadIdx.x == 0) x[n] = 1.0f;
}

// Writes far past the end of `x`, beyond what a launch checks (must be reported at the next
// synchronization).
extern "C" __global__ void sim_write_far_past_end(float* x, u32 n, u32 far) {
    if (blockIdx.x == 0 && threadIdx.x == 0) x[n + far] = 1.0f;
}

// b[i] = a[i] for i < n: reads a, and touches b only by writes (known traffic).
extern "C" __global__ void sim_copy(const float* a, float* b, u32 n) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) b[i] = a[i];
}

// x[i] *= s for i < n: reads x before writing it.
extern "C" __global__ void sim_scale(float* x, float s, u32 n) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * s;
}
