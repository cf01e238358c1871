// bn_fwd.cu: BatchNorm forward in training mode. Per channel c with M values and shift k = its first value:
//   s = sum(x - k), t = sum((x - k)^2)      (bn_reduce.cuh, FWD: bn_bwd's reduction and block split)
//   mean = k + s / M, var = max((t - s * (s / M)) / M, 0), invstd = 1 / sqrt(var + eps), running statistics,
//   y = ((x - mean) * invstd) * weight + bias.
// Launchers and CPU order models: kernels/bn_fwd.py.
//
// Kernels: bn_fwd_{nchw,rows}_{atomic,tree} (the sums: atomic adds block partials in arrival order,
// NONDETERMINISTIC; tree combines them in index order in the last block, deterministic), bn_fwd_stats (one
// thread per channel) and bn_fwd_y_{nchw,rows} (elementwise, each y written once). Every float operation is
// a round-to-nearest intrinsic, never contracted into FMA, so the CPU models' float32 replay gives the bits.
#include "bn_reduce.cuh"

// bn_fwd's statistics sums (FWD above): sum_d = sum(x - k), sum_dd = sum((x - k)^2), k = x[0, c, 0, 0]
extern "C" __global__ void __launch_bounds__(BN_THREADS, 4)
bn_fwd_nchw_atomic(const act_t* __restrict__ x, long long N, int C, long long S, long long E, int vec,
                   float* sum_d, float* sum_dd) {
    nchw_atomic<true>(x, x, nullptr, nullptr, N, C, S, E, vec, sum_d, sum_dd);
}
extern "C" __global__ void __launch_bounds__(BN_THREADS, 4)
bn_fwd_nchw_tree(const act_t* __restrict__ x, long long N, int C, long long S, long long E, int vec,
                 float* partials, unsigned int* counters, float* sum_d, float* sum_dd) {
    nchw_tree<true>(x, x, nullptr, nullptr, N, C, S, E, vec, partials, counters, sum_d, sum_dd);
}

extern "C" __global__ void __launch_bounds__(BN_THREADS, 4)
bn_fwd_rows_atomic(const act_t* __restrict__ x, long long R, int C, long long RB, int vec, float* sum_d,
                   float* sum_dd) {
    rows_atomic<true>(x, x, nullptr, nullptr, R, C, RB, vec, sum_d, sum_dd);
}
extern "C" __global__ void __launch_bounds__(BN_THREADS, 4)
bn_fwd_rows_tree(const act_t* __restrict__ x, long long R, int C, long long RB, int vec, float* partials,
                 unsigned int* counters, float* sum_d, float* sum_dd) {
    rows_tree<true>(x, x, nullptr, nullptr, R, C, RB, vec, partials, counters, sum_d, sum_dd);
}

// ---------------------------------------------------------------------------------------------
// Statistics and y. The sums above give, per channel with shift k and M values, s = sum(x - k) and
// t = sum((x - k)^2); then, one thread per channel:
//   a = s / M, mean = k + a, var = max((t - s * a) / M, 0) (NaN kept), invstd = 1 / sqrt(var + eps),
//   running_mean = momentum * mean + (1 - momentum) * running_mean,
//   running_var = momentum * (var * M / (M - 1)) + (1 - momentum) * running_var  (where given);
// and y = ((x - mean) * invstd) * weight + bias, weight 1 and bias +0.0 where not given.
extern "C" __global__ void __launch_bounds__(BN_THREADS)
bn_fwd_stats(const act_t* __restrict__ x, long long kstride, const float* __restrict__ sum_d,
             const float* __restrict__ sum_dd, long long M, int C, float eps, float momentum,
             float* __restrict__ running_mean, float* __restrict__ running_var, float* __restrict__ save_mean,
             float* __restrict__ save_invstd) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const float m = __ll2float_rn(M);
    float k;
    load_act<1>(x + (long long)c * kstride, &k);
    const float s = sum_d[c], t = sum_dd[c];
    const float a = __fdiv_rn(s, m);
    const float mean = __fadd_rn(k, a);
    float var = __fdiv_rn(__fsub_rn(t, __fmul_rn(s, a)), m);
    var = var < 0.0f ? 0.0f : var;
    save_mean[c] = mean;
    save_invstd[c] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
    const float keep = __fsub_rn(1.0f, momentum);
    if (running_mean != nullptr)
        running_mean[c] = __fadd_rn(__fmul_rn(momentum, mean), __fmul_rn(keep, running_mean[c]));
    if (running_var != nullptr) {
        const float unbiased = __fdiv_rn(__fmul_rn(var, m), __fsub_rn(m, 1.0f));
        running_var[c] = __fadd_rn(__fmul_rn(momentum, unbiased), __fmul_rn(keep, running_var[c]));
    }
}

__device__ __forceinline__ float y_of(float x, float mean, float invstd, float w, float b) {
    return __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(x, mean), invstd), w), b);
}

// NCHW: element e is in channel (e / S) % C; a float4 (S % 4 == 0) stays inside one row.
template <int VEC>
__device__ __forceinline__ void y_nchw(const act_t* __restrict__ x, const float* __restrict__ mean,
                                       const float* __restrict__ invstd, const float* __restrict__ weight,
                                       const float* __restrict__ bias, long long nvec, int C, long long S,
                                       act_t* __restrict__ y) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
        const long long e = i * VEC;
        const int c = (int)((e / S) % C);
        const float mc = mean[c], ic = invstd[c];
        const float w = weight != nullptr ? weight[c] : 1.0f, b = bias != nullptr ? bias[c] : 0.0f;
        float xv[4], r[4];
        load_act<VEC>(x + e, xv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) r[j] = y_of(xv[j], mc, ic, w, b);
        store_act<VEC>(y + e, r);
    }
}

extern "C" __global__ void __launch_bounds__(BN_THREADS)
bn_fwd_y_nchw(const act_t* __restrict__ x, const float* __restrict__ mean, const float* __restrict__ invstd,
              const float* __restrict__ weight, const float* __restrict__ bias, long long nvec, int C, long long S,
              int vec, act_t* __restrict__ y) {
    if (vec == 4) y_nchw<4>(x, mean, invstd, weight, bias, nvec, C, S, y);
    else y_nchw<1>(x, mean, invstd, weight, bias, nvec, C, S, y);
}

// rows: block (TX, TY) over rows [blockIdx.x * RB, ...) of column tile blockIdx.y, as bn_bwd_dx_rows.
template <int VEC>
__device__ __forceinline__ void y_rows(const act_t* __restrict__ x, const float* __restrict__ mean,
                                       const float* __restrict__ invstd, const float* __restrict__ weight,
                                       const float* __restrict__ bias, long long R, int C, long long RB,
                                       act_t* __restrict__ y) {
    const int col0 = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (col0 >= C) return;  // C % VEC == 0: a thread's columns are all in range or all out
    float mc[4], ic[4], w[4], b[4];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        mc[j] = mean[col0 + j];
        ic[j] = invstd[col0 + j];
        w[j] = weight != nullptr ? weight[col0 + j] : 1.0f;
        b[j] = bias != nullptr ? bias[col0 + j] : 0.0f;
    }
    const long long r0 = (long long)blockIdx.x * RB, r1 = r0 + RB < R ? r0 + RB : R;
    for (long long r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
        const long long o = r * C + col0;
        float xv[4], res[4];
        load_act<VEC>(x + o, xv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) res[j] = y_of(xv[j], mc[j], ic[j], w[j], b[j]);
        store_act<VEC>(y + o, res);
    }
}

extern "C" __global__ void __launch_bounds__(BN_THREADS)
bn_fwd_y_rows(const act_t* __restrict__ x, const float* __restrict__ mean, const float* __restrict__ invstd,
              const float* __restrict__ weight, const float* __restrict__ bias, long long R, int C, long long RB,
              int vec, act_t* __restrict__ y) {
    if (vec == 4) y_rows<4>(x, mean, invstd, weight, bias, R, C, RB, y);
    else y_rows<1>(x, mean, invstd, weight, bias, R, C, RB, y);
}
