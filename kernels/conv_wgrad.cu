// conv_wgrad.cu: 2-D convolution weight gradient dw = sum over (n, oh, ow) of dy (x) im2col(x).
// Launchers, split planning and CPU order models: kernels/conv_wgrad.py.
//
// Implicit GEMM: dw[m, r] = sum_k dy[m, k] * col[r, k] with m = co (M = Cout), r = (ci, kh, kw)
// (R = Cin*KH*KW, dw's own flat order), k = (n, oh, ow) (K = N*OH*OW). col is never materialised: each
// thread computes the input pixel of its (r, k) while loading a tile. The reduction axis K is cut into
// S contiguous chunks of Kc (a multiple of 16) by a plan that depends only on the shapes; block (r-tile,
// m-tile, s) computes the chunk-s partial of one BMxBN output tile with FFMA in registers.
// Variants (all share that partition; they differ only in how the S chunk partials are combined):
//   atomic   every block atomicAdd-s its partial tile into dw (zeroed first). NONDETERMINISTIC: the
//            arrival order of the S partials of an element decides its rounding (cuDNN's fast
//            BwdFilter algorithms do the same).
//   tree     every block stores its partial tile to a workspace; the S partials of each element are
//            then summed in a fixed order (8 strided groups, each sequential, then the 8 group sums in
//            index order). Deterministic: no value depends on timing. Two ways to run that combine, with
//            the same additions in the same order and so the same bits:
//            - fused (conv_wgrad_fused_*, one launch): the workspace is [tile][S][TM*TN][thread], so
//              every store and load is coalesced whatever the layout; each block draws a ticket on its
//              tile's counter after storing, and the block that draws the last one (it sees all S
//              partials) combines the tile and writes dw. Counters come back to zero (arrive_last in
//              common.cuh), so no memset. That block reads S*BM*BN floats alone, which pays only with
//              many tiles and few splits: on the H200 (batch 128) 5% faster than two launches on
//              512->512 3x3 4x4 (144 tiles, S = 8), 11-14% slower with 36-72 tiles, 1.5-3.7x slower
//              on the stems (1-3 tiles, 64-256 splits); the launcher picks (FUSE in conv_wgrad.py).
//            - two launches: workspace [S][M][R], then conv_wgrad_reduce (32 elements a block); under
//              the r' column order (channels_last mapping, tap tiles) the workspace keeps the GEMM's
//              column order and conv_wgrad_reduce_cl puts each sum at its r (the stores were
//              scattered per partial).
//   nosplit  S = 1: one block owns the whole reduction of its tile and stores it (plus +0.0, as every
//            combine starts from +0.0: a -0.0 sum is stored as +0.0 whatever the walk). Deterministic,
//            but small-M*R shapes leave most SMs idle (the reason split-K exists).
// All variants use FFMA, so the CPU models reproduce the chunking and the combine order but not the
// rounding inside a chunk (cpu_bitexact = False).
//
// Tile configurations (template): 128x128 with 8x8 per thread and 64x64 with 4x4 per thread (and, for at most
// 64 output channels, 64x192 and 64x128: the wide tiles below), 256 threads, K-step 16, either two
// shared-memory buffers with register prefetch of the next K-step or (kernels suffixed _a) STAGES buffers
// filled by cp.async up to STAGES - 1 K-steps ahead, in dynamic shared memory. Strides are
// passed explicitly, so NCHW and channels_last (or any mix) read correctly; a channels_last build
// loads along channels instead of along k. Indices are 32-bit (the launcher refuses tensors of 2^31
// elements or more). The load-side options never change the bits (see wgrad_tile).
//
// Tap tiles (TAPK, where Cin is a multiple of the tile width): in r' = (kh, kw, ci) column order every
// column of a tile has the same tap (kh, kw), so the k whose input pixel for that tap lies in the zero
// padding are the same for the whole tile. Such a tile walks only the other k, in ascending order (a
// closed-form compaction of (n, oh, ow) onto the tap's valid output rectangle): it skips exactly the
// products col = 0 would contribute. A skipped term would have added +-0 to the running sum, which
// changes no value but can turn a -0.0 sum (negative products that underflow) into +0.0; every way out
// of the GEMM adds the sums to +0.0 (the combines start from +0.0, the atomic adds go into zeros, the
// unsplit store adds +0.0 itself), so the bits are those of the full walk for finite inputs. A padded
// product with an infinite or NaN dy would have made the element NaN, and a skipped one does not. On
// 3x3 pad-1 convs this drops 8% of the FMAs at 16x16, 16% at 8x8 and 31% at 4x4, and the loads need no
// bounds test.

#include "common.cuh"  // arrive_last, ordered_combine, fma_step

#define WG_THREADS 256
#define WG_BK 16
#define WG_GROUPS 8

struct ConvArgs {
    int cin, h, w, cout, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw;
    int sxn, sxc, sxh, sxw;  // element strides of x
    int sdn, sdc, sdh, sdw;  // element strides of dy
    int K, Kc;               // reduction length N*OH*OW, chunk length (multiple of WG_BK)
};

// Load-side options (template flags; every combination gives the same bits, since each output
// element still accumulates its k terms in chunk order with FFMA; TAPK's skipped terms are zeros):
//   SROWS  per-row constants of the tile (input offset, tap offsets, true column index) live in shared
//          memory, computed once per block, instead of in registers (frees ~32 registers: no spills
//          under the two-blocks-per-SM cap).
//   CL     channels_last inputs: 16 consecutive threads load 16 consecutive channels of one k (NCHW:
//          16 consecutive k of one row), and the tile's columns run over r' = (kh, kw, ci) so that
//          consecutive columns are consecutive channels; the epilogue maps r' back to dw's r when it
//          writes dw (atomic, S = 1, fused combine). Tap tiles (TAPK, below) use r' on either load
//          mapping. Scattered workspace stores made tree up to 1.4x
//          its atomic twin on channels_last (H200, 512->512 3x3 4x4, batch 128), against 1.12x on
//          NCHW, so split workspaces stay in r' order (conv_wgrad_reduce_cl maps them); with that,
//          tree / atomic on channels_last measured 0.89-1.00 on the 3x3 shapes from 8x8 down.
template <int BM, int BN, int TM, int TN, int MODE, bool SROWS, bool CL, bool TAPK, int STAGES>
__device__ __forceinline__ void wgrad_tile(const float* __restrict__ x, const float* __restrict__ dy,
                                           float* __restrict__ out, const ConvArgs& a,
                                           float* __restrict__ ws = nullptr, unsigned int* counters = nullptr) {
    // MODE 0: atomicAdd into out (= dw). MODE 1: store into out + s*M*R (a workspace, or dw when S = 1).
    // MODE 2: fused tree combine: partial to ws, the tile's last block sums the S partials into out.
    static_assert(!CL || SROWS, "the channels_last mapping keeps its column table in shared memory");
    static_assert(!TAPK || SROWS, "tap tiles keep their dy row offsets in shared memory");
    constexpr bool RP = CL || TAPK;  // tile columns in r' = (kh, kw, ci) order
    static_assert(WG_BK * 16 == WG_THREADS, "each K-step tile row is loaded by 16 threads");
    constexpr int AR = BM / 16, BR = BN / 16;  // rows of the A and B tiles each thread loads per K-step
    constexpr int GM = BM * 4 / TM, GN = BN * 4 / TN;  // stride between a thread's float4 groups (= 64)
    static_assert(STAGES == 0 || (STAGES >= 3 && SROWS), "cp.async stages: three or more, row constants shared");
    constexpr int LA = BM + 4, LB = BN + 4;  // row pitches of the A and B tiles: As[stage][q][LA]
    float* As;
    float* Bs;
    if constexpr (STAGES == 0) {
        __shared__ __align__(16) float As_s[2 * WG_BK * LA];
        __shared__ __align__(16) float Bs_s[2 * WG_BK * LB];
        As = As_s;
        Bs = Bs_s;
    } else {
        extern __shared__ __align__(16) float wg_stages[];  // STAGES * WG_BK * (LA + LB) floats
        As = wg_stages;
        Bs = wg_stages + STAGES * WG_BK * LA;
    }
    __shared__ int4 brow[SROWS ? BN : 1];  // {x offset of ci, kh*dh - ph (or -2^30 past R), kw*dw - pw, r}
    __shared__ int arow[SROWS ? BM : 1];   // dy offset of co, -1 past M

    const int t = threadIdx.x;
    const int tx = t % (BN / TN), ty = t / (BN / TN);
    const int kk = CL ? t / 16 : t % WG_BK, rg = CL ? t % 16 : t / WG_BK;
    const int R = a.cin * a.kh * a.kw, M = a.cout, khw = a.kh * a.kw;
    const int r0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    const int kbeg = blockIdx.z * a.Kc;
    const int kend = min(a.K, kbeg + a.Kc);
    const int ohw = a.oh * a.ow;

    auto column = [&](int rr) {  // constants of tile column rr (an r, or an r' under CL)
        int ci, kh, kw;
        if (CL) {
            const int tap = rr / a.cin;
            ci = rr - tap * a.cin;
            kh = tap / a.kw;
            kw = tap - kh * a.kw;
        } else {
            ci = rr / khw;
            const int rem = rr - ci * khw;
            kh = rem / a.kw;
            kw = rem - kh * a.kw;
        }
        // an out-of-range column never passes the bounds test
        return make_int4(ci * a.sxc, rr < R ? kh * a.dh - a.ph : -(1 << 30), kw * a.dw - a.pw,
                         ci * khw + kh * a.kw + kw);
    };

    // Per-row constants of this thread's loads, fixed for the whole reduction (register variant).
    int doff[AR];
    int xoff[BR], ihoff[BR], iwoff[BR];
    if constexpr (SROWS) {
        if (!TAPK)
            for (int j = t; j < BN; j += WG_THREADS) brow[j] = column(r0 + j);
        for (int j = t; j < BM; j += WG_THREADS) arow[j] = m0 + j < M ? (m0 + j) * a.sdc : -1;
        __syncthreads();
    } else {
#pragma unroll
        for (int i = 0; i < AR; ++i) {
            const int m = m0 + rg + 16 * i;
            doff[i] = m < M ? m * a.sdc : -1;
        }
#pragma unroll
        for (int i = 0; i < BR; ++i) {
            const int4 c = column(r0 + rg + 16 * i);
            xoff[i] = c.x;
            ihoff[i] = c.y;
            iwoff[i] = c.z;
        }
    }

    // Tap tiles: the tile's tap has the valid output rectangle [ohlo, ohlo + hv) x [owlo, owlo + wv); the
    // chunk [kbeg, kend) is walked as positions [cbeg, cend) of the valid k counted from 0, and the base
    // offsets of position 0's pixel (dtap in dy, xtap in x, channel ci0 of the tile included) keep the
    // loop's live registers few.
    int wv = 1, nv = 1, dtap = 0, xtap = 0;
    int cbeg = kbeg, cend = kend;
    if constexpr (TAPK) {
        const int tap = r0 / a.cin, th = tap / a.kw;
        const int tih = th * a.dh - a.ph, tiw = (tap - th * a.kw) * a.dw - a.pw;
        // oh is valid when 0 <= oh*sh + tih < h (ow alike)
        const int ohlo = tih >= 0 ? 0 : (a.sh - 1 - tih) / a.sh;
        const int owlo = tiw >= 0 ? 0 : (a.sw - 1 - tiw) / a.sw;
        const int ohhi = a.h - 1 - tih < 0 ? 0 : min(a.oh, (a.h - 1 - tih) / a.sh + 1);
        const int owhi = a.w - 1 - tiw < 0 ? 0 : min(a.ow, (a.w - 1 - tiw) / a.sw + 1);
        const int hv = max(0, ohhi - ohlo), wvalid = max(0, owhi - owlo);
        auto before = [&](int k) {  // how many valid k precede k
            const int n = k / ohw, l = k - n * ohw;
            const int oh = l / a.ow, ow = l - oh * a.ow;
            const int rows = min(max(oh - ohlo, 0), hv);
            const int cols = oh >= ohlo && oh < ohlo + hv ? min(max(ow - owlo, 0), wvalid) : 0;
            return n * hv * wvalid + rows * wvalid + cols;
        };
        cbeg = before(kbeg);
        cend = before(kend);
        wv = max(wvalid, 1);  // divisors; with no valid k the walk is empty
        nv = max(hv * wvalid, 1);
        dtap = ohlo * a.sdh + owlo * a.sdw;
        xtap = (r0 - tap * a.cin) * a.sxc + (ohlo * a.sh + tih) * a.sxh + (owlo * a.sw + tiw) * a.sxw;
    }

    float ra[STAGES ? 1 : AR], rb[STAGES ? 1 : BR];
    // one K-step's loads: into ra/rb (STAGES 0; store() puts them in stage buf), or by cp.async straight into
    // stage buf (zeros where the element is outside the tensors, as the register loads give)
    auto put = [&](bool a_side, int i, int buf, const float* src, bool ok) {
        if constexpr (STAGES == 0) {
            (a_side ? ra : rb)[i] = ok ? __ldg(src) : 0.0f;
        } else {
            float* dst = (a_side ? As + (buf * WG_BK + kk) * LA : Bs + (buf * WG_BK + kk) * LB) + rg + 16 * i;
            cp_async4(dst, ok ? src : (a_side ? dy : x), ok);
        }
    };
    auto load = [&](int k0, int buf) {
        if constexpr (TAPK) {  // k0 is a compacted position
            const int j = k0 + kk;
            const bool in = j < cend;
            const int n = j / nv, l = j - n * nv;
            const int oh = l / wv, ow = l - oh * wv;  // from the rectangle's corner
            const int dbase = dtap + n * a.sdn + oh * a.sdh + ow * a.sdw;
            const int xbase = xtap + n * a.sxn + oh * a.sh * a.sxh + ow * a.sw * a.sxw;
#pragma unroll
            for (int i = 0; i < AR; ++i) {
                const int off = arow[rg + 16 * i];
                put(true, i, buf, dy + dbase + off, in && off >= 0);
            }
#pragma unroll
            for (int i = 0; i < BR; ++i) put(false, i, buf, x + xbase + (rg + 16 * i) * a.sxc, in);
            return;
        }
        const int k = k0 + kk;
        const bool kin = k < kend;
        const int n = k / ohw, l = k - n * ohw;
        const int oh = l / a.ow, ow = l - oh * a.ow;
        const int dbase = n * a.sdn + oh * a.sdh + ow * a.sdw;
        const int xbase = n * a.sxn;
        const int ih0 = oh * a.sh, iw0 = ow * a.sw;
#pragma unroll
        for (int i = 0; i < AR; ++i) {
            const int off = SROWS ? arow[rg + 16 * i] : doff[i];
            put(true, i, buf, dy + dbase + off, kin && off >= 0);
        }
#pragma unroll
        for (int i = 0; i < BR; ++i) {
            const int4 c = SROWS ? brow[rg + 16 * i] : make_int4(xoff[i], ihoff[i], iwoff[i], 0);
            const int ih = ih0 + c.y, iw = iw0 + c.z;
            const bool ok = kin && (unsigned)ih < (unsigned)a.h && (unsigned)iw < (unsigned)a.w;
            put(false, i, buf, x + xbase + c.x + ih * a.sxh + iw * a.sxw, ok);
        }
    };
    auto store = [&](int buf) {  // STAGES 0
        if constexpr (STAGES == 0) {
#pragma unroll
            for (int i = 0; i < AR; ++i) As[(buf * WG_BK + kk) * LA + rg + 16 * i] = ra[i];
#pragma unroll
            for (int i = 0; i < BR; ++i) Bs[(buf * WG_BK + kk) * LB + rg + 16 * i] = rb[i];
        }
    };

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;

    const int steps = (cend - cbeg + WG_BK - 1) / WG_BK;
    if constexpr (STAGES == 0) {  // two stages, the next K-step's loads held in registers during the FFMAs
        load(cbeg, 0);
        store(0);
        __syncthreads();
        for (int st = 0; st < steps; ++st) {
            const int buf = st & 1;
            const bool more = st + 1 < steps;
            if (more) load(cbeg + (st + 1) * WG_BK, 0);  // global loads in flight during the FFMAs below
#pragma unroll
            for (int q = 0; q < WG_BK; ++q)
                fma_step<TM, TN, GM, GN>(As + (buf * WG_BK + q) * LA, Bs + (buf * WG_BK + q) * LB, ty, tx, acc);
            if (more) store(buf ^ 1);  // buf ^ 1 was last read before the previous barrier
            __syncthreads();
        }
    } else {  // STAGES stages filled by cp.async up to STAGES - 1 K-steps ahead (one commit group per K-step)
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < steps) load(cbeg + s * WG_BK, s);
            cp_async_commit();
        }
        int buf = 0, fill = STAGES - 1;
        for (int st = 0; st < steps; ++st) {
            cp_async_wait<STAGES - 2>();  // this thread's copies of K-step st have landed
            __syncthreads();  // everyone's have; and everyone is done with K-step st - 1's stage, refilled now
            if (st + STAGES - 1 < steps) load(cbeg + (st + STAGES - 1) * WG_BK, fill);
            cp_async_commit();
#pragma unroll
            for (int q = 0; q < WG_BK; ++q)
                fma_step<TM, TN, GM, GN>(As + (buf * WG_BK + q) * LA, Bs + (buf * WG_BK + q) * LB, ty, tx, acc);
            buf = buf + 1 == STAGES ? 0 : buf + 1;
            fill = fill + 1 == STAGES ? 0 : fill + 1;
        }
        cp_async_wait<0>();
        __syncthreads();  // (the fused epilogue below reuses no stage, but leaves no copy in flight past here)
    }

    // dw's column r = ci*KH*KW + kh*KW + kw of tile column col (under RP, whose columns are r')
    auto dw_column = [&](int col) {
        if constexpr (TAPK) {
            const int tap = r0 / a.cin;
            return (r0 - tap * a.cin + col) * khw + tap;
        }
        return brow[col].w;
    };

    if constexpr (MODE == 2) {
        constexpr int E = TM * TN;
        const int S = gridDim.z, tile = blockIdx.y * gridDim.x + blockIdx.x;
        float* wt = ws + (long long)tile * S * E * WG_THREADS + t;  // [tile][s][q][thread]
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) __stcg(wt + ((long long)blockIdx.z * E + i * TN + j) * WG_THREADS, acc[i][j]);
        __threadfence();  // this thread's partials are visible device-wide before the ticket is drawn
        __shared__ bool last;
        __syncthreads();
        if (t == 0) last = arrive_last(counters + tile, (unsigned)S);
        __syncthreads();
        if (!last) return;
        // The last block: for each of this thread's elements, group g adds partials s = g, g + 8, ...
        // in order from +0.0, then the 8 group sums are added in order from +0.0 (as conv_wgrad_reduce).
#pragma unroll 2
        for (int q = 0; q < E; ++q) {
            const int i = q / TN, j = q % TN;
            const int m = m0 + (i / 4) * GM + ty * 4 + (i % 4);
            const int col = (j / 4) * GN + tx * 4 + (j % 4);
            const float r = ordered_combine(wt + (long long)q * WG_THREADS, S, (long long)E * WG_THREADS);
            if (m < M && r0 + col < R) out[m * R + (RP ? dw_column(col) : r0 + col)] = r;
        }
        return;
    }

    float* dst = MODE == 0 ? out : out + (long long)blockIdx.z * M * R;
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int m = m0 + (i / 4) * GM + ty * 4 + (i % 4);
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int col = (j / 4) * GN + tx * 4 + (j % 4);
            if (r0 + col >= R) continue;
            // r' columns with S > 1: the workspace keeps the tile's r' order (coalesced stores);
            // conv_wgrad_reduce_cl maps r' to r once per element instead of once per partial.
            const int r = RP && (MODE == 0 || gridDim.z == 1) ? dw_column(col) : r0 + col;
            if (MODE == 0) atomicAdd(dst + m * R + r, acc[i][j]);  // arrival order decides the rounding
            else if (gridDim.z == 1) dst[m * R + r] = acc[i][j] + 0.0f;  // the sign of a zero as a combine
            else dst[m * R + r] = acc[i][j];
        }
    }
}

// Plain int arguments (not a struct) so that any launcher can pass them as scalars.
#define WG_PARAMS                                                                                      \
    int cin, int h, int w, int cout, int oh, int ow, int kh, int kw, int sh, int sw, int ph, int pw,  \
        int dh, int dw, int sxn, int sxc, int sxh, int sxw, int sdn, int sdc, int sdh, int sdw, int K, \
        int Kc
#define WG_ARGS {cin, h, w, cout, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, sxn, sxc, sxh, sxw, sdn, sdc, sdh, sdw, K, Kc}
#define WG_KERNEL_ST(name, BM, BN, TM, TN, MODE, SROWS, CL, TAPK, MINB, STAGES)                       \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, MINB)                                     \
    name(const float* x, const float* dy, float* out, WG_PARAMS) {                                    \
        const ConvArgs a = WG_ARGS;                                                                    \
        wgrad_tile<BM, BN, TM, TN, MODE, SROWS, CL, TAPK, STAGES>(x, dy, out, a);                      \
    }

#define WG_FUSED_KERNEL_ST(name, BM, BN, TM, TN, SROWS, CL, TAPK, MINB, STAGES)                       \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, MINB)                                     \
    name(const float* x, const float* dy, float* out, float* ws, unsigned int* counters, WG_PARAMS) { \
        const ConvArgs a = WG_ARGS;                                                                    \
        wgrad_tile<BM, BN, TM, TN, 2, SROWS, CL, TAPK, STAGES>(x, dy, out, a, ws, counters);           \
    }
// each kernel with its row constants in shared memory also as name_a: WG_STAGES stages filled by cp.async (the
// _r kernels, row constants in registers, are instantiated with WG_KERNEL_ST alone)
#ifndef WG_STAGES
#define WG_STAGES 3
#endif
#define WG_KERNEL(name, BM, BN, TM, TN, MODE, SROWS, CL, TAPK, MINB)                                   \
    WG_KERNEL_ST(name, BM, BN, TM, TN, MODE, SROWS, CL, TAPK, MINB, 0)                                 \
    WG_KERNEL_ST(name##_a, BM, BN, TM, TN, MODE, SROWS, CL, TAPK, MINB, WG_STAGES)
#define WG_FUSED_KERNEL(name, BM, BN, TM, TN, SROWS, CL, TAPK, MINB)                                  \
    WG_FUSED_KERNEL_ST(name, BM, BN, TM, TN, SROWS, CL, TAPK, MINB, 0)                                 \
    WG_FUSED_KERNEL_ST(name##_a, BM, BN, TM, TN, SROWS, CL, TAPK, MINB, WG_STAGES)

// 128x128 tiles: at most 128 registers so that two blocks share an SM; 64x64: three blocks an SM.
// Suffix: _r row constants in registers (ptxas spills ~50 bytes of them at 128x128), _s in shared
// memory, _cl in shared memory with the channels_last mapping; _ts and _tc tap tiles with the _s and _cl
// load mappings.
WG_KERNEL_ST(conv_wgrad_atomic_t128_r, 128, 128, 8, 8, 0, false, false, false, 2, 0)
WG_KERNEL_ST(conv_wgrad_split_t128_r, 128, 128, 8, 8, 1, false, false, false, 2, 0)
WG_KERNEL_ST(conv_wgrad_atomic_t64_r, 64, 64, 4, 4, 0, false, false, false, 3, 0)
WG_KERNEL_ST(conv_wgrad_split_t64_r, 64, 64, 4, 4, 1, false, false, false, 3, 0)
WG_KERNEL(conv_wgrad_atomic_t128_s, 128, 128, 8, 8, 0, true, false, false, 2)
WG_KERNEL(conv_wgrad_split_t128_s, 128, 128, 8, 8, 1, true, false, false, 2)
WG_KERNEL(conv_wgrad_atomic_t64_s, 64, 64, 4, 4, 0, true, false, false, 3)
WG_KERNEL(conv_wgrad_split_t64_s, 64, 64, 4, 4, 1, true, false, false, 3)
WG_KERNEL(conv_wgrad_atomic_t128_cl, 128, 128, 8, 8, 0, true, true, false, 2)
WG_KERNEL(conv_wgrad_split_t128_cl, 128, 128, 8, 8, 1, true, true, false, 2)
WG_KERNEL(conv_wgrad_atomic_t64_cl, 64, 64, 4, 4, 0, true, true, false, 3)
WG_KERNEL(conv_wgrad_split_t64_cl, 64, 64, 4, 4, 1, true, true, false, 3)
WG_FUSED_KERNEL_ST(conv_wgrad_fused_t128_r, 128, 128, 8, 8, false, false, false, 2, 0)
WG_FUSED_KERNEL_ST(conv_wgrad_fused_t64_r, 64, 64, 4, 4, false, false, false, 3, 0)
WG_FUSED_KERNEL(conv_wgrad_fused_t128_s, 128, 128, 8, 8, true, false, false, 2)
WG_FUSED_KERNEL(conv_wgrad_fused_t64_s, 64, 64, 4, 4, true, false, false, 3)
WG_FUSED_KERNEL(conv_wgrad_fused_t128_cl, 128, 128, 8, 8, true, true, false, 2)
WG_FUSED_KERNEL(conv_wgrad_fused_t64_cl, 64, 64, 4, 4, true, true, false, 3)
// Wide tiles for weight gradients of at most 64 output channels (M <= 64): 64 rows x 192 columns with 4 x 12
// per thread (t64w, two blocks an SM) or x 128 with 4 x 8 (t64m, three). A 64x64 tile's 4 x 4 per thread
// spends as many shared-memory loads as FFMAs per element pair (the 64->64 3x3 56x56 wgrad ran at 24 TFLOPS on
// the H200, against 35 for the 128x128 tiles). Every element still accumulates its chunk's k terms in order:
// the bits of the 64x64 kernels. No tap tiles (a tile wider than Cin spans several taps) and no fused
// combine; conv_wgrad.py (WIDE) says where each runs.
WG_KERNEL_ST(conv_wgrad_atomic_t64w_s, 64, 192, 4, 12, 0, true, false, false, 2, 0)
WG_KERNEL_ST(conv_wgrad_split_t64w_s, 64, 192, 4, 12, 1, true, false, false, 2, 0)
WG_KERNEL_ST(conv_wgrad_atomic_t64w_cl, 64, 192, 4, 12, 0, true, true, false, 2, 0)
WG_KERNEL_ST(conv_wgrad_split_t64w_cl, 64, 192, 4, 12, 1, true, true, false, 2, 0)
WG_KERNEL_ST(conv_wgrad_atomic_t64m_s, 64, 128, 4, 8, 0, true, false, false, 3, 0)
WG_KERNEL_ST(conv_wgrad_split_t64m_s, 64, 128, 4, 8, 1, true, false, false, 3, 0)
WG_KERNEL_ST(conv_wgrad_atomic_t64m_cl, 64, 128, 4, 8, 0, true, true, false, 3, 0)
WG_KERNEL_ST(conv_wgrad_split_t64m_cl, 64, 128, 4, 8, 1, true, true, false, 3, 0)
// tap tiles: atomic, split and fused kernels of one tile size and style
#define WG_TAP_KERNELS(T, TM, STYLE, CL, MINB)                                                            \
    WG_KERNEL(conv_wgrad_atomic_t##T##_##STYLE, T, T, TM, TM, 0, true, CL, true, MINB)                    \
    WG_KERNEL(conv_wgrad_split_t##T##_##STYLE, T, T, TM, TM, 1, true, CL, true, MINB)                     \
    WG_FUSED_KERNEL(conv_wgrad_fused_t##T##_##STYLE, T, T, TM, TM, true, CL, true, MINB)
WG_TAP_KERNELS(128, 8, ts, false, 2)
WG_TAP_KERNELS(64, 4, ts, false, 3)
WG_TAP_KERNELS(128, 8, tc, true, 2)
WG_TAP_KERNELS(64, 4, tc, true, 3)

// Fixed-order combine of the S chunk partials of each element: a block covers 32 elements (lanes) with
// 8 warps; warp g adds partials s = g, g + 8, g + 16, ... in that order, then lane e of warp 0 adds the
// 8 group sums in index order. Nothing depends on timing, so the result is bitwise reproducible.
// CL_ORDER: the partials hold element m*R + r' with r' = (kh*KW + kw)*Cin + ci (the r' order GEMM's
// column order); the sum goes to dw's m*R + ci*KH*KW + kh*KW + kw. Same additions, same order.
template <bool CL_ORDER>
__device__ __forceinline__ void reduce_body(const float* partials, int S, int MR, float* dw, int R, int cin,
                                            int khw) {
    __shared__ float part[WG_GROUPS][32];
    const int lane = threadIdx.x & 31, g = threadIdx.x >> 5;
    const int e = blockIdx.x * 32 + lane;
    float acc = 0.0f;
    if (e < MR) {
#pragma unroll 8
        for (int s = g; s < S; s += WG_GROUPS) acc += __ldcg(partials + (long long)s * MR + e);
    }
    part[g][lane] = acc;
    __syncthreads();
    if (g == 0 && e < MR) {
        float r = 0.0f;
#pragma unroll
        for (int i = 0; i < WG_GROUPS; ++i) r += part[i][lane];
        int at = e;
        if (CL_ORDER) {
            const int m = e / R, rp = e - m * R, tap = rp / cin;
            at = m * R + (rp - tap * cin) * khw + tap;
        }
        dw[at] = r;
    }
}

extern "C" __global__ void __launch_bounds__(32 * WG_GROUPS)
conv_wgrad_reduce(const float* partials, int S, int MR, float* dw) {
    reduce_body<false>(partials, S, MR, dw, 1, 1, 1);
}

extern "C" __global__ void __launch_bounds__(32 * WG_GROUPS)
conv_wgrad_reduce_cl(const float* partials, int S, int MR, float* dw, int R, int cin, int khw) {
    reduce_body<true>(partials, S, MR, dw, R, cin, khw);
}
