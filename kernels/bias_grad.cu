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
//           like atomic.
#include "common.cuh"

#define BG_THREADS 256

// ---------------------------------------------------------------------------------------------
// NCHW: channel c is the virtual array v in [0, N*S) with element (n = v / S, s = v % S) at
// dy[n*C*S + c*S + s]. Chunk p is [p*E, min((p+1)*E, N*S)); thread t adds slots t, t + T, ...
// (a slot is VEC consecutive values) into VEC lane accumulators, combined as (a0+a1)+(a2+a3).

__device__ __forceinline__ float nchw_thread_sum(const float* __restrict__ dy, long long S, long long CS,
                                                 int c, long long begin, long long end, int vec) {
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    const float* base = dy + (long long)c * S;
    if (vec == 4) {
        // Walk (n, s) incrementally: one division at the start, none in the loop.
        const long long step = 4LL * blockDim.x;
        const long long step_n = step / S, step_s = step - step_n * S;
        long long v = begin + 4LL * threadIdx.x;
        long long n = v / S, s = v - n * S;
#pragma unroll 4
        for (; v < end; v += step) {
            const float4 q = *reinterpret_cast<const float4*>(base + n * CS + s);
            a0 += q.x; a1 += q.y; a2 += q.z; a3 += q.w;
            n += step_n; s += step_s;
            if (s >= S) { s -= S; ++n; }
        }
    } else {
        const long long step = blockDim.x;
        const long long step_n = step / S, step_s = step - step_n * S;
        long long v = begin + threadIdx.x;
        long long n = v / S, s = v - n * S;
#pragma unroll 4
        for (; v < end; v += step) {
            a0 += base[n * CS + s];
            n += step_n; s += step_s;
            if (s >= S) { s -= S; ++n; }
        }
    }
    return (a0 + a1) + (a2 + a3);
}

extern "C" __global__ void __launch_bounds__(BG_THREADS)
bias_grad_nchw_atomic(const float* __restrict__ dy, long long N, int C, long long S, long long E, int vec,
                      float* out) {
    __shared__ float scratch[32];
    const int c = blockIdx.y;
    const long long L = N * S, begin = (long long)blockIdx.x * E;
    const long long end = begin + E < L ? begin + E : L;
    const float v = block_reduce(nchw_thread_sum(dy, S, (long long)C * S, c, begin, end, vec), scratch);
    if (threadIdx.x == 0) atomicAdd(out + c, v);  // arrival order decides the rounding
}

extern "C" __global__ void __launch_bounds__(BG_THREADS)
bias_grad_nchw_tree(const float* __restrict__ dy, long long N, int C, long long S, long long E, int vec,
                    float* partials, unsigned int* counters, float* out) {
    __shared__ float scratch[32];
    __shared__ bool last;
    const int c = blockIdx.y;
    const unsigned int P = gridDim.x;
    const long long L = N * S, begin = (long long)blockIdx.x * E;
    const long long end = begin + E < L ? begin + E : L;
    const float v = block_reduce(nchw_thread_sum(dy, S, (long long)C * S, c, begin, end, vec), scratch);
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

// ---------------------------------------------------------------------------------------------
// rows: dy is [R, C] row-major. Block (TX, TY): thread (tx, ty) owns columns col0 .. col0+VEC-1 with
// col0 = tile*TX*VEC + tx*VEC and adds rows r0 + ty, r0 + ty + TY, ... in order. The TY partial rows
// are then combined by a halving tree in shared memory: s[ty] += s[ty + h], h = TY/2 .. 1.

__device__ __forceinline__ void rows_thread_sum(const float* src, long long r0, long long r1, int C,
                                                int col0, int vec, bool bypass_l1, float a[4]) {
    a[0] = a[1] = a[2] = a[3] = 0.0f;
    if (col0 >= C) return;
    if (vec == 4) {
#pragma unroll 4
        for (long long r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
            const float4* p = reinterpret_cast<const float4*>(src + r * C + col0);
            const float4 q = bypass_l1 ? __ldcg(p) : *p;
            a[0] += q.x; a[1] += q.y; a[2] += q.z; a[3] += q.w;
        }
    } else {
#pragma unroll 4
        for (long long r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
            const float* p = src + r * C + col0;
            a[0] += bypass_l1 ? __ldcg(p) : *p;
        }
    }
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

extern "C" __global__ void __launch_bounds__(BG_THREADS)
bias_grad_rows_atomic(const float* __restrict__ dy, long long R, int C, long long RB, int vec, float* out) {
    extern __shared__ float tile[];
    const int col0 = (blockIdx.y * blockDim.x + threadIdx.x) * vec;
    const long long r0 = (long long)blockIdx.x * RB, r1 = r0 + RB < R ? r0 + RB : R;
    float a[4];
    rows_thread_sum(dy, r0, r1, C, col0, vec, false, a);
    rows_block_tree(tile, a, vec);
    if (threadIdx.y == 0)
        for (int j = 0; j < vec; ++j)
            if (col0 + j < C) atomicAdd(out + col0 + j, tile[threadIdx.x * vec + j]);
}

extern "C" __global__ void __launch_bounds__(BG_THREADS)
bias_grad_rows_tree(const float* __restrict__ dy, long long R, int C, long long RB, int vec,
                    float* partials, unsigned int* counters, float* out) {
    extern __shared__ float tile[];
    __shared__ bool last;
    const int col0 = (blockIdx.y * blockDim.x + threadIdx.x) * vec;
    const long long r0 = (long long)blockIdx.x * RB, r1 = r0 + RB < R ? r0 + RB : R;
    const unsigned int P = gridDim.x;
    float a[4];
    rows_thread_sum(dy, r0, r1, C, col0, vec, false, a);
    rows_block_tree(tile, a, vec);
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
    rows_thread_sum(partials, 0, P, C, col0, vec, true, a);
    __syncthreads();
    rows_block_tree(tile, a, vec);
    if (threadIdx.y == 0)
        for (int j = 0; j < vec; ++j)
            if (col0 + j < C) out[col0 + j] = tile[threadIdx.x * vec + j];
}
