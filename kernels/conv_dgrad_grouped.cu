// conv_dgrad_grouped.cu: data gradient of a grouped 2-D convolution (depthwise included), float32.
//
//   dx[n, ci, h, w] = sum over cog < Cout_g, taps (kh, kw) with h = oh*sh - ph + kh*dh, w = ow*sw - pw + kw*dw
//                     for some dy position (oh, ow):  dy[n, g*Cout_g + cog, oh, ow] * w[g*Cout_g + cog, cig, kh, kw]
//   with g = ci / Cin_g, cig = ci % Cin_g.
//
// Variants (kernels/conv_dgrad_grouped.py launches them and holds their CPU order models):
//   tree    gather: one thread per dx element adds its terms in a fixed order (cog ascending, then kh,
//           then kw, skipping taps that reach no dy position) into +0.0, each term one float32 product
//           (__fmul_rn) and one float32 addition (__fadd_rn), and writes the element once. No atomics,
//           no workspace: deterministic, and the bits do not depend on the layout or the launch shape.
//   atomic  scatter (cuDNN's ALGO_0 style): one thread per dy element multiplies it by each of its
//           Cin_g * KH * KW weights and atomicAdds the products into dx (zeroed first). Where windows
//           overlap (kernel extent > stride) or Cout_g > 1, several products meet in one dx element in
//           arrival order: nondeterministic. For depthwise convs the gather is the natural kernel and
//           needs no atomics, so this variant exists as the nondeterministic baseline of the pair (the
//           one a scatter implementation gives), not because the op needs it.
// Mapping (speed only; the order above is per element): channels are tiled by CT (a power of two
// <= 32) and lane l of a warp serves channel l % CT of the tile and position lane l / CT; NCHW uses
// CT = 1 (lanes along w), channels_last CT = min(32, next power of two >= C) (lanes along channels).
// blockIdx.x covers positions (a chunk of P * ITEMS), blockIdx.y channel tiles. Depthwise convs
// (Cout_g = 1 for the gather, Cin_g = 1 for the scatter) with at most TK taps keep the channel's weights
// in registers. 32-bit indices (the launcher refuses tensors of 2^31 elements or more).

#define GD_THREADS 256
#define GD_WARPS 8

struct GdArgs {
    int N, Cin, H, W, Cout, OH, OW, KH, KW, sh, sw, ph, pw, dh, dw, cin_g, cout_g;
    int sdn, sdc, sdh, sdw;      // element strides of dy
    int sxn, sxc, sxh, sxw;      // element strides of dx
    int swo, swi, swh, sww;      // element strides of w
    int ct_log2, chunk, channels;  // chunk: positions per block
};

// Position lane of this thread, its channel, and the block's position range.
struct Lanes {
    int c, p, P, k0, k1;
};

__device__ __forceinline__ Lanes lanes_of(const GdArgs& a, int positions) {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int CT = 1 << a.ct_log2, Q = 32 >> a.ct_log2;
    Lanes L;
    L.c = blockIdx.y * CT + (lane & (CT - 1));
    L.P = GD_WARPS * Q;
    L.p = warp * Q + (lane >> a.ct_log2);
    L.k0 = blockIdx.x * a.chunk;
    L.k1 = min(positions, L.k0 + a.chunk);
    return L;
}

// tree: TK > 0 depthwise with the channel's TK (or fewer) weights in registers; TK == 0 any grouping.
// S1: stride 1 in both axes (no divisibility tests).
// Strided: a tap reaches a dy row when t = h + ph - kh*dh is a non-negative multiple of sh. With
// h + ph = qh*sh + rh and kh*dh = q*sh + m (0 <= rh, m < sh) that is m == rh, and then oh = qh - q (t >= 0
// exactly when oh >= 0); the same along w. So one division per axis and element, none per tap, finds the
// same taps as dividing each t, and they are added in the same order: the bits do not change.
template <int TK, bool S1>
__device__ __forceinline__ void dgrad_gather(const float* __restrict__ dy, const float* __restrict__ w,
                                             float* __restrict__ dx, const GdArgs& a) {
    constexpr int TR = TK > 0 ? TK : 1;
    constexpr int TM = TK > 0 && !S1 ? TK : 1;
    // depthwise, tap i (row-major taps): kh*dh and kw*dw (stride 1), or their quotients by the stride and,
    // in s_mh and s_mw, the remainders (strided)
    __shared__ int s_kh[TR], s_kw[TR], s_mh[TM], s_mw[TM];
    const int KK = a.KH * a.KW;
    if (TK > 0 && threadIdx.x < min(KK, TR)) {
        const int kh = threadIdx.x / a.KW, kw = threadIdx.x - kh * a.KW;
        if (S1) {
            s_kh[threadIdx.x] = kh * a.dh;
            s_kw[threadIdx.x] = kw * a.dw;
        } else {
            s_kh[threadIdx.x] = kh * a.dh / a.sh;
            s_kw[threadIdx.x] = kw * a.dw / a.sw;
            s_mh[min(threadIdx.x, TM - 1)] = kh * a.dh % a.sh;
            s_mw[min(threadIdx.x, TM - 1)] = kw * a.dw % a.sw;
        }
    }
    if (TK > 0) __syncthreads();
    const int HW = a.H * a.W;
    const Lanes L = lanes_of(a, a.N * HW);
    if (L.c >= a.channels) return;
    const int ci = L.c, g = ci / a.cin_g, cig = ci - g * a.cin_g;
    float wr[TR];
#pragma unroll
    for (int i = 0; i < TR; ++i) {
        if (TK > 0 && i < KK) {
            const int kh = i / a.KW, kw = i - kh * a.KW;
            wr[i] = __ldg(w + g * a.swo + cig * a.swi + kh * a.swh + kw * a.sww);
        } else {
            wr[i] = 0.0f;
        }
    }
    int k = L.k0 + L.p;
    if (k >= L.k1) return;
    int n = k / HW, l = k - n * HW, h = l / a.W, x = l - h * a.W;
    const int dn = L.P / HW, dl = L.P - dn * HW, dh_ = dl / a.W, dw_ = dl - dh_ * a.W;
    // strided: the quotient and remainder of one dilation step by the stride (see above), per axis
    const int dqh = S1 ? 0 : a.dh / a.sh, dmh = S1 ? 0 : a.dh - dqh * a.sh;
    const int dqw = S1 ? 0 : a.dw / a.sw, dmw = S1 ? 0 : a.dw - dqw * a.sw;
    for (; k < L.k1; k += L.P) {
        float acc = 0.0f;
        const int th0 = h + a.ph, tw0 = x + a.pw;
        // strided: h + ph = qh*sh + rh, x + pw = qw*sw + rw (both non-negative)
        const int qh = S1 ? th0 : th0 / a.sh, rh = S1 ? 0 : th0 - qh * a.sh;
        const int qw = S1 ? tw0 : tw0 / a.sw, rw = S1 ? 0 : tw0 - qw * a.sw;
        if (TK > 0) {  // Cout_g = 1 (depthwise): taps i ascending = (kh, kw) row-major
            const float* __restrict__ dyc = dy + n * a.sdn + g * a.sdc;
#pragma unroll
            for (int i = 0; i < TR; ++i) {
                if (i < KK) {
                    const int oh = qh - s_kh[i], ow = qw - s_kw[i];
                    const bool ok = S1 || (s_mh[min(i, TM - 1)] == rh && s_mw[min(i, TM - 1)] == rw);
                    if (ok && (unsigned)oh < (unsigned)a.OH && (unsigned)ow < (unsigned)a.OW)
                        acc = __fadd_rn(acc, __fmul_rn(__ldg(dyc + oh * a.sdh + ow * a.sdw), wr[i]));
                }
            }
        } else {
            for (int cog = 0; cog < a.cout_g; ++cog) {
                const int co = g * a.cout_g + cog;
                const float* __restrict__ dyc = dy + n * a.sdn + co * a.sdc;
                const float* __restrict__ wc = w + co * a.swo + cig * a.swi;
                // kh*dh = q*sh + m, stepped along kh (stride 1: q = kh*dh, m = 0)
                for (int kh = 0, q = 0, m = 0; kh < a.KH; ++kh) {
                    const int oh = qh - q;
                    const bool ok = m == rh;
                    if (S1) {
                        q += a.dh;
                    } else {
                        q += dqh;
                        m += dmh;
                        if (m >= a.sh) { m -= a.sh; ++q; }
                    }
                    if (!ok || (unsigned)oh >= (unsigned)a.OH) continue;
                    const float* __restrict__ row = dyc + oh * a.sdh;
                    for (int kw = 0, qk = 0, mk = 0; kw < a.KW; ++kw) {
                        const int ow = qw - qk;
                        const bool okw = mk == rw;
                        if (S1) {
                            qk += a.dw;
                        } else {
                            qk += dqw;
                            mk += dmw;
                            if (mk >= a.sw) { mk -= a.sw; ++qk; }
                        }
                        if (!okw || (unsigned)ow >= (unsigned)a.OW) continue;
                        acc = __fadd_rn(acc, __fmul_rn(__ldg(row + ow * a.sdw), __ldg(wc + kh * a.swh + kw * a.sww)));
                    }
                }
            }
        }
        dx[n * a.sxn + ci * a.sxc + h * a.sxh + x * a.sxw] = acc;
        x += dw_;
        if (x >= a.W) { x -= a.W; ++h; }
        h += dh_;
        if (h >= a.H) { h -= a.H; ++n; }
        n += dn;
    }
}

// atomic: one thread per dy element (n, co, oh, ow); products atomicAdd-ed into dx, cig then (kh, kw)
// ascending in issue order (arrival order is the scheduler's). TK > 0: Cin_g = 1, weights in registers.
template <int TK>
__device__ __forceinline__ void dgrad_scatter(const float* __restrict__ dy, const float* __restrict__ w,
                                              float* __restrict__ dx, const GdArgs& a) {
    constexpr int TR = TK > 0 ? TK : 1;
    __shared__ int s_kh[TR], s_kw[TR];  // depthwise: kh*dh - ph and kw*dw - pw of tap i
    const int KK = a.KH * a.KW;
    if (TK > 0 && threadIdx.x < min(KK, TR)) {
        const int kh = threadIdx.x / a.KW, kw = threadIdx.x - kh * a.KW;
        s_kh[threadIdx.x] = kh * a.dh - a.ph;
        s_kw[threadIdx.x] = kw * a.dw - a.pw;
    }
    if (TK > 0) __syncthreads();
    const int ohw = a.OH * a.OW;
    const Lanes L = lanes_of(a, a.N * ohw);
    if (L.c >= a.channels) return;
    const int co = L.c, g = co / a.cout_g;
    float wr[TR];
#pragma unroll
    for (int i = 0; i < TR; ++i) {
        if (TK > 0 && i < KK) {
            const int kh = i / a.KW, kw = i - kh * a.KW;
            wr[i] = __ldg(w + co * a.swo + kh * a.swh + kw * a.sww);
        } else {
            wr[i] = 0.0f;
        }
    }
    int k = L.k0 + L.p;
    if (k >= L.k1) return;
    int n = k / ohw, l = k - n * ohw, oh = l / a.OW, ow = l - oh * a.OW;
    const int dn = L.P / ohw, dl = L.P - dn * ohw, doh = dl / a.OW, dow = dl - doh * a.OW;
    for (; k < L.k1; k += L.P) {
        const float gy = __ldg(dy + n * a.sdn + co * a.sdc + oh * a.sdh + ow * a.sdw);
        if (TK > 0) {  // depthwise (Cin_g = 1)
            float* __restrict__ dxc = dx + n * a.sxn + g * a.sxc;
#pragma unroll
            for (int i = 0; i < TR; ++i) {
                if (i < KK) {
                    const int h = oh * a.sh + s_kh[i], x = ow * a.sw + s_kw[i];
                    if ((unsigned)h < (unsigned)a.H && (unsigned)x < (unsigned)a.W)
                        atomicAdd(dxc + h * a.sxh + x * a.sxw, __fmul_rn(gy, wr[i]));  // arrival order
                }
            }
        } else {
            for (int cig = 0; cig < a.cin_g; ++cig) {
                float* __restrict__ dxc = dx + n * a.sxn + (g * a.cin_g + cig) * a.sxc;
                const float* __restrict__ wc = w + co * a.swo + cig * a.swi;
                for (int kh = 0; kh < a.KH; ++kh) {
                    const int h = oh * a.sh - a.ph + kh * a.dh;
                    if ((unsigned)h >= (unsigned)a.H) continue;
                    for (int kw = 0; kw < a.KW; ++kw) {
                        const int x = ow * a.sw - a.pw + kw * a.dw;
                        if ((unsigned)x >= (unsigned)a.W) continue;
                        atomicAdd(dxc + h * a.sxh + x * a.sxw, __fmul_rn(gy, __ldg(wc + kh * a.swh + kw * a.sww)));
                    }
                }
            }
        }
        ow += dow;
        if (ow >= a.OW) { ow -= a.OW; ++oh; }
        oh += doh;
        if (oh >= a.OH) { oh -= a.OH; ++n; }
        n += dn;
    }
}

#define GD_PARAMS                                                                                     \
    const float* dy, const float* w, float* dx, int N, int Cin, int H, int W, int Cout, int OH, int OW, \
        int KH, int KW, int sh, int sw, int ph, int pw, int dh, int dw, int cin_g, int cout_g, int sdn,  \
        int sdc, int sdh, int sdw, int sxn, int sxc, int sxh, int sxw, int swo, int swi, int swh,        \
        int sww, int ct_log2, int chunk, int channels
#define GD_ARGS                                                                                         \
    {N, Cin, H, W, Cout, OH, OW, KH, KW, sh, sw, ph, pw, dh, dw, cin_g, cout_g, sdn, sdc, sdh, sdw, sxn, \
     sxc, sxh, sxw, swo, swi, swh, sww, ct_log2, chunk, channels}
#define GD_GATHER(name, TK, S1)                                                \
    extern "C" __global__ void __launch_bounds__(GD_THREADS) name(GD_PARAMS) { \
        const GdArgs a = GD_ARGS;                                              \
        dgrad_gather<TK, S1>(dy, w, dx, a);                                    \
    }
#define GD_SCATTER(name, TK)                                                   \
    extern "C" __global__ void __launch_bounds__(GD_THREADS) name(GD_PARAMS) { \
        const GdArgs a = GD_ARGS;                                              \
        dgrad_scatter<TK>(dy, w, dx, a);                                       \
    }

GD_GATHER(conv_dgrad_grouped_tree_t9_s1, 9, true)
GD_GATHER(conv_dgrad_grouped_tree_t25_s1, 25, true)
GD_GATHER(conv_dgrad_grouped_tree_t49_s1, 49, true)
GD_GATHER(conv_dgrad_grouped_tree_t0_s1, 0, true)
GD_GATHER(conv_dgrad_grouped_tree_t9_sn, 9, false)
GD_GATHER(conv_dgrad_grouped_tree_t25_sn, 25, false)
GD_GATHER(conv_dgrad_grouped_tree_t49_sn, 49, false)
GD_GATHER(conv_dgrad_grouped_tree_t0_sn, 0, false)
GD_SCATTER(conv_dgrad_grouped_atomic_t9, 9)
GD_SCATTER(conv_dgrad_grouped_atomic_t25, 25)
GD_SCATTER(conv_dgrad_grouped_atomic_t49, 49)
GD_SCATTER(conv_dgrad_grouped_atomic_t0, 0)
