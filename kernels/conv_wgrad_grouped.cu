// conv_wgrad_grouped.cu: weight gradient of a grouped 2-D convolution (depthwise included), float32.
//
//   dw[co, cig, kh, kw] = sum_{n, oh, ow} dy[n, co, oh, ow] * x[n, g*Cin_g + cig, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw]
//   with g = co / Cout_g; terms whose x position lies in the padding are skipped (they are zero).
//
// Variants (kernels/conv_wgrad_grouped.py launches them and holds their CPU order models):
//   atomic  each block reduces its chunk of the N*OH*OW reduction to one partial per dw element and
//           atomicAdds it into dw (zeroed first): the S partials of an element meet in arrival order,
//           nondeterministic run to run (the split-reduction scheme of cuDNN's fast algorithms).
//   tree    the same blocks and partials, written to a workspace; the last block of each channel tile
//           (ticket counters) combines the S partials in a fixed order and writes dw once:
//           deterministic, same launch count as atomic, no memset of dw.
//
// Work decomposition (the same in both variants, a function of the shapes and the plan only):
//   A "pair" e = co * Cin_g + cig is one (output channel, input channel of its group); depthwise convs
//   have one pair per channel. Pairs are tiled by CT (a power of two <= 32): lane l of a warp serves
//   pair ch = l % CT of the tile and position lane q = l / CT; with 8 warps a block has P = 8 * 32 / CT
//   position lanes p = warp * (32 / CT) + q. NCHW inputs use CT = 1 (lanes along ow: coalesced),
//   channels_last CT = min(32, next power of two >= pairs) (lanes along channels: coalesced).
//   blockIdx = (channel tile, split s, tap group): block (tile, s) reduces positions k in
//   [s * chunk, min(K, (s + 1) * chunk)), k = (n * OH + oh) * OW + ow, for up to TK taps.
// Accumulation order of one dw element (what the CPU models reproduce bit for bit):
//   1. position lane p adds the terms of k = k0 + p, k0 + p + P, ... in that order into +0.0, each
//      term one float32 product (__fmul_rn) and one float32 addition (__fadd_rn): no FMA contraction;
//   2. halving tree over the 32 / CT position lanes of a warp (shuffles at lane offsets 16 .. CT);
//   3. the 8 warp sums: ((w0 + w4) + (w2 + w6)) + ((w1 + w5) + (w3 + w7)) (a halving tree);
//   4. the S block partials: atomic in arrival order (atomicAdd, which flushes subnormals); tree: lane
//      l of one warp adds partials l, l + 32, ... in order into +0.0, then a halving tree over the 32
//      lanes (warp_reduce). S = 1: tree stores the block partial itself.
// 32-bit indices (the launcher refuses tensors of 2^31 elements or more); tensors are read through
// their element strides, so NCHW, channels_last and other strided inputs all work.

#include "common.cuh"  // arrive_last, warp_reduce

#define GW_THREADS 256
#define GW_WARPS 8

struct GwArgs {
    int N, Cin, H, W, Cout, OH, OW, KH, KW, sh, sw, ph, pw, dh, dw, cin_g, cout_g;
    int sxn, sxc, sxh, sxw, sdn, sdc, sdh, sdw;  // element strides of x and dy
    int ct_log2, S, chunk, pairs;
};

// TK: taps a block handles (9, 25 or 49; a kernel with more taps is cut into tap groups of TK).
// MODE 0: atomic. MODE 1: tree (workspace + last-block fixed-order combine).
template <int TK, int MODE>
__device__ __forceinline__ void wgrad_grouped(const float* __restrict__ x, const float* __restrict__ dy,
                                              float* __restrict__ out, float* __restrict__ ws,
                                              unsigned int* __restrict__ counters, const GwArgs& a) {
    constexpr int CTMAX = TK > 25 ? 16 : 32;  // keeps red[] within 26 KB of shared memory
    __shared__ int s_oh[TK], s_ow[TK];        // tap offsets kh*dh - ph, kw*dw - pw of this tap group
    __shared__ float red[GW_WARPS * CTMAX * TK];
    __shared__ bool last;

    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int CT = 1 << a.ct_log2, Q = 32 >> a.ct_log2, P = GW_WARPS * Q;
    const int ch = lane & (CT - 1), q = lane >> a.ct_log2;
    const int p = warp * Q + q;
    const int tile = blockIdx.x, s = blockIdx.y, tg = blockIdx.z;
    const int KK = a.KH * a.KW, tap0 = tg * TK, ntap = min(TK, KK - tap0);
    if (t < ntap) {
        const int tap = tap0 + t, kh = tap / a.KW, kw = tap - kh * a.KW;
        s_oh[t] = kh * a.dh - a.ph;
        s_ow[t] = kw * a.dw - a.pw;
    }
    __syncthreads();

    const int e = tile * CT + ch;
    const bool eok = e < a.pairs;
    const int co = eok ? e / a.cin_g : 0;
    const int cx = eok ? (co / a.cout_g) * a.cin_g + (e - co * a.cin_g) : 0;
    const float* __restrict__ xc = x + cx * a.sxc;
    const float* __restrict__ dc = dy + co * a.sdc;

    float acc[TK];
#pragma unroll
    for (int i = 0; i < TK; ++i) acc[i] = 0.0f;

    const int ohw = a.OH * a.OW, K = a.N * ohw;
    const int k0 = s * a.chunk, k1 = min(K, k0 + a.chunk);
    int k = k0 + p;
    if (eok && k < k1) {
        // (n, oh, ow) of k, then advanced by P positions with carries (no division in the loop)
        int n = k / ohw, l = k - n * ohw, oh = l / a.OW, ow = l - oh * a.OW;
        const int dn = P / ohw, dl = P - dn * ohw, doh = dl / a.OW, dow = dl - doh * a.OW;
        for (; k < k1; k += P) {
            const float gy = __ldg(dc + n * a.sdn + oh * a.sdh + ow * a.sdw);
            const float* __restrict__ xn = xc + n * a.sxn;
            const int ih0 = oh * a.sh, iw0 = ow * a.sw;
#pragma unroll
            for (int i = 0; i < TK; ++i) {
                if (i < ntap) {
                    const int ih = ih0 + s_oh[i], iw = iw0 + s_ow[i];
                    if ((unsigned)ih < (unsigned)a.H && (unsigned)iw < (unsigned)a.W)
                        acc[i] = __fadd_rn(acc[i], __fmul_rn(gy, __ldg(xn + ih * a.sxh + iw * a.sxw)));
                }
            }
            ow += dow;
            if (ow >= a.OW) { ow -= a.OW; ++oh; }
            oh += doh;
            if (oh >= a.OH) { oh -= a.OH; ++n; }
            n += dn;
        }
    }

    // 2. halving tree over the position lanes of the warp: lane offsets 16, 8, ..., CT
    for (int off = 16; off >= CT; off >>= 1) {
#pragma unroll
        for (int i = 0; i < TK; ++i) acc[i] += __shfl_down_sync(FULL_MASK, acc[i], off);
    }
    if (lane < CT) {
#pragma unroll
        for (int i = 0; i < TK; ++i)
            if (i < ntap) red[(warp * CT + lane) * TK + i] = acc[i];
    }
    __syncthreads();

    // 3. the 8 warp sums of each (pair, tap) of the tile, a halving tree; 4. atomic / store / workspace
    const int ticket = tg * gridDim.x + tile;
    const int S = a.S;
    for (int el = t; el < CT * ntap; el += GW_THREADS) {
        const int c = el / ntap, i = el - c * ntap;
        const float* v = red + c * TK + i;
        const int st = CT * TK;  // stride between the warps' entries
        const float r = ((v[0] + v[4 * st]) + (v[2 * st] + v[6 * st])) + ((v[st] + v[5 * st]) + (v[3 * st] + v[7 * st]));
        const int e2 = tile * CT + c;
        if (e2 >= a.pairs) continue;
        const int at = e2 * KK + tap0 + i;
        if (MODE == 0) {
            atomicAdd(out + at, r);  // arrival order decides the rounding
        } else if (S == 1) {
            out[at] = r;
        } else {
            __stcg(ws + ((long long)ticket * S + s) * (CT * TK) + c * TK + i, r);
        }
    }
    if (MODE == 0 || S == 1) return;

    __threadfence();  // this thread's partials are visible device-wide before the ticket is drawn
    __syncthreads();
    if (t == 0) last = arrive_last(counters + ticket, (unsigned)S);
    __syncthreads();
    if (!last) return;
    // The last block of the tile: warp w combines elements w, w + 8, ...; lane l adds partials
    // s = l, l + 32, ... in order from +0.0, then warp_reduce (halving tree, lane 0 holds the sum).
    const float* base = ws + (long long)ticket * S * (CT * TK);
    for (int el = warp; el < CT * ntap; el += GW_WARPS) {
        const int c = el / ntap, i = el - c * ntap;
        const int e2 = tile * CT + c;
        if (e2 >= a.pairs) continue;  // warp-uniform
        float v = 0.0f;
        for (int s2 = lane; s2 < S; s2 += 32) v += __ldcg(base + (long long)s2 * (CT * TK) + c * TK + i);
        v = warp_reduce(v);
        if (lane == 0) out[e2 * KK + tap0 + i] = v;
    }
}

#define GW_PARAMS                                                                                      \
    const float* x, const float* dy, float* out, float* ws, unsigned int* counters, int N, int Cin, int H, \
        int W, int Cout, int OH, int OW, int KH, int KW, int sh, int sw, int ph, int pw, int dh, int dw,   \
        int cin_g, int cout_g, int sxn, int sxc, int sxh, int sxw, int sdn, int sdc, int sdh, int sdw,      \
        int ct_log2, int S, int chunk, int pairs
#define GW_ARGS                                                                                         \
    {N, Cin, H, W, Cout, OH, OW, KH, KW, sh, sw, ph, pw, dh, dw, cin_g, cout_g, sxn, sxc, sxh, sxw, sdn, \
     sdc, sdh, sdw, ct_log2, S, chunk, pairs}
#define GW_KERNEL(name, TK, MODE)                                                   \
    extern "C" __global__ void __launch_bounds__(GW_THREADS) name(GW_PARAMS) {      \
        const GwArgs a = GW_ARGS;                                                   \
        wgrad_grouped<TK, MODE>(x, dy, out, ws, counters, a);                       \
    }

GW_KERNEL(conv_wgrad_grouped_atomic_t9, 9, 0)
GW_KERNEL(conv_wgrad_grouped_atomic_t25, 25, 0)
GW_KERNEL(conv_wgrad_grouped_atomic_t49, 49, 0)
GW_KERNEL(conv_wgrad_grouped_tree_t9, 9, 1)
GW_KERNEL(conv_wgrad_grouped_tree_t25, 25, 1)
GW_KERNEL(conv_wgrad_grouped_tree_t49, 49, 1)
