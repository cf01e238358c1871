// adaptive_avg_pool2d_bwd.cu: backward of adaptive_avg_pool2d(x, (OH, OW)): dx (N, C, H, W) from dy (N, C, OH, OW).
// Launchers and CPU order models: kernels/adaptive_avg_pool2d_bwd.py.
//
// Window of output (oh, ow): rows [floor(oh*H/OH), ceil((oh+1)*H/OH)), columns likewise (torch's
// START_IND / END_IND); kh, kw its height and width. Every element of the window receives
//     g(oh, ow) = (dy[oh, ow] / kw) / kh        (two IEEE float32 divisions, in this order)
// which is the arithmetic of torch's CUDA NCHW backward (atomic_adaptive_average_gradinput:
// `*ptr_gradOutput / kW / kH`), so an element covered by one window gets torch's CUDA bits.
// dx is laid out like dy (NCHW, or channels_last = NHWC in memory).
//
// Variants:
//   atomic  one thread per dy element: atomicAdd of g into every element of its window (dx zeroed
//           first), as torch's CUDA backward does. NONDETERMINISTIC where windows overlap (H not a
//           multiple of OH, or OH > H): an element covered by >= 3 windows adds their g in arrival
//           order, and that order decides the rounding.
//   tree    every dx element summed by one thread: the windows that cover it in (oh, ow) row-major
//           order, from +0.0; each dx element written once, no atomics, no zero fill: deterministic,
//           the same bits on every GPU and equal to its CPU model. Two kernels, same bits:
//           _tiled (the launcher's choice wherever the tables and a tile fit in shared memory): a
//             block takes a tile of P images x CB channels (NCHW is viewed as N*C images of one
//             channel), computes each dy element's share once into shared memory, then every dx
//             element of the tile adds its shares from there. Window bounds per dx row and column
//             and the window sizes are per-block tables; index decomposition by multiply-shift
//             dividers. Channels_last tiles put adjacent channels on adjacent threads (coalesced).
//           _direct (any size): one thread per dx element, bounds and shares computed on the spot.
//
// Only divisions and additions, no contraction possible: the CPU models reproduce both bit for bit
// (atomic: for the order the atomics happened to arrive in; float atomicAdd flushes subnormal
// operands and results to signed zero, and its model does too).

#include "common.cuh"  // FastDiv

#define AAP_THREADS 256
#define AAP_INT32_MAX 2147483647LL

// floor(a * c / b) and ceil((a + 1) * c / b) for a, b, c >= 0 (torch's START_IND, END_IND).
__device__ __forceinline__ int start_ind(int a, int b, int c) { return (int)(((long long)a * c) / b); }
__device__ __forceinline__ int end_ind(int a, int b, int c) { return (int)(((long long)(a + 1) * c + b - 1) / b); }

// The share of one window's gradient that each of its elements receives.
__device__ __forceinline__ float share(float g, int kw, int kh) {
    return __fdiv_rn(__fdiv_rn(g, (float)kw), (float)kh);
}

struct Geom {
    int C, H, W, OH, OW;
};

// ------------------------------------------------------------------------------------------------
// atomic

template <typename I, bool CL>
__device__ __forceinline__ void atomic_body(const float* __restrict__ dy, float* __restrict__ dx, I total, const Geom G) {
    const I step = (I)gridDim.x * blockDim.x;
    for (I o = (I)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += step) {
        int oh, ow;
        I base, stride;  // dx offset of element (0, 0) of the plane; distance between positions
        if (CL) {  // o = ((n * OH + oh) * OW + ow) * C + c
            const I c = o % G.C;
            I r = o / G.C;
            ow = (int)(r % G.OW);
            r /= G.OW;
            oh = (int)(r % G.OH);
            const I n = r / G.OH;
            base = n * G.H * G.W * G.C + c;
            stride = G.C;
        } else {   // o = (plane * OH + oh) * OW + ow
            ow = (int)(o % G.OW);
            const I r = o / G.OW;
            oh = (int)(r % G.OH);
            base = (r / G.OH) * G.H * G.W;
            stride = 1;
        }
        const int h0 = start_ind(oh, G.OH, G.H), h1 = end_ind(oh, G.OH, G.H);
        const int w0 = start_ind(ow, G.OW, G.W), w1 = end_ind(ow, G.OW, G.W);
        const float g = share(dy[o], w1 - w0, h1 - h0);
        for (int h = h0; h < h1; ++h)
            for (int w = w0; w < w1; ++w)
                atomicAdd(dx + base + ((I)h * G.W + w) * stride, g);  // arrival order decides the rounding
    }
}

extern "C" __global__ void __launch_bounds__(AAP_THREADS)
adaptive_avg_pool2d_bwd_atomic(const float* __restrict__ dy, float* __restrict__ dx, long long total, int C, int H,
                               int W, int OH, int OW, int channels_last) {
    const Geom G = {C, H, W, OH, OW};
    const long long dx_total = total / ((long long)OH * OW) * H * W;
    const bool narrow = total + (long long)gridDim.x * blockDim.x <= AAP_INT32_MAX && dx_total <= AAP_INT32_MAX;
    if (channels_last) {
        if (narrow) atomic_body<int, true>(dy, dx, (int)total, G);
        else atomic_body<long long, true>(dy, dx, total, G);
    } else {
        if (narrow) atomic_body<int, false>(dy, dx, (int)total, G);
        else atomic_body<long long, false>(dy, dx, total, G);
    }
}

// ------------------------------------------------------------------------------------------------
// tree

// ---- direct: one thread per dx element, everything computed on the spot

template <typename I, bool CL>
__device__ __forceinline__ void tree_body(const float* __restrict__ dy, float* __restrict__ dx, I total, const Geom G) {
    const I step = (I)gridDim.x * blockDim.x;
    for (I t = (I)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += step) {
        int h, w;
        I base, stride;  // dy offset of window (0, 0) of the plane; distance between windows
        if (CL) {  // t = ((n * H + h) * W + w) * C + c
            const I c = t % G.C;
            I r = t / G.C;
            w = (int)(r % G.W);
            r /= G.W;
            h = (int)(r % G.H);
            const I n = r / G.H;
            base = n * G.OH * G.OW * G.C + c;
            stride = G.C;
        } else {   // t = (plane * H + h) * W + w
            w = (int)(t % G.W);
            const I r = t / G.W;
            h = (int)(r % G.H);
            base = (r / G.H) * G.OH * G.OW;
            stride = 1;
        }
        // The windows covering row h are oh in [floor(h*OH/H), ceil((h+1)*OH/H)) (the same formulas
        // with the roles of H and OH swapped); likewise for columns.
        const int oh0 = start_ind(h, G.H, G.OH), oh1 = end_ind(h, G.H, G.OH);
        const int ow0 = start_ind(w, G.W, G.OW), ow1 = end_ind(w, G.W, G.OW);
        float acc = 0.0f;
        for (int oh = oh0; oh < oh1; ++oh) {       // row-major over the windows: tree's order
            const int kh = end_ind(oh, G.OH, G.H) - start_ind(oh, G.OH, G.H);
            const I row = base + (I)oh * G.OW * stride;
            for (int ow = ow0; ow < ow1; ++ow) {
                const int kw = end_ind(ow, G.OW, G.W) - start_ind(ow, G.OW, G.W);
                acc += share(dy[row + (I)ow * stride], kw, kh);
            }
        }
        dx[t] = acc;  // t enumerates dx in memory order in both layouts
    }
}

extern "C" __global__ void __launch_bounds__(AAP_THREADS)
adaptive_avg_pool2d_bwd_tree_direct(const float* __restrict__ dy, float* __restrict__ dx, long long total, int C, int H,
                             int W, int OH, int OW, int channels_last) {
    const Geom G = {C, H, W, OH, OW};
    const long long dy_total = total / ((long long)H * W) * OH * OW;
    const bool narrow = total + (long long)gridDim.x * blockDim.x <= AAP_INT32_MAX && dy_total <= AAP_INT32_MAX;
    if (channels_last) {
        if (narrow) tree_body<int, true>(dy, dx, (int)total, G);
        else tree_body<long long, true>(dy, dx, total, G);
    } else {
        if (narrow) tree_body<int, false>(dy, dx, (int)total, G);
        else tree_body<long long, false>(dy, dx, total, G);
    }
}

// ---- tiled: shares once per dy element into shared memory, then a gather of additions only
//
// The tensor is viewed as N images of H x W positions of C channels, channels innermost (NCHW is
// N*C images of one channel). A tile is P consecutive images x CB consecutive channels: its dy part
// (P * OH * OW * CB shares) sits in shared memory; its dx part (P * H * W * CB elements) is computed
// from it. Dynamic shared memory, in this order (the launcher sizes it the same way):
//   FastDiv divs[5] (64 bytes: CB, H*W, W, OH*OW, OW) | int2 rows[H] | int2 cols[W] |
//   float khf[OH] | float kwf[OW] | float tile[P * CB * OH * OW]
// rows[h] = [first, end) of the windows covering dx row h (likewise cols); khf, kwf the window sizes.
// The launcher guarantees P * CB * max(H*W, OH*OW) < 2^31 (tile-local indices are int).

extern "C" __global__ void __launch_bounds__(AAP_THREADS)
adaptive_avg_pool2d_bwd_tree_tiled(const float* __restrict__ dy, float* __restrict__ dx, long long N, int C, int H,
                                   int W, int OH, int OW, int CB, int P) {
    extern __shared__ __align__(16) unsigned char smem[];
    FastDiv* divs = reinterpret_cast<FastDiv*>(smem);
    int2* rows = reinterpret_cast<int2*>(smem + 64);
    int2* cols = rows + H;
    float* khf = reinterpret_cast<float*>(cols + W);
    float* kwf = khf + OH;
    float* tile = kwf + OW;
    const int HW = H * W, OHW = OH * OW;
    if (threadIdx.x < 5) {
        const int which = threadIdx.x;
        const int d = which == 0 ? CB : which == 1 ? HW : which == 2 ? W : which == 3 ? OHW : OW;
        divs[which] = make_fastdiv((unsigned)d);
    }
    for (int i = threadIdx.x; i < H; i += blockDim.x) rows[i] = make_int2(start_ind(i, H, OH), end_ind(i, H, OH));
    for (int i = threadIdx.x; i < W; i += blockDim.x) cols[i] = make_int2(start_ind(i, W, OW), end_ind(i, W, OW));
    for (int o = threadIdx.x; o < OH; o += blockDim.x) khf[o] = (float)(end_ind(o, OH, H) - start_ind(o, OH, H));
    for (int o = threadIdx.x; o < OW; o += blockDim.x) kwf[o] = (float)(end_ind(o, OW, W) - start_ind(o, OW, W));
    __syncthreads();
    const FastDiv dCB = divs[0], dHW = divs[1], dW = divs[2], dOHW = divs[3], dOW = divs[4];

    const long long chunks = (C + CB - 1) / CB;
    const long long tiles = (N + P - 1) / P * chunks;
    for (long long id = blockIdx.x; id < tiles; id += gridDim.x) {
        const long long tn = chunks == 1 ? id : id / chunks;  // NCHW: one chunk
        const int c0 = (int)(id - tn * chunks) * CB;
        const long long n0 = tn * P;
        const int np = (int)(N - n0 < P ? N - n0 : P);
        const int cb = C - c0 < CB ? C - c0 : CB;  // channels of this tile (the last chunk can be short)

        // 1. tile[(pp * OHW + q) * CB + cc] = share of dy[n0 + pp, q, c0 + cc], each computed once
        const float* ysrc = dy + n0 * OHW * C + c0;
        const int nload = np * OHW * CB;
        for (int j = threadIdx.x; j < nload; j += blockDim.x) {
            const int rest = fast_div(dCB, j), cc = j - rest * CB;
            const int pp = fast_div(dOHW, rest), q = rest - pp * OHW;
            const int oh = fast_div(dOW, q), ow = q - oh * OW;
            if (cc < cb)
                tile[j] = __fdiv_rn(__fdiv_rn(ysrc[((long long)pp * OHW + q) * C + cc], kwf[ow]), khf[oh]);
        }
        __syncthreads();

        // 2. every dx element of the tile: its windows in (oh, ow) row-major order, from +0.0
        float* xdst = dx + n0 * HW * C + c0;
        const int nout = np * HW * CB;
        for (int j = threadIdx.x; j < nout; j += blockDim.x) {
            const int rest = fast_div(dCB, j), cc = j - rest * CB;
            if (cc >= cb) continue;
            const int pp = fast_div(dHW, rest), r = rest - pp * HW;
            const int h = fast_div(dW, r), w = r - h * W;
            const int2 rh = rows[h], rw = cols[w];
            const float* t = tile + pp * OHW * CB + cc;
            float acc = 0.0f;
            for (int oh = rh.x; oh < rh.y; ++oh)
                for (int ow = rw.x; ow < rw.y; ++ow) acc = __fadd_rn(acc, t[(oh * OW + ow) * CB]);
            xdst[((long long)pp * HW + r) * C + cc] = acc;
        }
        __syncthreads();  // the next tile overwrites the shares
    }
}

// ---- exact: the windows tile dx exactly (H = KH * OH, W = KW * OW: 14->7, 7->1, 7->7, 28->7), so every
// dx element lies in exactly one window and its tree sum is +0.0 + (dy / KW) / KH: the bits of _tiled and
// _direct (the +0.0 turns a -0.0 share into +0.0, as their sums from +0.0 do). No shared memory, no
// tables: one thread per VEC consecutive dx elements in memory order, stored as one vector:
//   channels_last, VEC = 4: four channels of one position (C % 4 == 0), four shares from one float4 load;
//   NCHW, VEC = 2 or 4: VEC elements of one row inside one window (W % VEC == 0 and KW % VEC == 0), one
//   share written VEC times; VEC = 1 otherwise (and for unaligned tensors).
// Index decomposition by magic-number dividers computed on the host (m, s pairs of FastDiv; every index
// below 2^31: the launcher sends larger tensors to the tiled kernel).

__device__ __forceinline__ int qdiv(int n, unsigned m, unsigned s) {
    return (int)((__umulhi((unsigned)n, m) + (unsigned)n) >> s);
}

__device__ __forceinline__ float exact_share(float g, float kwf, float khf) {
    return __fadd_rn(0.0f, __fdiv_rn(__fdiv_rn(g, kwf), khf));
}

template <int VEC, bool CL>
__device__ __forceinline__ void exact_body(const float* __restrict__ dy, float* __restrict__ dx, int total, int C,
                                           int H, int W, int OH, int OW, float kwf, float khf, const unsigned* q) {
    // q: magic (m, s) pairs for the divisors
    //   channels_last: C / VEC, W, H, KH, KW     (t = ((n * H + h) * W + w) * (C / VEC) + c4)
    //   NCHW:          H * W / VEC, W / VEC, -, KH, KW / VEC   (t = (plane * H + h) * (W / VEC) + wv)
    const int step = gridDim.x * blockDim.x;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += step) {
        if (CL) {
            const int cv = C / VEC;
            const int r = qdiv(t, q[0], q[1]), c = (t - r * cv) * VEC;
            const int r2 = qdiv(r, q[2], q[3]), w = r - r2 * W;
            const int n = qdiv(r2, q[4], q[5]), h = r2 - n * H;
            const int src = ((n * OH + qdiv(h, q[6], q[7])) * OW + qdiv(w, q[8], q[9])) * C + c;
            if (VEC == 4) {
                const float4 g = *reinterpret_cast<const float4*>(dy + src);
                reinterpret_cast<float4*>(dx)[t] = make_float4(exact_share(g.x, kwf, khf), exact_share(g.y, kwf, khf),
                                                               exact_share(g.z, kwf, khf), exact_share(g.w, kwf, khf));
            } else {
                dx[t] = exact_share(dy[src], kwf, khf);
            }
        } else {
            const int wvs = W / VEC;
            const int plane = qdiv(t, q[0], q[1]), r = t - plane * (H * wvs);
            const int h = qdiv(r, q[2], q[3]), wv = r - h * wvs;
            const float v = exact_share(dy[(plane * OH + qdiv(h, q[6], q[7])) * OW + qdiv(wv, q[8], q[9])], kwf, khf);
            if (VEC == 4) reinterpret_cast<float4*>(dx)[t] = make_float4(v, v, v, v);
            else if (VEC == 2) reinterpret_cast<float2*>(dx)[t] = make_float2(v, v);
            else dx[t] = v;
        }
    }
}

extern "C" __global__ void __launch_bounds__(AAP_THREADS)
adaptive_avg_pool2d_bwd_tree_exact(const float* __restrict__ dy, float* __restrict__ dx, int total, int C, int H,
                                   int W, int OH, int OW, int channels_last, int vec,
                                   unsigned m0, unsigned s0, unsigned m1, unsigned s1, unsigned m2, unsigned s2,
                                   unsigned m3, unsigned s3, unsigned m4, unsigned s4) {
    // total: threads' items (dx elements / vec)
    const unsigned q[10] = {m0, s0, m1, s1, m2, s2, m3, s3, m4, s4};
    const float kwf = (float)(W / OW), khf = (float)(H / OH);
    if (channels_last) {
        if (vec == 4) exact_body<4, true>(dy, dx, total, C, H, W, OH, OW, kwf, khf, q);
        else exact_body<1, true>(dy, dx, total, C, H, W, OH, OW, kwf, khf, q);
    } else {
        if (vec == 4) exact_body<4, false>(dy, dx, total, C, H, W, OH, OW, kwf, khf, q);
        else if (vec == 2) exact_body<2, false>(dy, dx, total, C, H, W, OH, OW, kwf, khf, q);
        else exact_body<1, false>(dy, dx, total, C, H, W, OH, OW, kwf, khf, q);
    }
}
