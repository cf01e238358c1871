// conv_wgrad_winograd.cu: weight gradient of a 3x3, stride-1, undilated convolution by Winograd's
// minimal filtering F(3, 2) in each spatial dimension. Launchers and CPU order model:
// kernels/conv_wgrad_winograd.py.
//
// dw[co, ci, r, s] = sum over (n, oh, ow) of dy[n, co, oh, ow] * x[n, ci, oh + r - ph, ow + s - pw]. Cut the
// output pixels into 2x2 tiles t = (n, P, Q) (dy rows 2P..2P+1, cols 2Q..2Q+1, zero past the edge); a
// tile's share of dw[co, ci] is the 3x3 correlation of a 4x4 input patch d (rows 2P - ph .. 2P - ph + 3)
// with the 2x2 dy tile g, which F(3, 2) computes with 16 products instead of 36:
//     share = G^T [ (A g A^T) (.) (B^T d B) ] G,
//     A = [1 0; 1 1; 1 -1; 0 -1] (4x2),  B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1],
//     G^T = [1 .5 .5 0; 0 .5 -.5 0; 0 .5 .5 1] (3x4).
// The output transform is linear, so it is applied once, after summing over tiles: with
//     U[xi][t][co] = (A g A^T)[xi],  V[xi][t][ci] = (B^T d B)[xi]   (xi = 4a + b, 16 of them),
//     M[xi][co][ci] = sum_t U[xi][t][co] * V[xi][t][ci]             (16 GEMMs, reduction over tiles),
//     dw[co][ci] = G^T M[.][co][ci] G.
// 2.25x fewer multiply-adds than the direct sum, paid for with transform traffic (U and V are 16/4 = 4x
// the size of dy and x), which cuDNN's Winograd filter-gradient algorithms pay too.
//
// Determinism: the GEMM cuts the tile axis into S chunks exactly as the direct kernels cut theirs (a
// plan that depends only on the shapes); every block stores its chunk partial to a workspace and
// wino_wgrad_output sums the S partials of an element in tree's fixed order (8 strided groups, then the
// group sums), then applies G. No atomics, no value depends on timing: bitwise reproducible.
//
// Arithmetic, in the order the CPU model reproduces (kernels/conv_wgrad_winograd.py):
//   V rows then columns, each  e0 - e2, e1 + e2, e2 - e1, e1 - e3;
//   U rows then columns, each  e0, e0 + e1, e0 - e1, -e1;
//   M per chunk with FFMA (the only part a CPU cannot reproduce bit for bit), combine as above;
//   G rows then columns, each  e0 + h*(e1 + e2), h*(e1 - e2), h*(e1 + e2) + e3 with h = 0.5 (the
//   products are exact; __fmul_rn keeps them from being contracted into an FMA).

#include "common.cuh"  // ordered_combine, fma_step, winograd_input_transform

#define WN_THREADS 256
#define WN_BK 16

// ------------------------------------------------------------------------------------------------
// Transforms. One thread per (tile, channel), channels fastest: the 16 stores of a warp (one per xi)
// are each 32 consecutive floats. Rows of U and V are padded to a multiple of 4 floats (zeros) so the
// GEMM can load them as float4.

extern "C" __global__ void __launch_bounds__(WN_THREADS)
wino_wgrad_input(const float* __restrict__ x, float* __restrict__ V, int cin, int h, int w, int ph, int pw,
                 int tp, int tq, int T, int cp, long long sxn, long long sxc, long long sxh, long long sxw) {
    const long long total = (long long)T * cp, plane = (long long)T * cp;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(e % cp);
        const int t = (int)(e / cp);
        const int n = t / (tp * tq), l = t - n * (tp * tq), P = l / tq, Q = l - P * tq;
        const int h0 = 2 * P - ph, w0 = 2 * Q - pw;
        float d[4][4];
        const float* xc = x + n * sxn + (long long)c * sxc;
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int ih = h0 + i, iw = w0 + j;
                const bool ok = c < cin && (unsigned)ih < (unsigned)h && (unsigned)iw < (unsigned)w;
                d[i][j] = ok ? __ldg(xc + ih * sxh + iw * sxw) : 0.0f;
            }
        winograd_input_transform(d, V + (long long)t * cp + c, plane);
    }
}

extern "C" __global__ void __launch_bounds__(WN_THREADS)
wino_wgrad_dy(const float* __restrict__ dy, float* __restrict__ U, int cout, int oh, int ow, int tp, int tq,
              int T, int kp, long long sdn, long long sdc, long long sdh, long long sdw) {
    const long long total = (long long)T * kp, plane = (long long)T * kp;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const int k = (int)(e % kp);
        const int t = (int)(e / kp);
        const int n = t / (tp * tq), l = t - n * (tp * tq), P = l / tq, Q = l - P * tq;
        const float* dk = dy + n * sdn + (long long)k * sdc;
        float g[2][2];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int y = 2 * P + i, z = 2 * Q + j;
                g[i][j] = (k < cout && y < oh && z < ow) ? __ldg(dk + y * sdh + z * sdw) : 0.0f;
            }
        float r[4][2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {  // A g: along rows
            r[0][j] = g[0][j];
            r[1][j] = g[0][j] + g[1][j];
            r[2][j] = g[0][j] - g[1][j];
            r[3][j] = -g[1][j];
        }
        float* out = U + (long long)t * kp + k;
#pragma unroll
        for (int a = 0; a < 4; ++a) {  // (A g) A^T: along columns
            out[(4 * a + 0) * plane] = r[a][0];
            out[(4 * a + 1) * plane] = r[a][0] + r[a][1];
            out[(4 * a + 2) * plane] = r[a][0] - r[a][1];
            out[(4 * a + 3) * plane] = -r[a][1];
        }
    }
}

// ------------------------------------------------------------------------------------------------
// The 16 GEMMs: block (c-tile, k-tile, xi * S + s) computes the chunk-s partial of M[xi]'s BMxBN tile,
// sum over t in [s*Tc, min(T, (s+1)*Tc)) of U[xi][t][k] * V[xi][t][c], with FFMA in registers, and stores
// it to part[xi][s][k][c]. U and V rows are contiguous in k and c, so a K-step's tiles are plain float4
// copies into shared memory (two buffers, register prefetch of the next step).

template <int BM, int BN, int TM, int TN>
__device__ __forceinline__ void wino_gemm(const float* __restrict__ U, const float* __restrict__ V,
                                          float* __restrict__ part, int T, int kp, int cp, int K, int C,
                                          int Tc, int S) {
    constexpr int AV = BM / 4, BV = BN / 4;                     // float4s per tile row
    constexpr int AL = WN_BK * AV / WN_THREADS, BL = WN_BK * BV / WN_THREADS;  // float4 loads per thread
    static_assert(AL >= 1 && BL >= 1, "tile too small for the block");
    constexpr int GM = BM * 4 / TM, GN = BN * 4 / TN;
    __shared__ __align__(16) float As[2][WN_BK][BM + 4];
    __shared__ __align__(16) float Bs[2][WN_BK][BN + 4];

    const int t = threadIdx.x;
    const int tx = t % (BN / TN), ty = t / (BN / TN);
    const int xi = blockIdx.z / S, s = blockIdx.z - xi * S;
    const int c0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    const int tbeg = s * Tc, tend = min(T, tbeg + Tc);
    const float* A = U + (long long)xi * T * kp;
    const float* B = V + (long long)xi * T * cp;

    float4 ra[AL], rb[BL];
    auto load = [&](int k0) {
#pragma unroll
        for (int i = 0; i < AL; ++i) {
            const int j = t + i * WN_THREADS, row = j / AV, col = m0 + (j - row * AV) * 4;
            const int tt = k0 + row;
            ra[i] = (tt < tend && col < kp) ? __ldg(reinterpret_cast<const float4*>(A + (long long)tt * kp + col))
                                           : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int i = 0; i < BL; ++i) {
            const int j = t + i * WN_THREADS, row = j / BV, col = c0 + (j - row * BV) * 4;
            const int tt = k0 + row;
            rb[i] = (tt < tend && col < cp) ? __ldg(reinterpret_cast<const float4*>(B + (long long)tt * cp + col))
                                           : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    auto store = [&](int buf) {
#pragma unroll
        for (int i = 0; i < AL; ++i) {
            const int j = t + i * WN_THREADS, row = j / AV, col = (j - row * AV) * 4;
            *reinterpret_cast<float4*>(&As[buf][row][col]) = ra[i];
        }
#pragma unroll
        for (int i = 0; i < BL; ++i) {
            const int j = t + i * WN_THREADS, row = j / BV, col = (j - row * BV) * 4;
            *reinterpret_cast<float4*>(&Bs[buf][row][col]) = rb[i];
        }
    };

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;

    const int steps = (tend - tbeg + WN_BK - 1) / WN_BK;
    load(tbeg);
    store(0);
    __syncthreads();
    for (int st = 0; st < steps; ++st) {
        const int buf = st & 1;
        const bool more = st + 1 < steps;
        if (more) load(tbeg + (st + 1) * WN_BK);
#pragma unroll
        for (int q = 0; q < WN_BK; ++q) fma_step<TM, TN, GM, GN>(As[buf][q], Bs[buf][q], ty, tx, acc);
        if (more) store(buf ^ 1);
        __syncthreads();
    }

    float* dst = part + ((long long)xi * S + s) * K * C;
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int m = m0 + (i / 4) * GM + ty * 4 + (i % 4);
        if (m >= K) continue;
#pragma unroll
        for (int g = 0; g < TN / 4; ++g) {
            const int c = c0 + g * GN + tx * 4;
            if (c + 3 < C && (C & 3) == 0) {
                __stcg(reinterpret_cast<float4*>(dst + (long long)m * C + c),
                       make_float4(acc[i][4 * g], acc[i][4 * g + 1], acc[i][4 * g + 2], acc[i][4 * g + 3]));
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (c + j < C) dst[(long long)m * C + c + j] = acc[i][4 * g + j];
            }
        }
    }
}

#define WN_GEMM(name, BM, BN, TM, TN, MINB)                                                             \
    extern "C" __global__ void __launch_bounds__(WN_THREADS, MINB)                                      \
    name(const float* U, const float* V, float* part, int T, int kp, int cp, int K, int C, int Tc, int S) { \
        wino_gemm<BM, BN, TM, TN>(U, V, part, T, kp, cp, K, C, Tc, S);                                  \
    }

WN_GEMM(wino_wgrad_gemm_t128, 128, 128, 8, 8, 2)
WN_GEMM(wino_wgrad_gemm_t64, 64, 64, 4, 4, 3)

// ------------------------------------------------------------------------------------------------
// Fixed-order combine of the S partials and the output transform. A block covers 32 consecutive
// elements e = co * C + ci with 16 warps, warp xi summing the partials of M[xi] (s = g, g + 8, ... in
// order from +0.0 per group g, then the 8 group sums in order from +0.0; S = 1: the partial itself, as
// tree stores it). Then thread (e, o) of the first 288 writes dw[e * 9 + o] (o = 3r + s'), coalesced.

__device__ __forceinline__ void g_transform(float e0, float e1, float e2, float e3, float& o0, float& o1,
                                            float& o2) {
    const float u = e1 + e2, v = e1 - e2;
    const float hu = __fmul_rn(0.5f, u);  // exact; __fmul_rn is never contracted with the addition
    o0 = e0 + hu;
    o1 = __fmul_rn(0.5f, v);
    o2 = hu + e3;
}

extern "C" __global__ void __launch_bounds__(512)
wino_wgrad_output(const float* __restrict__ part, float* __restrict__ dw, int K, int C, int S) {
    __shared__ float M[32][17];
    const int lane = threadIdx.x & 31, xi = threadIdx.x >> 5;
    const long long KC = (long long)K * C;
    const long long e = (long long)blockIdx.x * 32 + lane;
    float m = 0.0f;
    if (e < KC) {
        const float* p = part + (long long)xi * S * KC + e;
        if (S == 1) {
            m = __ldcg(p);
        } else {
            m = ordered_combine(p, S, KC);
        }
    }
    M[lane][xi] = m;
    __syncthreads();
    const int t = threadIdx.x;
    if (t >= 32 * 9) return;
    const int el = t / 9, o = t - el * 9, r = o / 3, sc = o - r * 3;
    const long long e2 = (long long)blockIdx.x * 32 + el;
    if (e2 >= KC) return;
    const float* mm = M[el];
    float z[4];  // row r of G^T M: one entry per column b
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        float o0, o1, o2;
        g_transform(mm[b], mm[4 + b], mm[8 + b], mm[12 + b], o0, o1, o2);
        z[b] = r == 0 ? o0 : (r == 1 ? o1 : o2);
    }
    float w0, w1, w2;
    g_transform(z[0], z[1], z[2], z[3], w0, w1, w2);
    dw[e2 * 9 + o] = sc == 0 ? w0 : (sc == 1 ? w1 : w2);
}
