// maxpool_bwd.cu: 2-D max-pool backward, dx = dy scattered to the forward's argmax positions.
// Launchers and CPU order models: kernels/maxpool_bwd.py.
//
// Variants (dx laid out like dy: NCHW, or channels_last = NHWC in memory; indices are flat h * W + w
// inside the (n, c) plane, as max_pool2d(return_indices=True) gives them):
//   atomic  one thread per window: atomicAdd of its gradient at its argmax (dx zeroed first).
//           NONDETERMINISTIC where windows overlap: an input that is the argmax of >= 3 windows
//           receives their gradients in arrival order, and that order decides the rounding.
//   tree    each input position gathers the gradients of the windows whose argmax it is, visiting
//           every window that can contain it in (oh, ow) row-major order from +0.0. Each dx element is
//           written once, by one thread, in a fixed order: deterministic. No zero-fill. Three kernels,
//           same windows in the same order and so the same bits:
//           - maxpool_bwd_cell_*: for the common square pools (3x3 stride 2 pad 1 or 0, 2x2 stride 2,
//             3x3 stride 1 pad 1), one thread per stride cell (S x S positions): the pool geometry is a
//             compile-time constant, so a thread loads the N x N windows its cell can touch once and
//             each position tests only its own windows, from registers.
//           - maxpool_bwd_tile, other pools: stages a block's dy and indices (a few whole planes, NCHW;
//             one image's positions for a group of channels, channels_last) in shared memory with
//             coalesced loads and gathers from there.
//           - maxpool_bwd_tree, planes too large to stage: gathers straight from global memory.
//           H200, ResNet stem pool (3x3 s2 p1, 128 x 64 x 16 x 16), GPU us per call from CUDA-graph
//           replays (bench/dev/maxpool_tile_sweep.py), NCHW / channels_last: atomic (with its zero fill)
//           8.56 / 8.48, cell 4.71 / 5.56, tiled 16.90 / 14.44, global gather 29.86 / 31.16, owner
//           13.02 / 14.24, torch's backward 27.44 / 24.43. 3x3 stride-1 pool (32 x 64 x 32 x 32): cell
//           20.27 / 25.56 against atomic's 21.40 / 19.55 (tiled 22.45 / 54.91); 5x5 and 7x7 stride 1
//           (tiled): 39.7 / 69.1 and 49.6 / 109.3 against atomic's 28.7 / 25.8 and 30.0 / 27.2.
//   owner   one thread per window, like atomic, but without atomics: the first window (row-major)
//           whose argmax is a position "owns" it, sums that position's windows in tree's order and
//           writes the result; other positions keep the zero fill. Each dx element is written by at
//           most one thread after the fill: deterministic, the same bits as tree. It exists because
//           tree's one-thread-per-input gather ran at 2.7x atomic on the ResNet stem pool (H200,
//           batch 128: 32.5 us vs 11.9 us); owner does atomic's amount of work plus a few cached
//           index loads per window. Measured (H200, batch 128): 1.37x atomic on the NCHW stem pool,
//           1.47x channels_last, 2-3.4x on the stride-1 contention pools (every owner re-walks the
//           crowded windows). tree is faster on every pool measured; owner stays as the
//           one-thread-per-window way to a deterministic scatter.
//
// Only additions, no contraction possible: the CPU models reproduce both bit for bit (atomic: for the
// order the atomics happened to arrive in), including the flush of subnormal operands and results to
// signed zero that float atomicAdd does (atomic only; the ordinary FADDs of tree and owner keep
// subnormals: kernels/runtime.py compiles without -ftz).
//
// dy and dx are act_t (common.cuh): the source is compiled once per activation dtype. bf16/fp16 gradients
// are widened on load, summed in float32 in the order above and narrowed once on store (atomic: into a
// float32 buffer the launcher rounds once), so the bits are those of the float32 kernels on the widened dy.
#include "common.cuh"

#define MPB_THREADS 256
#define MPB_INT32_MAX 2147483647LL

// ------------------------------------------------------------------------------------------------
// atomic

// I: the index type (int when every index of the launch fits, else long long).
template <typename I, bool CHANNELS_LAST>
__device__ __forceinline__ void atomic_body(const act_t* __restrict__ dy, const long long* __restrict__ idx,
                                            float* __restrict__ dx, I total, int C, int HW, int OHW) {
    const I step = (I)gridDim.x * blockDim.x;
    for (I o = (I)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += step) {
        const long long i = idx[o];
        if (i < 0 || i >= HW) continue;  // not a position of the plane: the caller's bug, dropped
        I at;
        if (CHANNELS_LAST) {  // o = ((n * OH + oh) * OW + ow) * C + c
            const I c = o % C;
            const I n = o / ((I)OHW * C);
            at = (n * HW + (I)i) * C + c;
        } else {              // o = (n * C + c) * OHW + (oh * OW + ow)
            at = (o / OHW) * HW + (I)i;
        }
        atomicAdd(dx + at, widen(dy[o]));  // arrival order decides the rounding where argmaxes collide
    }
}

extern "C" __global__ void __launch_bounds__(MPB_THREADS)
maxpool_bwd_atomic(const act_t* __restrict__ dy, const long long* __restrict__ idx, float* __restrict__ dx,
                   long long total, int C, int HW, int OHW, int channels_last) {
    // Both the dy index and the dx offsets must fit in 32 bits (dx has HW / OHW times dy's size).
    const long long dx_total = total / OHW * HW;
    const bool narrow = total + (long long)gridDim.x * blockDim.x <= MPB_INT32_MAX &&
                        dx_total <= MPB_INT32_MAX;
    if (channels_last) {
        if (narrow) atomic_body<int, true>(dy, idx, dx, (int)total, C, HW, OHW);
        else atomic_body<long long, true>(dy, idx, dx, total, C, HW, OHW);
    } else {
        if (narrow) atomic_body<int, false>(dy, idx, dx, (int)total, C, HW, OHW);
        else atomic_body<long long, false>(dy, idx, dx, total, C, HW, OHW);
    }
}

// ------------------------------------------------------------------------------------------------
// tree

struct Pool {
    int C, H, W, OH, OW, KH, KW, SH, SW, PH, PW, DH, DW;
};

// First and one-past-last window index along one axis whose (dilated) span [o*s - p, o*s - p + span)
// can contain position x. Windows in that range that skip x because of dilation never have x as their
// argmax, so testing indices == x over the range is exact.
__device__ __forceinline__ int window_lo(int x, int k, int s, int p, int d) {
    const int span = (k - 1) * d + 1;
    return x + p < span ? 0 : (x + p - span) / s + 1;
}
__device__ __forceinline__ int window_hi(int x, int s, int p, int out) {
    return min((x + p) / s + 1, out);
}

template <typename I, bool CHANNELS_LAST>
__device__ __forceinline__ void tree_body(const act_t* __restrict__ dy, const long long* __restrict__ idx,
                                          act_t* __restrict__ dx, I total, const Pool P) {
    const I step = (I)gridDim.x * blockDim.x;
    for (I e = (I)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += step) {
        int h, w;
        I base, stride;  // dy/indices offset of window (0, 0) of this element's plane, and of the next window
        if (CHANNELS_LAST) {  // e = ((n * H + h) * W + w) * C + c
            const I c = e % P.C;
            I t = e / P.C;
            w = (int)(t % P.W);
            t /= P.W;
            h = (int)(t % P.H);
            const I n = t / P.H;
            base = n * P.OH * P.OW * P.C + c;
            stride = P.C;
        } else {              // e = plane * H * W + h * W + w
            w = (int)(e % P.W);
            const I t = e / P.W;
            h = (int)(t % P.H);
            base = (t / P.H) * P.OH * P.OW;
            stride = 1;
        }
        const long long target = (long long)h * P.W + w;
        const int oh0 = window_lo(h, P.KH, P.SH, P.PH, P.DH), oh1 = window_hi(h, P.SH, P.PH, P.OH);
        const int ow0 = window_lo(w, P.KW, P.SW, P.PW, P.DW), ow1 = window_hi(w, P.SW, P.PW, P.OW);
        float acc = 0.0f;
        for (int oh = oh0; oh < oh1; ++oh) {      // row-major over the windows: the fixed order
            for (int ow = ow0; ow < ow1; ++ow) {
                const I o = base + ((I)oh * P.OW + ow) * stride;
                if (idx[o] == target) acc += widen(dy[o]);
            }
        }
        dx[e] = narrow(acc);
    }
}

extern "C" __global__ void __launch_bounds__(MPB_THREADS)
maxpool_bwd_tree(const act_t* __restrict__ dy, const long long* __restrict__ idx, act_t* __restrict__ dx,
                 long long total, int C, int H, int W, int OH, int OW, int KH, int KW, int SH, int SW,
                 int PH, int PW, int DH, int DW, int channels_last) {
    const Pool P = {C, H, W, OH, OW, KH, KW, SH, SW, PH, PW, DH, DW};
    // 32-bit indexing when dx (e) and dy (o) offsets all fit. With ceil_mode, dy can hold more cells
    // per plane than dx (OH * OW > H * W), so bound both.
    const long long planes = total / ((long long)H * W);
    const long long dy_total = planes * OH * OW;
    const bool narrow = total + (long long)gridDim.x * blockDim.x <= MPB_INT32_MAX &&
                        dy_total <= MPB_INT32_MAX;
    if (channels_last) {
        if (narrow) tree_body<int, true>(dy, idx, dx, (int)total, P);
        else tree_body<long long, true>(dy, idx, dx, total, P);
    } else {
        if (narrow) tree_body<int, false>(dy, idx, dx, (int)total, P);
        else tree_body<long long, false>(dy, idx, dx, total, P);
    }
}

// ------------------------------------------------------------------------------------------------
// tree, tiled through shared memory

// Dynamic shared memory of one block: dy and indices of the block's windows (``cells`` of each),
// then the window range of every row and of every column.
//   NCHW:          `group` consecutive planes; cell j = plane * OH*OW + oh*OW + ow.
//   channels_last: image n, channels [c0, c0 + group) (group a power of two); cell j = (oh*OW + ow) *
//                  group + channel, so `group` threads load consecutive channels of one window.
// Indices outside [0, H*W) are stored as -1, which equals no position: tree ignores them too.
extern "C" __global__ void __launch_bounds__(MPB_THREADS)
maxpool_bwd_tile(const act_t* __restrict__ dy, const long long* __restrict__ idx, act_t* __restrict__ dx,
                 long long units, int C, int H, int W, int OH, int OW, int KH, int KW, int SH, int SW,
                 int PH, int PW, int DH, int DW, int channels_last, int group, int shift) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int Q = OH * OW, HW = H * W, t = threadIdx.x;
    const int cells = channels_last ? Q * group : group * Q;
    float* sdy = reinterpret_cast<float*>(smem);
    int* sidx = reinterpret_cast<int*>(sdy + cells);
    int2* rows = reinterpret_cast<int2*>(sidx + cells);  // 8 * cells bytes in: aligned
    int2* cols = rows + H;
    for (int h = t; h < H; h += MPB_THREADS)
        rows[h] = make_int2(window_lo(h, KH, SH, PH, DH), window_hi(h, SH, PH, OH));
    for (int w = t; w < W; w += MPB_THREADS)
        cols[w] = make_int2(window_lo(w, KW, SW, PW, DW), window_hi(w, SW, PW, OW));

    if (!channels_last) {
        // units = N*C planes; this block: planes [p0, p0 + np). `shift` = log2 of the threads per row.
        const long long p0 = (long long)blockIdx.x * group;
        const int np = (int)min((long long)group, units - p0);
        const long long gin = p0 * Q;
        for (int j = t; j < np * Q; j += MPB_THREADS) {  // every load independent and coalesced
            const long long i = idx[gin + j];
            sidx[j] = (i >= 0 && i < HW) ? (int)i : -1;
            sdy[j] = widen(dy[gin + j]);
        }
        __syncthreads();
        const int tx = t & ((1 << shift) - 1), ty = t >> shift, TX = 1 << shift, TY = MPB_THREADS >> shift;
        act_t* out = dx + p0 * HW;
        for (int row = ty; row < np * H; row += TY) {
            const int p = row / H, h = row - p * H;
            const int2 rr = rows[h];
            const int* pidx = sidx + p * Q;
            const float* pdy = sdy + p * Q;
            for (int w = tx; w < W; w += TX) {
                const int2 cr = cols[w];
                const int target = h * W + w;
                float acc = 0.0f;
                for (int oh = rr.x; oh < rr.y; ++oh)      // row-major over the windows: tree's order
                    for (int ow = cr.x; ow < cr.y; ++ow) {
                        const int o = oh * OW + ow;
                        if (pidx[o] == target) acc += pdy[o];
                    }
                out[(long long)p * HW + target] = narrow(acc);
            }
        }
    } else {
        // units = N * ceil(C / group) blocks; `shift` = log2(group).
        const int cblocks = (C + group - 1) / group;
        const long long n = blockIdx.x / cblocks;
        const int c0 = (int)(blockIdx.x - n * cblocks) * group;
        const int nc = min(group, C - c0);
        const long long gin = n * Q * (long long)C + c0;
        for (int j = t; j < Q * group; j += MPB_THREADS) {
            const int q = j >> shift, cc = j & (group - 1);
            long long i = -1;
            float g = 0.0f;
            if (cc < nc) {
                const long long at = gin + (long long)q * C + cc;
                i = idx[at];
                g = widen(dy[at]);
            }
            sidx[j] = (i >= 0 && i < HW) ? (int)i : -1;
            sdy[j] = g;
        }
        __syncthreads();
        const int cc = t & (group - 1), step = MPB_THREADS >> shift;
        if (cc < nc) {
            act_t* out = dx + n * HW * (long long)C + c0 + cc;
            for (int pos = t >> shift; pos < HW; pos += step) {
                const int h = pos / W, w = pos - h * W;
                const int2 rr = rows[h], cr = cols[w];
                float acc = 0.0f;
                for (int oh = rr.x; oh < rr.y; ++oh)      // row-major over the windows: tree's order
                    for (int ow = cr.x; ow < cr.y; ++ow) {
                        const int o = ((oh * OW + ow) << shift) + cc;
                        if (sidx[o] == pos) acc += sdy[o];
                    }
                out[(long long)pos * C] = narrow(acc);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// tree, one thread per stride cell, for the common square pools

// Pool geometry known at compile time (kernel K, stride S, padding P, dilation 1, both axes). The input
// plane is cut into S x S cells, cell (bh, bw) = rows [bh*S, bh*S + S) x cols [bw*S, bw*S + S) (clipped
// to the plane). Along one axis, the windows that can contain position bh*S + r are, relative to
// o0 = window_lo(bh*S) taken without clipping at 0, the range [lo(r), hi(r)) below: constants, because
// shifting x by S shifts every window index by 1. Every window that can contain a position of the cell
// is in the N x N block starting at (o0_h, o0_w). One thread per cell loads that block's indices and
// gradients once (windows outside [0, OH) x [0, OW) count as "no position"), all loads independent, then
// gathers each position from registers: for every window of its range, in row-major order, add the
// gradient if the window's argmax is the position. Same windows, same order, same bits as tree (tree
// clips the range to [0, OH); the windows beyond never match). NCHW threads enumerate (plane, bh, bw);
// channels_last threads (n, bh, bw, c), c fastest, so loads and stores coalesce in both layouts; with
// S = 2 in NCHW and W even, each row of a cell is stored as one float2.
__host__ __device__ constexpr int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

template <int K, int S, int P>
struct CellAxis {
    static constexpr int C0 = P - K;                         // x + P - span, span = K (no dilation), at x = 0
    __host__ __device__ static constexpr int lo(int r) { return floor_div(r + C0, S) - floor_div(C0, S); }
    __host__ __device__ static constexpr int hi(int r) { return floor_div(r + P, S) - floor_div(C0, S); }
    static constexpr int N = hi(S - 1);                       // lo(0) = 0
};

// n / d for 0 <= n < 2^31 with a multiply-high: m and s from cell_divisor() in maxpool_bwd.py.
struct CellDiv {
    unsigned m;
    int s, d;
    __device__ __forceinline__ int div(int n) const { return (int)((__umulhi((unsigned)n, m) + (unsigned)n) >> s); }
    __device__ __forceinline__ long long div(long long n) const { return n / d; }
};

struct CellArgs {
    int C, H, W, OH, OW, BH, BW;
    CellDiv byC, byBH, byBW;
};

// Two horizontally adjacent dx elements in one store (p aligned to two elements).
__device__ __forceinline__ void store_pair(act_t* p, float a, float b) {
#if NNRAND_ACT == 0
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
#else
    *reinterpret_cast<unsigned int*>(p) = (unsigned int)narrow(a) | ((unsigned int)narrow(b) << 16);
#endif
}

template <typename I, int K, int S, int P, bool CHANNELS_LAST>
__device__ __forceinline__ void cell_body(const act_t* __restrict__ dy, const long long* __restrict__ idx,
                                          act_t* __restrict__ dx, I total, const CellArgs A) {
    using Ax = CellAxis<K, S, P>;
    constexpr int N = Ax::N;
    const I step = (I)gridDim.x * blockDim.x;
    const bool pair_store = !CHANNELS_LAST && S == 2 && (A.W & 1) == 0;
    for (I t = (I)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += step) {
        int bh, bw;
        I base, stride, out;  // dy/indices offset of window (0, 0) of the plane; window stride; dx of (0, 0)
        if (CHANNELS_LAST) {  // t = ((n * BH + bh) * BW + bw) * C + c
            I r = A.byC.div(t);
            const I c = t - r * A.C;
            I r2 = A.byBW.div(r);
            bw = (int)(r - r2 * A.BW);
            const I n = A.byBH.div(r2);
            bh = (int)(r2 - n * A.BH);
            base = n * A.OH * A.OW * A.C + c;
            stride = A.C;
            out = n * A.H * A.W * A.C + c;
        } else {              // t = (plane * BH + bh) * BW + bw
            const I r = A.byBW.div(t);
            bw = (int)(t - r * A.BW);
            const I plane = A.byBH.div(r);
            bh = (int)(r - plane * A.BH);
            base = plane * A.OH * A.OW;
            stride = 1;
            out = plane * A.H * A.W;
        }
        const int oh0 = bh + floor_div(Ax::C0, S) + 1, ow0 = bw + floor_div(Ax::C0, S) + 1;  // unclipped
        const int HW = A.H * A.W;
        int wi[N][N];
        float wg[N][N];
#pragma unroll
        for (int a = 0; a < N; ++a)
#pragma unroll
            for (int b = 0; b < N; ++b) {
                const int oh = oh0 + a, ow = ow0 + b;
                wi[a][b] = -1;
                wg[a][b] = 0.0f;
                if (oh >= 0 && oh < A.OH && ow >= 0 && ow < A.OW) {
                    const I o = base + ((I)oh * A.OW + ow) * stride;
                    const long long i = idx[o];
                    wi[a][b] = (i >= 0 && i < HW) ? (int)i : -1;
                    wg[a][b] = widen(dy[o]);
                }
            }
        const int h0 = bh * S, w0 = bw * S;
#pragma unroll
        for (int r = 0; r < S; ++r) {
            const int h = h0 + r;
            if (h >= A.H) break;
            float acc[S];
#pragma unroll
            for (int q = 0; q < S; ++q) {
                const int target = h * A.W + w0 + q;
                float sum = 0.0f;
#pragma unroll
                for (int a = Ax::lo(r); a < Ax::hi(r); ++a)      // row-major over the windows: tree's order
#pragma unroll
                    for (int b = Ax::lo(q); b < Ax::hi(q); ++b)
                        if (wi[a][b] == target) sum += wg[a][b];
                acc[q] = sum;
            }
            if (pair_store) {
                store_pair(dx + out + (I)h * A.W + w0, acc[0], acc[S - 1]);
            } else {
#pragma unroll
                for (int q = 0; q < S; ++q)
                    if (w0 + q < A.W) dx[out + ((I)h * A.W + w0 + q) * stride] = narrow(acc[q]);
            }
        }
    }
}

// maxpool_bwd_cell_k<K>s<S>p<P>_<layout>_<index type>: total = cells of the launch (N * C * BH * BW); the
// launcher checked that the pool is K x K, stride S, padding P, dilation 1 (ceil_mode either way), and
// chose 32-bit indexing when every dy, dx and thread index fits (i32) or 64-bit (i64). One kernel per
// layout and index type, so each keeps the registers of its own path only.
#define MPB_CELL_ONE(K, S, P, LAYOUT, CL, INDEX, I)                                                          \
    extern "C" __global__ void __launch_bounds__(MPB_THREADS)                                               \
    maxpool_bwd_cell_k##K##s##S##p##P##_##LAYOUT##_##INDEX(                                                 \
        const act_t* __restrict__ dy, const long long* __restrict__ idx, act_t* __restrict__ dx,            \
        long long total, int C, int H, int W, int OH, int OW, int BH, int BW, unsigned mC, int sC,           \
        unsigned mBH, int sBH, unsigned mBW, int sBW) {                                                     \
        const CellArgs A = {C, H, W, OH, OW, BH, BW, {mC, sC, C}, {mBH, sBH, BH}, {mBW, sBW, BW}};         \
        cell_body<I, K, S, P, CL>(dy, idx, dx, (I)total, A);                                                \
    }
#define MPB_CELL_KERNEL(K, S, P)                                  \
    MPB_CELL_ONE(K, S, P, nchw, false, i32, int)                  \
    MPB_CELL_ONE(K, S, P, nchw, false, i64, long long)            \
    MPB_CELL_ONE(K, S, P, cl, true, i32, int)                     \
    MPB_CELL_ONE(K, S, P, cl, true, i64, long long)
MPB_CELL_KERNEL(3, 2, 1)  // the ImageNet ResNet stem pool
MPB_CELL_KERNEL(3, 2, 0)
MPB_CELL_KERNEL(2, 2, 0)
MPB_CELL_KERNEL(3, 1, 1)

// ------------------------------------------------------------------------------------------------
// owner

template <typename I, bool CHANNELS_LAST>
__device__ __forceinline__ void owner_body(const act_t* __restrict__ dy, const long long* __restrict__ idx,
                                           act_t* __restrict__ dx, I total, const Pool P) {
    const I step = (I)gridDim.x * blockDim.x;
    const int HW = P.H * P.W;
    for (I o = (I)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += step) {
        const long long i = idx[o];
        if (i < 0 || i >= HW) continue;  // not a position of the plane: ignored, as tree ignores it
        I base, stride, at;  // first window of the plane, distance between windows, dx offset
        if (CHANNELS_LAST) {  // o = ((n * OH + oh) * OW + ow) * C + c
            const I c = o % P.C;
            const I n = o / ((I)P.OH * P.OW * P.C);
            base = n * P.OH * P.OW * P.C + c;
            stride = P.C;
            at = (n * HW + (I)i) * P.C + c;
        } else {              // o = plane * OH * OW + oh * OW + ow
            const I plane = o / ((I)P.OH * P.OW);
            base = plane * P.OH * P.OW;
            stride = 1;
            at = plane * HW + (I)i;
        }
        const int h = (int)i / P.W, w = (int)i - h * P.W;
        const int oh0 = window_lo(h, P.KH, P.SH, P.PH, P.DH), oh1 = window_hi(h, P.SH, P.PH, P.OH);
        const int ow0 = window_lo(w, P.KW, P.SW, P.PW, P.DW), ow1 = window_hi(w, P.SW, P.PW, P.OW);
        // tree's loop for position i; the first window pointing at i must be this one, else another
        // thread owns i and this one stops.
        float acc = 0.0f;
        bool owner = false, done = false;
        for (int oh = oh0; oh < oh1 && !done; ++oh) {
            for (int ow = ow0; ow < ow1; ++ow) {
                const I o2 = base + ((I)oh * P.OW + ow) * stride;
                if (idx[o2] != i) continue;
                if (!owner && o2 != o) {  // an earlier window owns i
                    done = true;
                    break;
                }
                owner = true;
                acc += widen(dy[o2]);
            }
        }
        if (owner) dx[at] = narrow(acc);
    }
}

extern "C" __global__ void __launch_bounds__(MPB_THREADS)
maxpool_bwd_owner(const act_t* __restrict__ dy, const long long* __restrict__ idx, act_t* __restrict__ dx,
                  long long total, int C, int H, int W, int OH, int OW, int KH, int KW, int SH, int SW,
                  int PH, int PW, int DH, int DW, int channels_last) {
    const Pool P = {C, H, W, OH, OW, KH, KW, SH, SW, PH, PW, DH, DW};
    // total counts dy elements here; dx offsets reach planes * H * W.
    const long long dx_total = total / ((long long)OH * OW) * H * W;
    const bool narrow = total + (long long)gridDim.x * blockDim.x <= MPB_INT32_MAX &&
                        dx_total <= MPB_INT32_MAX;
    if (channels_last) {
        if (narrow) owner_body<int, true>(dy, idx, dx, (int)total, P);
        else owner_body<long long, true>(dy, idx, dx, total, P);
    } else {
        if (narrow) owner_body<int, false>(dy, idx, dx, (int)total, P);
        else owner_body<long long, false>(dy, idx, dx, total, P);
    }
}
