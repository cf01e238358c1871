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
//   tree    one thread per dx element: the windows that cover it in (oh, ow) row-major order, from
//           +0.0; each dx element written once by one thread, no atomics, no zero fill:
//           deterministic, the same bits on every GPU and equal to its CPU model.
//
// Only divisions and additions, no contraction possible: the CPU models reproduce both bit for bit
// (atomic: for the order the atomics happened to arrive in; float atomicAdd flushes subnormal
// operands and results to signed zero, and its model does too). No #include: compiles alone under NVRTC.

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
adaptive_avg_pool2d_bwd_tree(const float* __restrict__ dy, float* __restrict__ dx, long long total, int C, int H,
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
