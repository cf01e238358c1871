// upsample_bilinear2d_bwd.cu: backward of F.interpolate(x, (OH, OW), mode="bilinear", align_corners=...):
// dx (N, C, H, W) from dy (N, C, OH, OW). Launchers and CPU order models: kernels/upsample_bilinear2d_bwd.py.
//
// Weights exactly as aten's CUDA upsample_bilinear2d(_backward) computes them, in float32 (its
// accscalar_t for float): per axis, scale s (the host computes it, (in-1)/(out-1) or in/out, and passes
// its bits), source index r(o) = s * o (align_corners) or max(fma(s, o + 0.5, -0.5), 0) (nvcc contracts
// torch's `scale * (dst_index + 0.5) - 0.5` into one FMA), i0 = (int)r, i1 = i0 + (i0 < in - 1),
// l1 = r - i0, l0 = 1 - l1. dy[oh, ow] = d sends four products, issued in this order:
//     (l0h * l0w) * d -> (i0h, i0w),  (l0h * l1w) * d -> (i0h, i1w),
//     (l1h * l0w) * d -> (i1h, i0w),  (l1h * l1w) * d -> (i1h, i1w)
// (at the last row or column i1 = i0, so an element can receive two of them). Where OH == H and OW == W
// torch copies dy instead; the launchers do the same.
// dx is laid out like dy (NCHW, or channels_last = NHWC in memory).
//
// Variants:
//   atomic  one thread per dy element: the four products atomicAdd-ed into dx (zeroed first), as
//           torch's CUDA backward does. NONDETERMINISTIC wherever an element receives >= 3 products
//           (any upsampling): their arrival order decides the rounding.
//   tree    one thread per dx element: the dy elements that touch it in (oh, ow) row-major order, and
//           within one dy element its products in the order above, from +0.0. Each dx element is
//           written once by one thread, no atomics, no zero fill: deterministic, the same bits on every
//           GPU and equal to its CPU model. Two kernels, same arithmetic, same bits:
//           _tabled (the launcher's choice where the tables fit in shared memory): a block first
//             tabulates per axis, for every dx position p, the range of outputs touching it (those
//             with i0 in {p-1, p}, contiguous since i0 is non-decreasing) and the weight the k-th of
//             them gives p (k-major, so adjacent threads read adjacent words); a thread then only
//             multiplies and adds. Only the last row and column (i0 == i1 there) can take two products
//             from one dy element; their second weight l1 is recomputed on the spot. Index
//             decomposition by multiply-shift dividers; blocks loop over the elements. Where every
//             position takes at most one dy element per axis (downsampling by 2 or more), _tabled1: the
//             same arithmetic with four elements' loads in flight per thread.
//           _direct (any size): weights computed per product, ranges by binary search over the taps.
//
// Products and additions are explicit _rn intrinsics, so nothing is contracted besides the source
// index FMA, which the CPU model reproduces exactly (the product of two floats is exact in double).

#include "common.cuh"  // FastDiv, fast_div

#define UBB_THREADS 256
#define UBB_INT32_MAX 2147483647LL

struct Axis {
    int in, out, align;
    float scale;
};

struct Tap {
    int i0, i1;
    float l0, l1;
};

__device__ __forceinline__ Tap make_tap(const Axis A, int o) {
    float r;
    if (A.align) {
        r = __fmul_rn(A.scale, (float)o);
    } else {
        r = __fmaf_rn(A.scale, __fadd_rn((float)o, 0.5f), -0.5f);
        r = r < 0.0f ? 0.0f : r;
    }
    Tap t;
    t.i0 = (int)r;
    t.i1 = t.i0 + (t.i0 < A.in - 1 ? 1 : 0);
    t.l1 = __fsub_rn(r, (float)t.i0);
    t.l0 = __fsub_rn(1.0f, t.l1);
    return t;
}

// ------------------------------------------------------------------------------------------------
// atomic

template <typename I, bool CL>
__device__ __forceinline__ void atomic_body(const float* __restrict__ dy, float* __restrict__ dx, I total, int C,
                                            const Axis AH, const Axis AW) {
    const I step = (I)gridDim.x * blockDim.x;
    for (I o = (I)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += step) {
        int oh, ow;
        I base, stride;  // dx offset of element (0, 0) of the plane; distance between positions
        if (CL) {  // o = ((n * OH + oh) * OW + ow) * C + c
            const I c = o % C;
            I r = o / C;
            ow = (int)(r % AW.out);
            r /= AW.out;
            oh = (int)(r % AH.out);
            const I n = r / AH.out;
            base = n * AH.in * AW.in * C + c;
            stride = C;
        } else {   // o = (plane * OH + oh) * OW + ow
            ow = (int)(o % AW.out);
            const I r = o / AW.out;
            oh = (int)(r % AH.out);
            base = (r / AH.out) * AH.in * AW.in;
            stride = 1;
        }
        const Tap th = make_tap(AH, oh), tw = make_tap(AW, ow);
        const float d = dy[o];
        const I r0 = (I)th.i0 * AW.in, r1 = (I)th.i1 * AW.in;
        // arrival order decides the rounding where products collide
        atomicAdd(dx + base + (r0 + tw.i0) * stride, __fmul_rn(__fmul_rn(th.l0, tw.l0), d));
        atomicAdd(dx + base + (r0 + tw.i1) * stride, __fmul_rn(__fmul_rn(th.l0, tw.l1), d));
        atomicAdd(dx + base + (r1 + tw.i0) * stride, __fmul_rn(__fmul_rn(th.l1, tw.l0), d));
        atomicAdd(dx + base + (r1 + tw.i1) * stride, __fmul_rn(__fmul_rn(th.l1, tw.l1), d));
    }
}

extern "C" __global__ void __launch_bounds__(UBB_THREADS)
upsample_bilinear2d_bwd_atomic(const float* __restrict__ dy, float* __restrict__ dx, long long total, int C, int H,
                               int W, int OH, int OW, int align_corners, int scale_h_bits, int scale_w_bits,
                               int channels_last) {
    const Axis AH = {H, OH, align_corners, __int_as_float(scale_h_bits)};
    const Axis AW = {W, OW, align_corners, __int_as_float(scale_w_bits)};
    const long long dx_total = total / ((long long)OH * OW) * H * W;
    const bool narrow = total + (long long)gridDim.x * blockDim.x <= UBB_INT32_MAX && dx_total <= UBB_INT32_MAX;
    if (channels_last) {
        if (narrow) atomic_body<int, true>(dy, dx, (int)total, C, AH, AW);
        else atomic_body<long long, true>(dy, dx, total, C, AH, AW);
    } else {
        if (narrow) atomic_body<int, false>(dy, dx, (int)total, C, AH, AW);
        else atomic_body<long long, false>(dy, dx, total, C, AH, AW);
    }
}

// ------------------------------------------------------------------------------------------------
// tree

// The taps of one axis: from the block's shared-memory table (SMEM), or computed on the spot.
template <bool SMEM>
struct Taps {
    Axis A;
    const Tap* table;
    __device__ __forceinline__ Tap operator[](int o) const {
        if (SMEM) return table[o];
        return make_tap(A, o);
    }
    // The first output index o in [0, out] with i0(o) >= target (out if none): i0 is non-decreasing.
    __device__ __forceinline__ int lower_bound(int target) const {
        int lo = 0, hi = A.out;
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if ((*this)[mid].i0 >= target) hi = mid;
            else lo = mid + 1;
        }
        return lo;
    }
};

template <typename I, bool CL, bool SMEM>
__device__ __forceinline__ void tree_body(const float* __restrict__ dy, float* __restrict__ dx, I total, int C,
                                          const Taps<SMEM> TH, const Taps<SMEM> TW) {
    const int H = TH.A.in, W = TW.A.in, OH = TH.A.out, OW = TW.A.out;
    const I step = (I)gridDim.x * blockDim.x;
    for (I t = (I)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += step) {
        int h, w;
        I base, stride;  // dy offset of element (0, 0) of the plane; distance between elements
        if (CL) {  // t = ((n * H + h) * W + w) * C + c
            const I c = t % C;
            I r = t / C;
            w = (int)(r % W);
            r /= W;
            h = (int)(r % H);
            const I n = r / H;
            base = n * OH * OW * C + c;
            stride = C;
        } else {   // t = (plane * H + h) * W + w
            w = (int)(t % W);
            const I r = t / W;
            h = (int)(r % H);
            base = (r / H) * OH * OW;
            stride = 1;
        }
        // dy rows that touch row h: i0 == h (weight l0) or i1 == h, i.e. i0 in {h - 1, h}.
        const int oh0 = TH.lower_bound(h - 1), oh1 = TH.lower_bound(h + 1);
        const int ow0 = TW.lower_bound(w - 1), ow1 = TW.lower_bound(w + 1);
        float acc = 0.0f;
        for (int oh = oh0; oh < oh1; ++oh) {       // row-major over dy: tree's order
            const Tap th = TH[oh];
            const bool a0 = th.i0 == h, a1 = th.i1 == h;
            const I row = base + (I)oh * OW * stride;
            for (int ow = ow0; ow < ow1; ++ow) {
                const Tap tw = TW[ow];
                const bool b0 = tw.i0 == w, b1 = tw.i1 == w;
                const float d = dy[row + (I)ow * stride];
                // this dy element's products in the order torch issues them
                if (a0 && b0) acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(th.l0, tw.l0), d));
                if (a0 && b1) acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(th.l0, tw.l1), d));
                if (a1 && b0) acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(th.l1, tw.l0), d));
                if (a1 && b1) acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(th.l1, tw.l1), d));
            }
        }
        dx[t] = acc;  // t enumerates dx in memory order in both layouts
    }
}

extern "C" __global__ void __launch_bounds__(UBB_THREADS)
upsample_bilinear2d_bwd_tree_direct(const float* __restrict__ dy, float* __restrict__ dx, long long total, int C,
                                    int H, int W, int OH, int OW, int align_corners, int scale_h_bits,
                                    int scale_w_bits, int channels_last) {
    const Axis AH = {H, OH, align_corners, __int_as_float(scale_h_bits)};
    const Axis AW = {W, OW, align_corners, __int_as_float(scale_w_bits)};
    const Taps<false> TH = {AH, nullptr}, TW = {AW, nullptr};
    const long long dy_total = total / ((long long)H * W) * OH * OW;
    const bool narrow = total + (long long)gridDim.x * blockDim.x <= UBB_INT32_MAX && dy_total <= UBB_INT32_MAX;
    if (channels_last) {
        if (narrow) tree_body<int, true, false>(dy, dx, (int)total, C, TH, TW);
        else tree_body<long long, true, false>(dy, dx, total, C, TH, TW);
    } else {
        if (narrow) tree_body<int, false, false>(dy, dx, (int)total, C, TH, TW);
        else tree_body<long long, false, false>(dy, dx, total, C, TH, TW);
    }
}

// ---- tabled

// q = n / d, r = n - q * d: multiply-shift for the int path, plain division for the 64-bit one.
__device__ __forceinline__ int divmod(const FastDiv f, int n, int& r) {
    const int q = fast_div(f, n);
    r = n - q * (int)f.d;
    return q;
}
__device__ __forceinline__ long long divmod(const FastDiv f, long long n, int& r) {
    const long long q = n / f.d;
    r = (int)(n - q * f.d);
    return q;
}

// The first output o in [0, out] with i0(o) >= target (out if none).
__device__ __forceinline__ int first_reaching(const Axis A, int target) {
    int lo = 0, hi = A.out;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (make_tap(A, mid).i0 >= target) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

// Fills one axis's tables: range[p] = [first, end) of the outputs touching p (at most K of them, as
// the launcher computed), and wt[k * in + p] = the weight the k-th of them gives p.
__device__ __forceinline__ void fill_ranges(const Axis A, int K, int2* range) {
    for (int p = threadIdx.x; p < A.in; p += blockDim.x) {
        const int first = first_reaching(A, p - 1), end = first_reaching(A, p + 1);
        range[p] = make_int2(first, min(end, first + K));  // min: never past the table (K is exact)
    }
}

__device__ __forceinline__ void fill_weights(const Axis A, int K, const int2* range, float* wt) {
    for (int e = threadIdx.x; e < K * A.in; e += blockDim.x) {
        const int k = e / A.in, p = e - k * A.in;
        const int o = range[p].x + k;
        float v = 0.0f;
        if (o < range[p].y) {
            const Tap t = make_tap(A, o);
            v = t.i0 == p ? t.l0 : t.l1;  // i0 == p: p is its first tap (and maybe also its second)
        }
        wt[e] = v;
    }
}

// dx element t's position (h, w) and the dy offset of element (0, 0) of its plane; ``stride``: the
// distance between dy elements of the plane.
template <typename I, bool CL>
__device__ __forceinline__ I locate(I t, int C, int OH, int OW, const FastDiv dC, const FastDiv dW, const FastDiv dH,
                                    int& h, int& w, I& stride) {
    if (CL) {  // t = ((n * H + h) * W + w) * C + c
        int c;
        const I r = divmod(dC, t, c);
        const I n = divmod(dH, divmod(dW, r, w), h);
        stride = C;
        return n * OH * OW * C + c;
    }
    const I plane = divmod(dH, divmod(dW, t, w), h);  // t = (plane * H + h) * W + w
    stride = 1;
    return plane * OH * OW;
}

// Rare (last row or column, where i0 == i1 == p): after the (first, first) product, the products that
// involve a second tap (bh: along h, bw: along w), in torch's order; their weights l1 recomputed.
__device__ __forceinline__ float second_taps(float acc, const Axis AH, const Axis AW, int oh, int ow, float lh,
                                             float lw, float d, bool bh, bool bw) {
    const float lh1 = make_tap(AH, oh).l1, lw1 = make_tap(AW, ow).l1;
    if (bw) acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(lh, lw1), d));
    if (bh) acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(lh1, lw), d));
    if (bh && bw) acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(lh1, lw1), d));
    return acc;
}

template <typename I, bool CL>
__device__ __forceinline__ void tabled_body(const float* __restrict__ dy, float* __restrict__ dx, I total, int C,
                                            const Axis AH, const Axis AW, const FastDiv dC, const FastDiv dW,
                                            const FastDiv dH, const int2* __restrict__ rangeH,
                                            const int2* __restrict__ rangeW, const float* __restrict__ wtH,
                                            const float* __restrict__ wtW, int lastH, int lastW) {
    const int H = AH.in, W = AW.in, OH = AH.out, OW = AW.out;
    const I step = (I)gridDim.x * blockDim.x;
    for (I t = (I)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += step) {
        int h, w;
        I stride;
        const I base = locate<I, CL>(t, C, OH, OW, dC, dW, dH, h, w, stride);
        const int2 rh = rangeH[h], rw = rangeW[w];
        // outputs from which p takes two products (i0 == i1 == p): only at the last row / column
        const int twoH = h == H - 1 ? lastH : 0x7fffffff, twoW = w == W - 1 ? lastW : 0x7fffffff;
        float acc = 0.0f;
        for (int oh = rh.x, kh = 0; oh < rh.y; ++oh, ++kh) {   // row-major over dy: tree's order
            const float lh = wtH[kh * H + h];
            const I row = base + (I)oh * OW * stride;
            for (int ow = rw.x, kw = 0; ow < rw.y; ++ow, ++kw) {
                const float lw = wtW[kw * W + w];
                const float d = dy[row + (I)ow * stride];
                acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(lh, lw), d));   // (first tap h, first tap w)
                if (oh >= twoH || ow >= twoW) acc = second_taps(acc, AH, AW, oh, ow, lh, lw, d, oh >= twoH, ow >= twoW);
            }
        }
        dx[t] = acc;  // t enumerates dx in memory order in both layouts
    }
}

// KH == KW == 1 (downsampling by 2 or more on both axes): a dx element takes at most one dy element
// (two or four products from it at the last row or column). The same arithmetic as tabled_body, but a
// thread handles UBB_ILP elements (t, t + step, ...) at once, their dy loads issued together: with
// one load per element, tabled_body's loop waits one memory latency per element.
#define UBB_ILP 4

template <typename I, bool CL>
__device__ __forceinline__ void tabled1_body(const float* __restrict__ dy, float* __restrict__ dx, I total, int C,
                                             const Axis AH, const Axis AW, const FastDiv dC, const FastDiv dW,
                                             const FastDiv dH, const int2* __restrict__ rangeH,
                                             const int2* __restrict__ rangeW, const float* __restrict__ wtH,
                                             const float* __restrict__ wtW, int lastH, int lastW) {
    const int H = AH.in, W = AW.in, OH = AH.out, OW = AW.out;
    const I step = (I)gridDim.x * blockDim.x;
    for (I t0 = (I)blockIdx.x * blockDim.x + threadIdx.x; t0 < total; t0 += UBB_ILP * step) {
        int hs[UBB_ILP], ws[UBB_ILP], ohs[UBB_ILP], ows[UBB_ILP];
        float d[UBB_ILP];
#pragma unroll
        for (int j = 0; j < UBB_ILP; ++j) {
            const I t = t0 + (I)j * step;
            ohs[j] = -1;
            d[j] = 0.0f;
            if (t >= total) continue;
            int h, w;
            I stride;
            const I base = locate<I, CL>(t, C, OH, OW, dC, dW, dH, h, w, stride);
            hs[j] = h;
            ws[j] = w;
            const int2 rh = rangeH[h], rw = rangeW[w];
            if (rh.x < rh.y && rw.x < rw.y) {
                ohs[j] = rh.x;
                ows[j] = rw.x;
                d[j] = dy[base + ((I)rh.x * OW + rw.x) * stride];
            }
        }
#pragma unroll
        for (int j = 0; j < UBB_ILP; ++j) {
            const I t = t0 + (I)j * step;
            if (t >= total) continue;
            float acc = 0.0f;
            const int oh = ohs[j], ow = ows[j];
            if (oh >= 0) {
                const int h = hs[j], w = ws[j];
                const float lh = wtH[h], lw = wtW[w];
                acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(lh, lw), d[j]));
                const bool bh = h == H - 1 && oh >= lastH, bw = w == W - 1 && ow >= lastW;
                if (bh || bw) acc = second_taps(acc, AH, AW, oh, ow, lh, lw, d[j], bh, bw);
            }
            dx[t] = acc;
        }
    }
}

// total = dx elements; KH, KW = the most outputs touching one input position per axis. Dynamic shared
// memory, in this order (the launcher sizes it the same way): FastDiv[3] (64 bytes: C, W, H) |
// int2 rangeH[H] | int2 rangeW[W] | float wtH[KH * H] | float wtW[KW * W] | int lastH, lastW.
template <bool ONE>
__device__ __forceinline__ void tabled_kernel(const float* __restrict__ dy, float* __restrict__ dx, long long total,
                                              int C, int H, int W, int OH, int OW, int align_corners,
                                              int scale_h_bits, int scale_w_bits, int channels_last, int KH, int KW) {
    const Axis AH = {H, OH, align_corners, __int_as_float(scale_h_bits)};
    const Axis AW = {W, OW, align_corners, __int_as_float(scale_w_bits)};
    extern __shared__ __align__(16) unsigned char smem[];
    FastDiv* divs = reinterpret_cast<FastDiv*>(smem);
    int2* rangeH = reinterpret_cast<int2*>(smem + 64);
    int2* rangeW = rangeH + H;
    float* wtH = reinterpret_cast<float*>(rangeW + W);
    float* wtW = wtH + (long long)KH * H;
    int* last = reinterpret_cast<int*>(wtW + (long long)KW * W);
    if (threadIdx.x < 3) divs[threadIdx.x] = make_fastdiv((unsigned)(threadIdx.x == 0 ? C : threadIdx.x == 1 ? W : H));
    if (threadIdx.x == 32) last[0] = first_reaching(AH, H - 1);  // outputs with i0 == H - 1 (== i1)
    if (threadIdx.x == 64) last[1] = first_reaching(AW, W - 1);
    fill_ranges(AH, KH, rangeH);
    fill_ranges(AW, KW, rangeW);
    __syncthreads();
    fill_weights(AH, KH, rangeH, wtH);
    fill_weights(AW, KW, rangeW, wtW);
    __syncthreads();
    const FastDiv dC = divs[0], dW = divs[1], dH = divs[2];
    const long long dy_total = total / ((long long)H * W) * OH * OW;
    const bool narrow = total + (long long)gridDim.x * blockDim.x <= UBB_INT32_MAX && dy_total <= UBB_INT32_MAX;
#define UBB_TABLED_ARGS C, AH, AW, dC, dW, dH, rangeH, rangeW, wtH, wtW, last[0], last[1]
    if (ONE) {
        if (channels_last) {
            if (narrow) tabled1_body<int, true>(dy, dx, (int)total, UBB_TABLED_ARGS);
            else tabled1_body<long long, true>(dy, dx, total, UBB_TABLED_ARGS);
        } else {
            if (narrow) tabled1_body<int, false>(dy, dx, (int)total, UBB_TABLED_ARGS);
            else tabled1_body<long long, false>(dy, dx, total, UBB_TABLED_ARGS);
        }
    } else if (channels_last) {
        if (narrow) tabled_body<int, true>(dy, dx, (int)total, UBB_TABLED_ARGS);
        else tabled_body<long long, true>(dy, dx, total, UBB_TABLED_ARGS);
    } else {
        if (narrow) tabled_body<int, false>(dy, dx, (int)total, UBB_TABLED_ARGS);
        else tabled_body<long long, false>(dy, dx, total, UBB_TABLED_ARGS);
    }
#undef UBB_TABLED_ARGS
}

#define UBB_TABLED_PARAMS                                                                                \
    const float* __restrict__ dy, float* __restrict__ dx, long long total, int C, int H, int W, int OH, int OW, \
        int align_corners, int scale_h_bits, int scale_w_bits, int channels_last, int KH, int KW
#define UBB_TABLED_PASS dy, dx, total, C, H, W, OH, OW, align_corners, scale_h_bits, scale_w_bits, channels_last, KH, KW

extern "C" __global__ void __launch_bounds__(UBB_THREADS) upsample_bilinear2d_bwd_tree_tabled(UBB_TABLED_PARAMS) {
    tabled_kernel<false>(UBB_TABLED_PASS);
}

// KH == KW == 1 only (the launcher checks): tabled1_body.
extern "C" __global__ void __launch_bounds__(UBB_THREADS) upsample_bilinear2d_bwd_tree_tabled1(UBB_TABLED_PARAMS) {
    tabled_kernel<true>(UBB_TABLED_PASS);
}
