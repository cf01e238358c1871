// bn_bwd.cu: BatchNorm backward in training mode, fused. Per channel c (M values each):
//   xhat = (x - mean) * invstd,  dbeta = sum(dy),  dgamma = sum(dy * xhat),
//   dx = (weight * invstd) * ((dy - dbeta / M) - xhat * (dgamma / M)).
// Launchers and CPU order models: kernels/bn_bwd.py. The reduction code is in bn_reduce.cuh (bn_fwd.cu
// runs it on the forward's sums).
//
// Two kernels per call: one reduction kernel that reads dy and x once and forms BOTH channel sums, then
// one elementwise kernel for dx that reads the two sums. The block split of the reduction is bias_grad's
// (kernels/bias_grad.py: nchw_plan, rows_plan) and so depends only on the shape and layout:
//   NCHW (N,C,H,W): block (p, c) sums chunk p of channel c's N*H*W values (float4 when H*W % 4 == 0).
//   rows (channels_last N,H,W,C and BatchNorm1d N,C): a [R, C] row-major matrix; block (p, t) sums rows
//     [p*RB, (p+1)*RB) of column tile t, each thread owning VEC adjacent columns (float4 when C % 4 == 0),
//     then a shared-memory halving tree over the block's row lanes.
// Kernels (the reduction kernels exist once per variant; the dx kernels serve both):
//   bn_bwd_{nchw,rows}_atomic  each block's two partials are atomicAdd-ed into the zeroed dbeta and
//                              dgamma. NONDETERMINISTIC when a channel spans more than one block: the
//                              arrival order decides the rounding (what cuDNN's split reductions do).
//   bn_bwd_{nchw,rows}_tree    each block writes its two partials to a workspace; the last block of the
//                              channel (or column tile) to arrive, found with a ticket counter, combines
//                              them in index order. Deterministic: the order depends on the shape only.
//   bn_bwd_dx_{nchw,rows}      dx, one output element per input element, each written once: deterministic
//                              given the sums.
//
// Every float operation is a round-to-nearest intrinsic (__fadd_rn, __fsub_rn, __fmul_rn, __fdiv_rn):
// they are never contracted into FMA, so the sequence of float32 roundings is the one the CPU models
// replay with NumPy float32 and the bits agree. NVRTC compiles without -ftz: subnormals are kept.
// dy, x and dx are act_t (common.cuh): the source is compiled once per activation dtype; bf16/fp16 values
// are widened on load and dx narrowed once on store, the sums and statistics stay float32.
#include "bn_reduce.cuh"

// ---------------------------------------------------------------------------------------------
// Reduction entry points (bn_reduce.cuh)

extern "C" __global__ void __launch_bounds__(BN_THREADS, 4)
bn_bwd_nchw_atomic(const act_t* __restrict__ dy, const act_t* __restrict__ x, const float* __restrict__ mean,
                   const float* __restrict__ invstd, long long N, int C, long long S, long long E, int vec,
                   float* dbeta, float* dgamma) {
    nchw_atomic<false>(dy, x, mean, invstd, N, C, S, E, vec, dbeta, dgamma);
}
extern "C" __global__ void __launch_bounds__(BN_THREADS, 4)
bn_bwd_nchw_tree(const act_t* __restrict__ dy, const act_t* __restrict__ x, const float* __restrict__ mean,
                 const float* __restrict__ invstd, long long N, int C, long long S, long long E, int vec,
                 float* partials, unsigned int* counters, float* dbeta, float* dgamma) {
    nchw_tree<false>(dy, x, mean, invstd, N, C, S, E, vec, partials, counters, dbeta, dgamma);
}
extern "C" __global__ void __launch_bounds__(BN_THREADS, 4)
bn_bwd_rows_atomic(const act_t* __restrict__ dy, const act_t* __restrict__ x, const float* __restrict__ mean,
                   const float* __restrict__ invstd, long long R, int C, long long RB, int vec,
                   float* dbeta, float* dgamma) {
    rows_atomic<false>(dy, x, mean, invstd, R, C, RB, vec, dbeta, dgamma);
}
extern "C" __global__ void __launch_bounds__(BN_THREADS, 4)
bn_bwd_rows_tree(const act_t* __restrict__ dy, const act_t* __restrict__ x, const float* __restrict__ mean,
                 const float* __restrict__ invstd, long long R, int C, long long RB, int vec,
                 float* partials, unsigned int* counters, float* dbeta, float* dgamma) {
    rows_tree<false>(dy, x, mean, invstd, R, C, RB, vec, partials, counters, dbeta, dgamma);
}
// ---------------------------------------------------------------------------------------------
// dx: one thread per VEC consecutive elements; each output element is written once.

struct Coef {
    float mean, invstd, a, b, k;  // a = dbeta / M, b = dgamma / M, k = weight * invstd
};

__device__ __forceinline__ Coef coef_of(int c, const float* __restrict__ mean, const float* __restrict__ invstd,
                                        const float* __restrict__ weight, const float* __restrict__ dbeta,
                                        const float* __restrict__ dgamma, float M) {
    Coef q;
    q.mean = mean[c];
    q.invstd = invstd[c];
    q.a = __fdiv_rn(dbeta[c], M);
    q.b = __fdiv_rn(dgamma[c], M);
    q.k = __fmul_rn(weight != nullptr ? weight[c] : 1.0f, q.invstd);
    return q;
}

__device__ __forceinline__ float dx_of(float dy, float x, const Coef& q) {
    const float xhat = xhat_of(x, q.mean, q.invstd);
    return __fmul_rn(q.k, __fsub_rn(__fsub_rn(dy, q.a), __fmul_rn(xhat, q.b)));
}

// NCHW: element e is in channel (e / S) % C; a float4 (S % 4 == 0) stays inside one row.
template <int VEC>
__device__ __forceinline__ void dx_nchw(const act_t* __restrict__ dy, const act_t* __restrict__ x,
                                        const float* __restrict__ mean, const float* __restrict__ invstd,
                                        const float* __restrict__ weight, const float* __restrict__ dbeta,
                                        const float* __restrict__ dgamma, float M, long long nvec, int C, long long S,
                                        act_t* __restrict__ dx) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
        const long long e = i * VEC;
        const Coef q = coef_of((int)((e / S) % C), mean, invstd, weight, dbeta, dgamma, M);
        float d[4], xv[4], r[4];
        load_act<VEC>(dy + e, d);
        load_act<VEC>(x + e, xv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) r[j] = dx_of(d[j], xv[j], q);
        store_act<VEC>(dx + e, r);
    }
}

extern "C" __global__ void __launch_bounds__(BN_THREADS)
bn_bwd_dx_nchw(const act_t* __restrict__ dy, const act_t* __restrict__ x, const float* __restrict__ mean,
               const float* __restrict__ invstd, const float* __restrict__ weight, const float* __restrict__ dbeta,
               const float* __restrict__ dgamma, long long M, long long nvec, int C, long long S, int vec,
               act_t* __restrict__ dx) {
    const float m = __ll2float_rn(M);  // M rounded to float32 once (exact below 2^24), as np.float32(M)
    if (vec == 4) dx_nchw<4>(dy, x, mean, invstd, weight, dbeta, dgamma, m, nvec, C, S, dx);
    else dx_nchw<1>(dy, x, mean, invstd, weight, dbeta, dgamma, m, nvec, C, S, dx);
}

// rows: block (TX, TY) over rows [blockIdx.x * RB, ...) of column tile blockIdx.y; thread (tx, ty) forms
// the coefficients of its VEC columns once and walks rows r0 + ty, r0 + ty + TY, ...
template <int VEC>
__device__ __forceinline__ void dx_rows(const act_t* __restrict__ dy, const act_t* __restrict__ x,
                                        const float* __restrict__ mean, const float* __restrict__ invstd,
                                        const float* __restrict__ weight, const float* __restrict__ dbeta,
                                        const float* __restrict__ dgamma, float M, long long R, int C, long long RB,
                                        act_t* __restrict__ dx) {
    const int col0 = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (col0 >= C) return;  // C % VEC == 0: a thread's columns are all in range or all out
    Coef q[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) q[j] = coef_of(col0 + j, mean, invstd, weight, dbeta, dgamma, M);
    const long long r0 = (long long)blockIdx.x * RB, r1 = r0 + RB < R ? r0 + RB : R;
    for (long long r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
        const long long o = r * C + col0;
        float d[4], xv[4], res[4];
        load_act<VEC>(dy + o, d);
        load_act<VEC>(x + o, xv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) res[j] = dx_of(d[j], xv[j], q[j]);
        store_act<VEC>(dx + o, res);
    }
}

extern "C" __global__ void __launch_bounds__(BN_THREADS)
bn_bwd_dx_rows(const act_t* __restrict__ dy, const act_t* __restrict__ x, const float* __restrict__ mean,
               const float* __restrict__ invstd, const float* __restrict__ weight, const float* __restrict__ dbeta,
               const float* __restrict__ dgamma, long long M, long long R, int C, long long RB, int vec,
               act_t* __restrict__ dx) {
    const float m = __ll2float_rn(M);
    if (vec == 4) dx_rows<4>(dy, x, mean, invstd, weight, dbeta, dgamma, m, R, C, RB, dx);
    else dx_rows<1>(dy, x, mean, invstd, weight, dbeta, dgamma, m, R, C, RB, dx);
}
