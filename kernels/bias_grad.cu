// bias_grad.cu: gradient of a bias add, dB[c] = sum of dY over every axis but C. Launchers and CPU
// order models: kernels/bias_grad.py.
//
// Two data paths, each with both variants; the split into blocks depends only on the shape:
//   NCHW (N,C,H,W): block (p, c) sums chunk p of channel c's N*H*W values (float4 when H*W % 4 == 0).
//   rows (channels_last N,H,W,C and linear N,C): a [R, C] row-major matrix; block (p, t) sums rows
//     [p*RB, (p+1)*RB) of column tile t, each thread owning VEC adjacent columns, then a shared-memory
//     halving tree over the block's row lanes.
// Variants:
//   atomic  each block's partial is atomicAdd-ed into dB (zeroed first). NONDETERMINISTIC when a
//           channel spans more than one block: the arrival order decides the rounding.
//   tree    each block writes its partial to a workspace; the last block to finish for a channel (or
//           column tile) reduces that channel's partials in index order. Deterministic; one launch,
//           like atomic. NCHW with P = 2, 4 or 8 blocks per channel: the channel's blocks form a
//           thread-block cluster and rank 0 reads the P partials from its peers' shared memory
//           (distributed shared memory) in index order: the same sum, no global-memory round trips.
#include "common.cuh"

#define BG_THREADS 256

// ---------------------------------------------------------------------------------------------
// NCHW: channel c is the virtual array v in [0, N*S) with element (n = v / S, s = v % S) at
// dy[n*C*S + c*S + s]. Chunk p is [p*E, min((p+1)*E, N*S)); thread t adds slots t, t + T, ...
// (a slot is VEC consecutive values) into VEC lane accumulators, combined as (a0+a1)+(a2+a3).

// Positions walk with Walk/advance (common.cuh).

// Four loads are issued before they are added so that enough bytes are in flight; the additions happen
// in slot order, which is what the CPU model reproduces.
template <int VEC>
__device__ __forceinline__ float nchw_thread_sum(const float* __restrict__ dy, int S, long long CS,
                                                 int c, long long begin, long long end) {
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    const float* base = dy + (long long)c * S;
    const int step = VEC * blockDim.x;
    const int step_n = step / S, step_s = step - step_n * S;
    long long v = begin + (long long)VEC * threadIdx.x;
    Walk w = {(int)(v / S), (int)(v % S)};
    for (; v + 3 * step < end; v += 4 * step) {
        Walk w1 = w; advance(w1, step_n, step_s, S);
        Walk w2 = w1; advance(w2, step_n, step_s, S);
        Walk w3 = w2; advance(w3, step_n, step_s, S);
        if (VEC == 4) {
            const float4 q0 = *reinterpret_cast<const float4*>(base + w.n * CS + w.s);
            const float4 q1 = *reinterpret_cast<const float4*>(base + w1.n * CS + w1.s);
            const float4 q2 = *reinterpret_cast<const float4*>(base + w2.n * CS + w2.s);
            const float4 q3 = *reinterpret_cast<const float4*>(base + w3.n * CS + w3.s);
            a0 += q0.x; a1 += q0.y; a2 += q0.z; a3 += q0.w;
            a0 += q1.x; a1 += q1.y; a2 += q1.z; a3 += q1.w;
            a0 += q2.x; a1 += q2.y; a2 += q2.z; a3 += q2.w;
            a0 += q3.x; a1 += q3.y; a2 += q3.z; a3 += q3.w;
        } else {
            const float q0 = base[w.n * CS + w.s], q1 = base[w1.n * CS + w1.s];
            const float q2 = base[w2.n * CS + w2.s], q3 = base[w3.n * CS + w3.s];
            a0 += q0; a0 += q1; a0 += q2; a0 += q3;
        }
        w = w3;
        advance(w, step_n, step_s, S);
    }
    for (; v < end; v += step) {
        if (VEC == 4) {
            const float4 q = *reinterpret_cast<const float4*>(base + w.n * CS + w.s);
            a0 += q.x; a1 += q.y; a2 += q.z; a3 += q.w;
        } else {
            a0 += base[w.n * CS + w.s];
        }
        advance(w, step_n, step_s, S);
    }
    return (a0 + a1) + (a2 + a3);
}

__device__ __forceinline__ float nchw_block_partial(const float* __restrict__ dy, long long N, int C, long long S,
                                                    long long E, int vec, float* scratch) {
    const int c = blockIdx.y;
    const long long L = N * S, begin = (long long)blockIdx.x * E;
    const long long end = begin + E < L ? begin + E : L;
    const float t = vec == 4 ? nchw_thread_sum<4>(dy, (int)S, (long long)C * S, c, begin, end)
                             : nchw_thread_sum<1>(dy, (int)S, (long long)C * S, c, begin, end);
    return block_reduce(t, scratch);
}

extern "C" __global__ void __launch_bounds__(BG_THREADS, 8)
bias_grad_nchw_atomic(const float* __restrict__ dy, long long N, int C, long long S, long long E, int vec,
                      float* out) {
    __shared__ float scratch[32];
    const float v = nchw_block_partial(dy, N, C, S, E, vec, scratch);
    if (threadIdx.x == 0) atomicAdd(out + blockIdx.y, v);  // arrival order decides the rounding
}

extern "C" __global__ void __launch_bounds__(BG_THREADS, 8)
bias_grad_nchw_tree(const float* __restrict__ dy, long long N, int C, long long S, long long E, int vec,
                    float* partials, unsigned int* counters, float* out) {
    // counters: zero on entry, left at zero by each channel's last block (see arrive_last)
    __shared__ float scratch[32];
    __shared__ bool last;
    const int c = blockIdx.y;
    const unsigned int P = gridDim.x;
    const float v = nchw_block_partial(dy, N, C, S, E, vec, scratch);
    if (P == 1) {  // one block per channel: its partial is the result (the same bits as the final pass)
        if (threadIdx.x == 0) out[c] = v;
        return;
    }
    if (threadIdx.x == 0) {
        partials[(long long)c * P + blockIdx.x] = v;
        last = arrive_last(counters + c, P);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float r = reduce_partials(partials + (long long)c * P, P, scratch);
    if (threadIdx.x == 0) out[c] = r;
}

// NCHW tree with the channel's P blocks in one cluster (sm_90). Rank r = blockIdx.x holds chunk r's
// partial in shared memory; after a cluster barrier, warp 0 of rank 0 loads partial `lane` from rank
// `lane` (zero past P) and reduces with warp_reduce: for P <= 32 that is exactly reduce_partials' sum
// (thread t's strided sum is partial t; every other warp contributes +0.0), so the bits are the same.

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ float load_peer_shared(const float* local, unsigned int rank) {
    const unsigned int addr = static_cast<unsigned int>(__cvta_generic_to_shared(local));
    unsigned int remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

template <int P>
__device__ __forceinline__ void nchw_cluster_tree(const float* __restrict__ dy, long long N, int C, long long S,
                                                  long long E, int vec, float* out) {
    __shared__ float scratch[32];
    __shared__ float partial;
    const float v = nchw_block_partial(dy, N, C, S, E, vec, scratch);
    if (threadIdx.x == 0) partial = v;
    cluster_sync();
    if (blockIdx.x == 0 && threadIdx.x < 32) {
        const float p = warp_reduce(threadIdx.x < P ? load_peer_shared(&partial, threadIdx.x) : 0.0f);
        if (threadIdx.x == 0) out[blockIdx.y] = p;
    }
    cluster_sync();  // peers' shared memory must outlive rank 0's reads
}

#define NCHW_CLUSTER_KERNEL(P)                                                                          \
    extern "C" __global__ void __cluster_dims__(P, 1, 1) __launch_bounds__(BG_THREADS, 8)              \
    bias_grad_nchw_tree_cluster##P(const float* __restrict__ dy, long long N, int C, long long S,      \
                                   long long E, int vec, float* out) {                                 \
        nchw_cluster_tree<P>(dy, N, C, S, E, vec, out);                                                 \
    }
NCHW_CLUSTER_KERNEL(2)
NCHW_CLUSTER_KERNEL(4)
NCHW_CLUSTER_KERNEL(8)

// ---------------------------------------------------------------------------------------------
// rows: dy is [R, C] row-major. Block (TX, TY): thread (tx, ty) owns columns col0 .. col0+VEC-1 with
// col0 = tile*TX*VEC + tx*VEC and adds rows r0 + ty, r0 + ty + TY, ... in order. The TY partial rows
// are then combined by a halving tree in shared memory: s[ty] += s[ty + h], h = TY/2 .. 1.

// Rows r0 + ty, r0 + ty + TY, ... < r1 of columns col0 .. col0 + VEC - 1, added in row order; four rows
// are loaded before they are added.
template <int VEC, bool BYPASS_L1>
__device__ __forceinline__ void rows_thread_sum(const float* src, long long r0, long long r1, int C, int col0,
                                                float a[4]) {
    a[0] = a[1] = a[2] = a[3] = 0.0f;
    if (col0 >= C) return;
    const long long TY = blockDim.y;
    long long r = r0 + threadIdx.y;
    for (; r + 3 * TY < r1; r += 4 * TY) {
        float q0[4], q1[4], q2[4], q3[4];
        load_vec<VEC, BYPASS_L1>(src + r * C + col0, q0);
        load_vec<VEC, BYPASS_L1>(src + (r + TY) * C + col0, q1);
        load_vec<VEC, BYPASS_L1>(src + (r + 2 * TY) * C + col0, q2);
        load_vec<VEC, BYPASS_L1>(src + (r + 3 * TY) * C + col0, q3);
#pragma unroll
        for (int j = 0; j < VEC; ++j) { a[j] += q0[j]; a[j] += q1[j]; a[j] += q2[j]; a[j] += q3[j]; }
    }
    for (; r < r1; r += TY) {
        float q[4];
        load_vec<VEC, BYPASS_L1>(src + r * C + col0, q);
#pragma unroll
        for (int j = 0; j < VEC; ++j) a[j] += q[j];
    }
}

template <bool BYPASS_L1>
__device__ __forceinline__ void rows_sum(const float* src, long long r0, long long r1, int C, int col0, int vec,
                                         float a[4]) {
    if (vec == 4) rows_thread_sum<4, BYPASS_L1>(src, r0, r1, C, col0, a);
    else rows_thread_sum<1, BYPASS_L1>(src, r0, r1, C, col0, a);
}

// Halving tree over threadIdx.y for every column of the tile; row 0 of `tile` ends with the sums.
__device__ __forceinline__ void rows_block_tree(float* tile, const float a[4], int vec) {
    const int W = blockDim.x * vec, idx = threadIdx.x * vec;
#pragma unroll
    for (int j = 0; j < 4; ++j)
        if (j < vec) tile[threadIdx.y * W + idx + j] = a[j];
    __syncthreads();
    for (int h = blockDim.y >> 1; h > 0; h >>= 1) {
        if (threadIdx.y < h) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j < vec) tile[threadIdx.y * W + idx + j] += tile[(threadIdx.y + h) * W + idx + j];
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(BG_THREADS, 8)
bias_grad_rows_atomic(const float* __restrict__ dy, long long R, int C, long long RB, int vec, float* out) {
    extern __shared__ float tile[];
    const int col0 = (blockIdx.y * blockDim.x + threadIdx.x) * vec;
    const long long r0 = (long long)blockIdx.x * RB, r1 = r0 + RB < R ? r0 + RB : R;
    float a[4];
    rows_sum<false>(dy, r0, r1, C, col0, vec, a);
    rows_block_tree(tile, a, vec);
    if (threadIdx.y == 0)
        for (int j = 0; j < vec; ++j)
            if (col0 + j < C) atomicAdd(out + col0 + j, tile[threadIdx.x * vec + j]);
}

extern "C" __global__ void __launch_bounds__(BG_THREADS, 8)
bias_grad_rows_tree(const float* __restrict__ dy, long long R, int C, long long RB, int vec,
                    float* partials, unsigned int* counters, float* out) {
    // counters: zero on entry, left at zero by each column tile's last block (see arrive_last)
    extern __shared__ float tile[];
    __shared__ bool last;
    const int col0 = (blockIdx.y * blockDim.x + threadIdx.x) * vec;
    const long long r0 = (long long)blockIdx.x * RB, r1 = r0 + RB < R ? r0 + RB : R;
    const unsigned int P = gridDim.x;
    float a[4];
    rows_sum<false>(dy, r0, r1, C, col0, vec, a);
    rows_block_tree(tile, a, vec);
    if (P == 1) {  // one block per column tile: its partial row is the result (same bits)
        if (threadIdx.y == 0)
            for (int j = 0; j < vec; ++j)
                if (col0 + j < C) out[col0 + j] = tile[threadIdx.x * vec + j];
        return;
    }
    if (threadIdx.y == 0) {
        for (int j = 0; j < vec; ++j)
            if (col0 + j < C) partials[(long long)blockIdx.x * C + col0 + j] = tile[threadIdx.x * vec + j];
        __threadfence();
    }
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) last = arrive_last(counters + blockIdx.y, P);
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Second level: the same thread layout over the [P, C] partials, rows p = ty, ty + TY, ...
    rows_sum<true>(partials, 0, P, C, col0, vec, a);
    __syncthreads();
    rows_block_tree(tile, a, vec);
    if (threadIdx.y == 0)
        for (int j = 0; j < vec; ++j)
            if (col0 + j < C) out[col0 + j] = tile[threadIdx.x * vec + j];
}
