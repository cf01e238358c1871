// bn_reduce.cuh: the channel reductions of BatchNorm, shared by bn_bwd.cu (the backward's two sums,
// sum(dy) and sum(dy * xhat)) and bn_fwd.cu (the forward's, sum(x - k) and sum((x - k)^2): FWD below).
// Block splits: bias_grad's (kernels/bias_grad.py: nchw_plan, rows_plan), a function of shape and layout.
// Every float operation is a round-to-nearest intrinsic, never contracted into FMA (see bn_bwd.cu).
#pragma once
#include "common.cuh"

#define BN_THREADS 256

// ---------------------------------------------------------------------------------------------
// Shared pieces

__device__ __forceinline__ float xhat_of(float x, float mean, float invstd) {
    return __fmul_rn(__fsub_rn(x, mean), invstd);
}

// One element into the two accumulators: s += dy, t += dy * xhat.
__device__ __forceinline__ void accumulate(float& s, float& t, float dy, float x, float mean, float invstd) {
    s = __fadd_rn(s, dy);
    t = __fadd_rn(t, __fmul_rn(dy, xhat_of(x, mean, invstd)));
}

// warp_reduce of common.cuh for two values at once: v[i] += v[i + off], off = 16, 8, 4, 2, 1.
__device__ __forceinline__ void warp_reduce2(float& a, float& b) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        a = __fadd_rn(a, __shfl_down_sync(FULL_MASK, a, off));
        b = __fadd_rn(b, __shfl_down_sync(FULL_MASK, b, off));
    }
}

// block_reduce of common.cuh for two values at once (same order: each warp's halving tree, then warp 0
// over the per-warp sums, zero past the last warp). `scratch` holds 64 floats; results valid in thread 0.
__device__ __forceinline__ void block_reduce2(float& a, float& b, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    warp_reduce2(a, b);
    if (lane == 0) { scratch[warp] = a; scratch[32 + warp] = b; }
    __syncthreads();
    float ra = 0.0f, rb = 0.0f;
    if (warp == 0) {
        ra = lane < nwarps ? scratch[lane] : 0.0f;
        rb = lane < nwarps ? scratch[32 + lane] : 0.0f;
        warp_reduce2(ra, rb);
    }
    __syncthreads();  // scratch may be reused by the caller
    a = ra;
    b = rb;
}

// VEC values of dy and x at p, q; FWD: only x, and dy's values x - k (k: one shift for all VEC lanes, or,
// with the array form below, one per lane).
template <int VEC, bool FWD>
__device__ __forceinline__ void load_pair(const act_t* p, const act_t* q, float d[4], float xv[4], float k) {
    load_act<VEC>(q, xv);
    if (FWD) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) d[j] = __fsub_rn(xv[j], k);
    } else {
        load_act<VEC>(p, d);
    }
}
template <int VEC, bool FWD>
__device__ __forceinline__ void load_pair(const act_t* p, const act_t* q, float d[4], float xv[4], const float k[4]) {
    load_act<VEC>(q, xv);
    if (FWD) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) d[j] = __fsub_rn(xv[j], k[j]);
    } else {
        load_act<VEC>(p, d);
    }
}

// ---------------------------------------------------------------------------------------------
// Reduction, NCHW: channel c is the virtual array v in [0, N*S) with element (n = v / S, s = v % S) at
// offset n*C*S + c*S + s. Chunk p is [p*E, min((p+1)*E, N*S)); thread t adds slots t, t + T, ... (a slot
// is VEC consecutive values of one row) into VEC lane accumulators per sum, combined as (a0+a1)+(a2+a3).


// Four slots of dy and x are loaded before they are added (enough bytes in flight); the additions happen
// in slot order, which is what the CPU model reproduces. FWD (bn_fwd's statistics): dy is not read; its
// value is x - mean (mean: the channel's shift), with invstd = 1, so the sums are sum(x - k), sum((x - k)^2).
template <int VEC, bool FWD>
__device__ __forceinline__ void nchw_thread_sums(const act_t* __restrict__ dy, const act_t* __restrict__ x, int S,
                                                 long long CS, int c, float mean, float invstd, long long begin,
                                                 long long end, float& sum_dy, float& sum_dyx) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f}, t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const act_t* dyc = dy + (long long)c * S;
    const act_t* xc = x + (long long)c * S;
    const int step = VEC * blockDim.x;
    const int step_n = step / S, step_s = step - step_n * S;
    long long v = begin + (long long)VEC * threadIdx.x;
    Walk w = {(int)(v / S), (int)(v % S)};
    for (; v + 3 * step < end; v += 4 * step) {
        Walk w1 = w; advance(w1, step_n, step_s, S);
        Walk w2 = w1; advance(w2, step_n, step_s, S);
        Walk w3 = w2; advance(w3, step_n, step_s, S);
        const long long o0 = w.n * CS + w.s, o1 = w1.n * CS + w1.s, o2 = w2.n * CS + w2.s, o3 = w3.n * CS + w3.s;
        float d0[4], d1[4], d2[4], d3[4], x0[4], x1[4], x2[4], x3[4];
        load_pair<VEC, FWD>(dyc + o0, xc + o0, d0, x0, mean);
        load_pair<VEC, FWD>(dyc + o1, xc + o1, d1, x1, mean);
        load_pair<VEC, FWD>(dyc + o2, xc + o2, d2, x2, mean);
        load_pair<VEC, FWD>(dyc + o3, xc + o3, d3, x3, mean);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            accumulate(s[j], t[j], d0[j], x0[j], mean, invstd);
            accumulate(s[j], t[j], d1[j], x1[j], mean, invstd);
            accumulate(s[j], t[j], d2[j], x2[j], mean, invstd);
            accumulate(s[j], t[j], d3[j], x3[j], mean, invstd);
        }
        w = w3;
        advance(w, step_n, step_s, S);
    }
    for (; v < end; v += step) {
        const long long o = w.n * CS + w.s;
        float d[4], xv[4];
        load_pair<VEC, FWD>(dyc + o, xc + o, d, xv, mean);
#pragma unroll
        for (int j = 0; j < VEC; ++j) accumulate(s[j], t[j], d[j], xv[j], mean, invstd);
        advance(w, step_n, step_s, S);
    }
    if (VEC == 4) {
        sum_dy = __fadd_rn(__fadd_rn(s[0], s[1]), __fadd_rn(s[2], s[3]));
        sum_dyx = __fadd_rn(__fadd_rn(t[0], t[1]), __fadd_rn(t[2], t[3]));
    } else {
        sum_dy = s[0];
        sum_dyx = t[0];
    }
}

// The block's two partials (valid in thread 0).
// FWD: the shift is the channel's first value, x[0, c, 0, 0] (mean and invstd are not read).
template <bool FWD>
__device__ __forceinline__ void nchw_block_partials(const act_t* __restrict__ dy, const act_t* __restrict__ x,
                                                    const float* __restrict__ mean, const float* __restrict__ invstd,
                                                    long long N, int C, long long S, long long E, int vec,
                                                    float* scratch, float& a, float& b) {
    const int c = blockIdx.y;
    const long long L = N * S, begin = (long long)blockIdx.x * E;
    const long long end = begin + E < L ? begin + E : L;
    float m, is = 1.0f;
    if (FWD) {
        load_act<1>(x + (long long)c * S, &m);
    } else {
        m = mean[c];
        is = invstd[c];
    }
    if (vec == 4) nchw_thread_sums<4, FWD>(dy, x, (int)S, (long long)C * S, c, m, is, begin, end, a, b);
    else nchw_thread_sums<1, FWD>(dy, x, (int)S, (long long)C * S, c, m, is, begin, end, a, b);
    block_reduce2(a, b, scratch);
}

template <bool FWD>
__device__ __forceinline__ void nchw_atomic(const act_t* __restrict__ dy, const act_t* __restrict__ x,
                                            const float* __restrict__ mean, const float* __restrict__ invstd, long long N,
                                            int C, long long S, long long E, int vec, float* dbeta, float* dgamma) {
    __shared__ float scratch[64];
    float a, b;
    nchw_block_partials<FWD>(dy, x, mean, invstd, N, C, S, E, vec, scratch, a, b);
    if (threadIdx.x == 0) {  // arrival order decides the rounding
        atomicAdd(dbeta + blockIdx.y, a);
        atomicAdd(dgamma + blockIdx.y, b);
    }
}

// partials: [2][C][P] (dbeta's, then dgamma's). counters: zero on entry, left at zero by each channel's
// last block (see arrive_last in common.cuh).
template <bool FWD>
__device__ __forceinline__ void nchw_tree(const act_t* __restrict__ dy, const act_t* __restrict__ x,
                                          const float* __restrict__ mean, const float* __restrict__ invstd, long long N,
                                          int C, long long S, long long E, int vec, float* partials,
                                          unsigned int* counters, float* dbeta, float* dgamma) {
    __shared__ float scratch[64];
    __shared__ bool last;
    const int c = blockIdx.y;
    const unsigned int P = gridDim.x;
    float a, b;
    nchw_block_partials<FWD>(dy, x, mean, invstd, N, C, S, E, vec, scratch, a, b);
    if (P == 1) {  // one block per channel: its partials are the sums
        if (threadIdx.x == 0) { dbeta[c] = a; dgamma[c] = b; }
        return;
    }
    float* pa = partials + (long long)c * P;
    float* pb = partials + ((long long)C + c) * P;
    if (threadIdx.x == 0) {
        pa[blockIdx.x] = a;
        pb[blockIdx.x] = b;
        last = arrive_last(counters + c, P);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // reduce_partials of common.cuh for both sums: thread t adds partials t, t + T, ... in index order
    // (P <= TARGET_BLOCKS = 512 in bias_grad's nchw_plan: at most two per thread)
    float ra = 0.0f, rb = 0.0f;
    for (long long i = threadIdx.x; i < P; i += blockDim.x) {
        const float a_i = __ldcg(pa + i), b_i = __ldcg(pb + i);
        ra = __fadd_rn(ra, a_i);
        rb = __fadd_rn(rb, b_i);
    }
    block_reduce2(ra, rb, scratch);
    if (threadIdx.x == 0) { dbeta[c] = ra; dgamma[c] = rb; }
}

// ---------------------------------------------------------------------------------------------
// Reduction, rows: dy and x are [R, C] row-major. Block (TX, TY): thread (tx, ty) owns columns
// col0 .. col0+VEC-1, col0 = tile*TX*VEC + tx*VEC, and adds rows r0 + ty, r0 + ty + TY, ... in order. The TY
// partial rows are combined by a halving tree in shared memory: s[ty] += s[ty + h], h = TY/2 .. 1.

// Rows r0 + ty, r0 + ty + TY, ... < r1, added in row order; four rows are loaded before they are added.
template <int VEC, bool FWD>
__device__ __forceinline__ void rows_thread_sums(const act_t* __restrict__ dy, const act_t* __restrict__ x,
                                                 const float m[4], const float is[4], long long r0, long long r1,
                                                 int C, int col0, float s[4], float t[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) s[j] = t[j] = 0.0f;
    if (col0 >= C) return;
    const long long TY = blockDim.y;
    long long r = r0 + threadIdx.y;
    for (; r + 3 * TY < r1; r += 4 * TY) {
        const long long o0 = r * C + col0, o1 = o0 + TY * C, o2 = o1 + TY * C, o3 = o2 + TY * C;
        float d0[4], d1[4], d2[4], d3[4], x0[4], x1[4], x2[4], x3[4];
        load_pair<VEC, FWD>(dy + o0, x + o0, d0, x0, m);
        load_pair<VEC, FWD>(dy + o1, x + o1, d1, x1, m);
        load_pair<VEC, FWD>(dy + o2, x + o2, d2, x2, m);
        load_pair<VEC, FWD>(dy + o3, x + o3, d3, x3, m);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            accumulate(s[j], t[j], d0[j], x0[j], m[j], is[j]);
            accumulate(s[j], t[j], d1[j], x1[j], m[j], is[j]);
            accumulate(s[j], t[j], d2[j], x2[j], m[j], is[j]);
            accumulate(s[j], t[j], d3[j], x3[j], m[j], is[j]);
        }
    }
    for (; r < r1; r += TY) {
        float d[4], xv[4];
        load_pair<VEC, FWD>(dy + r * C + col0, x + r * C + col0, d, xv, m);
#pragma unroll
        for (int j = 0; j < VEC; ++j) accumulate(s[j], t[j], d[j], xv[j], m[j], is[j]);
    }
}

// Second level of the tree: the [P, C] partials of both sums, rows ty, ty + TY, ... < P in order. Four rows
// of each are loaded before they are added (a column tile's last block would otherwise wait on one L2
// round trip per row); reads bypass L1: other blocks wrote them.
template <int VEC>
__device__ __forceinline__ void rows_partial_sums(const float* pa, const float* pb, long long P, int C, int col0,
                                                  float s[4], float t[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) s[j] = t[j] = 0.0f;
    if (col0 >= C) return;
    const long long TY = blockDim.y;
    long long r = threadIdx.y;
    for (; r + 3 * TY < P; r += 4 * TY) {
        const long long o0 = r * C + col0, o1 = o0 + TY * C, o2 = o1 + TY * C, o3 = o2 + TY * C;
        float a0[4], a1[4], a2[4], a3[4], b0[4], b1[4], b2[4], b3[4];
        load_vec<VEC, true>(pa + o0, a0); load_vec<VEC, true>(pb + o0, b0);
        load_vec<VEC, true>(pa + o1, a1); load_vec<VEC, true>(pb + o1, b1);
        load_vec<VEC, true>(pa + o2, a2); load_vec<VEC, true>(pb + o2, b2);
        load_vec<VEC, true>(pa + o3, a3); load_vec<VEC, true>(pb + o3, b3);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            s[j] = __fadd_rn(s[j], a0[j]); s[j] = __fadd_rn(s[j], a1[j]);
            s[j] = __fadd_rn(s[j], a2[j]); s[j] = __fadd_rn(s[j], a3[j]);
            t[j] = __fadd_rn(t[j], b0[j]); t[j] = __fadd_rn(t[j], b1[j]);
            t[j] = __fadd_rn(t[j], b2[j]); t[j] = __fadd_rn(t[j], b3[j]);
        }
    }
    for (; r < P; r += TY) {
        float a[4], b[4];
        load_vec<VEC, true>(pa + r * C + col0, a);
        load_vec<VEC, true>(pb + r * C + col0, b);
#pragma unroll
        for (int j = 0; j < VEC; ++j) { s[j] = __fadd_rn(s[j], a[j]); t[j] = __fadd_rn(t[j], b[j]); }
    }
}

// Halving tree over threadIdx.y for every column of the tile, both sums; row 0 of each tile ends with the
// sums. `tile` holds 2 * BN_THREADS * 4 floats.
__device__ __forceinline__ void rows_block_tree2(float* tile, const float s[4], const float t[4], int vec) {
    const int W = blockDim.x * vec, idx = threadIdx.x * vec, half = BN_THREADS * 4;
#pragma unroll
    for (int j = 0; j < 4; ++j)
        if (j < vec) {
            tile[threadIdx.y * W + idx + j] = s[j];
            tile[half + threadIdx.y * W + idx + j] = t[j];
        }
    __syncthreads();
    for (int h = blockDim.y >> 1; h > 0; h >>= 1) {
        if (threadIdx.y < h) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j < vec) {
                    const int i = threadIdx.y * W + idx + j, k = (threadIdx.y + h) * W + idx + j;
                    tile[i] = __fadd_rn(tile[i], tile[k]);
                    tile[half + i] = __fadd_rn(tile[half + i], tile[half + k]);
                }
        }
        __syncthreads();
    }
}

// FWD: each column's shift is its row-0 value (mean and invstd are not read).
template <bool FWD>
__device__ __forceinline__ void rows_block_partials(const act_t* __restrict__ dy, const act_t* __restrict__ x,
                                                    const float* __restrict__ mean, const float* __restrict__ invstd,
                                                    long long R, int C, long long RB, int vec, int col0, float* tile) {
    const long long r0 = (long long)blockIdx.x * RB, r1 = r0 + RB < R ? r0 + RB : R;
    float m[4] = {0.0f, 0.0f, 0.0f, 0.0f}, is[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s[4], t[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
        if (j < vec && col0 + j < C) {
            if (FWD) {
                load_act<1>(x + col0 + j, &m[j]);
                is[j] = 1.0f;
            } else {
                m[j] = mean[col0 + j];
                is[j] = invstd[col0 + j];
            }
        }
    if (vec == 4) rows_thread_sums<4, FWD>(dy, x, m, is, r0, r1, C, col0, s, t);
    else rows_thread_sums<1, FWD>(dy, x, m, is, r0, r1, C, col0, s, t);
    rows_block_tree2(tile, s, t, vec);
}

template <bool FWD>
__device__ __forceinline__ void rows_atomic(const act_t* __restrict__ dy, const act_t* __restrict__ x,
                                            const float* __restrict__ mean, const float* __restrict__ invstd, long long R,
                                            int C, long long RB, int vec, float* dbeta, float* dgamma) {
    __shared__ float tile[2 * BN_THREADS * 4];
    const int col0 = (blockIdx.y * blockDim.x + threadIdx.x) * vec;
    rows_block_partials<FWD>(dy, x, mean, invstd, R, C, RB, vec, col0, tile);
    if (threadIdx.y == 0)
        for (int j = 0; j < vec; ++j)
            if (col0 + j < C) {  // arrival order decides the rounding
                atomicAdd(dbeta + col0 + j, tile[threadIdx.x * vec + j]);
                atomicAdd(dgamma + col0 + j, tile[BN_THREADS * 4 + threadIdx.x * vec + j]);
            }
}

// partials: [2][P][C] (dbeta's, then dgamma's). counters: zero on entry, left at zero by each column
// tile's last block (see arrive_last in common.cuh).
template <bool FWD>
__device__ __forceinline__ void rows_tree(const act_t* __restrict__ dy, const act_t* __restrict__ x,
                                          const float* __restrict__ mean, const float* __restrict__ invstd, long long R,
                                          int C, long long RB, int vec, float* partials, unsigned int* counters,
                                          float* dbeta, float* dgamma) {
    __shared__ float tile[2 * BN_THREADS * 4];
    __shared__ bool last;
    const int col0 = (blockIdx.y * blockDim.x + threadIdx.x) * vec;
    const unsigned int P = gridDim.x;
    const int half = BN_THREADS * 4;
    rows_block_partials<FWD>(dy, x, mean, invstd, R, C, RB, vec, col0, tile);
    if (P == 1) {  // one block per column tile: its partial rows are the sums
        if (threadIdx.y == 0)
            for (int j = 0; j < vec; ++j)
                if (col0 + j < C) {
                    dbeta[col0 + j] = tile[threadIdx.x * vec + j];
                    dgamma[col0 + j] = tile[half + threadIdx.x * vec + j];
                }
        return;
    }
    float* pa = partials;
    float* pb = partials + (long long)P * C;
    if (threadIdx.y == 0) {
        for (int j = 0; j < vec; ++j)
            if (col0 + j < C) {
                pa[(long long)blockIdx.x * C + col0 + j] = tile[threadIdx.x * vec + j];
                pb[(long long)blockIdx.x * C + col0 + j] = tile[half + threadIdx.x * vec + j];
            }
        __threadfence();
    }
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) last = arrive_last(counters + blockIdx.y, P);
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Second level: the same thread layout over the [P, C] partials of each sum, then the same tree.
    float s[4], t[4];
    if (vec == 4) rows_partial_sums<4>(pa, pb, P, C, col0, s, t);
    else rows_partial_sums<1>(pa, pb, P, C, col0, s, t);
    rows_block_tree2(tile, s, t, vec);
    if (threadIdx.y == 0)
        for (int j = 0; j < vec; ++j)
            if (col0 + j < C) {
                dbeta[col0 + j] = tile[threadIdx.x * vec + j];
                dgamma[col0 + j] = tile[half + threadIdx.x * vec + j];
            }
}
