// maxpool_bwd.cu: 2-D max-pool backward, dx = dy scattered to the forward's argmax positions.
// Launchers and CPU order models: kernels/maxpool_bwd.py.
//
// Variants (dx laid out like dy: NCHW, or channels_last = NHWC in memory; indices are flat h * W + w
// inside the (n, c) plane, as max_pool2d(return_indices=True) gives them):
//   atomic  one thread per window: atomicAdd of its gradient at its argmax (dx zeroed first).
//           NONDETERMINISTIC where windows overlap: an input that is the argmax of >= 3 windows
//           receives their gradients in arrival order, and that order decides the rounding.
//   tree    one thread per input position: gathers the gradients of the windows whose argmax it is,
//           visiting every window that can contain it in (oh, ow) row-major order from +0.0. Each dx
//           element is written once, by one thread, in a fixed order: deterministic. No zero-fill.
//           Two kernels, same order and so the same bits: maxpool_bwd_tile stages a block's dy and
//           indices (a few whole planes, NCHW; one image's positions for a group of channels,
//           channels_last) in shared memory with coalesced loads and gathers from there, so every
//           global load is independent and issued up front; maxpool_bwd_tree gathers straight from
//           global memory (one dependent index load per window) and serves planes too large to stage.
//           H200, ResNet stem pool (3x3 s2 p1, 128 x 64 x 16 x 16), GPU us per call, NCHW / channels_last:
//           atomic (with its zero fill) 11.9 / 11.9, tiled 19.5 / 17.0, global gather 32.5 / 33.7,
//           owner 16.3 / 17.5, torch's backward 30.7 / 27.7. On k x k stride-1 pools (32 x 32, C 64):
//           tiled 81 / 181 us for k = 3 / 7 against atomic's 92 / 119 and torch's 135 / 267.
//   owner   one thread per window, like atomic, but without atomics: the first window (row-major)
//           whose argmax is a position "owns" it, sums that position's windows in tree's order and
//           writes the result; other positions keep the zero fill. Each dx element is written by at
//           most one thread after the fill: deterministic, the same bits as tree. It exists because
//           tree's one-thread-per-input gather ran at 2.7x atomic on the ResNet stem pool (H200,
//           batch 128: 32.5 us vs 11.9 us); owner does atomic's amount of work plus a few cached
//           index loads per window. Measured (H200, batch 128): 1.37x atomic on the NCHW stem pool,
//           1.47x channels_last, 2-3.4x on the stride-1 contention pools (every owner re-walks the
//           crowded windows); tree's tiled kernel is the faster one except on the NCHW stem pool.
//
// Only additions, no contraction possible: the CPU models reproduce both bit for bit (atomic: for the
// order the atomics happened to arrive in), including the flush of subnormal operands and results to
// signed zero that float atomicAdd does (atomic only; the ordinary FADDs of tree and owner keep
// subnormals: kernels/runtime.py compiles without -ftz).
// No #include: the file compiles alone under NVRTC.

#define MPB_THREADS 256
#define MPB_INT32_MAX 2147483647LL

// ------------------------------------------------------------------------------------------------
// atomic

// I: the index type (int when every index of the launch fits, else long long).
template <typename I, bool CHANNELS_LAST>
__device__ __forceinline__ void atomic_body(const float* __restrict__ dy, const long long* __restrict__ idx,
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
        atomicAdd(dx + at, dy[o]);  // arrival order decides the rounding where argmaxes collide
    }
}

extern "C" __global__ void __launch_bounds__(MPB_THREADS)
maxpool_bwd_atomic(const float* __restrict__ dy, const long long* __restrict__ idx, float* __restrict__ dx,
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
__device__ __forceinline__ void tree_body(const float* __restrict__ dy, const long long* __restrict__ idx,
                                          float* __restrict__ dx, I total, const Pool P) {
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
                if (idx[o] == target) acc += dy[o];
            }
        }
        dx[e] = acc;
    }
}

extern "C" __global__ void __launch_bounds__(MPB_THREADS)
maxpool_bwd_tree(const float* __restrict__ dy, const long long* __restrict__ idx, float* __restrict__ dx,
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
maxpool_bwd_tile(const float* __restrict__ dy, const long long* __restrict__ idx, float* __restrict__ dx,
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
            sdy[j] = dy[gin + j];
        }
        __syncthreads();
        const int tx = t & ((1 << shift) - 1), ty = t >> shift, TX = 1 << shift, TY = MPB_THREADS >> shift;
        float* out = dx + p0 * HW;
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
                out[(long long)p * HW + target] = acc;
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
                g = dy[at];
            }
            sidx[j] = (i >= 0 && i < HW) ? (int)i : -1;
            sdy[j] = g;
        }
        __syncthreads();
        const int cc = t & (group - 1), step = MPB_THREADS >> shift;
        if (cc < nc) {
            float* out = dx + n * HW * (long long)C + c0 + cc;
            for (int pos = t >> shift; pos < HW; pos += step) {
                const int h = pos / W, w = pos - h * W;
                const int2 rr = rows[h], cr = cols[w];
                float acc = 0.0f;
                for (int oh = rr.x; oh < rr.y; ++oh)      // row-major over the windows: tree's order
                    for (int ow = cr.x; ow < cr.y; ++ow) {
                        const int o = ((oh * OW + ow) << shift) + cc;
                        if (sidx[o] == pos) acc += sdy[o];
                    }
                out[(long long)pos * C] = acc;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// owner

template <typename I, bool CHANNELS_LAST>
__device__ __forceinline__ void owner_body(const float* __restrict__ dy, const long long* __restrict__ idx,
                                           float* __restrict__ dx, I total, const Pool P) {
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
                acc += dy[o2];
            }
        }
        if (owner) dx[at] = acc;
    }
}

extern "C" __global__ void __launch_bounds__(MPB_THREADS)
maxpool_bwd_owner(const float* __restrict__ dy, const long long* __restrict__ idx, float* __restrict__ dx,
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
