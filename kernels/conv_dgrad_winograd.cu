// conv_dgrad_winograd.cu: data gradient of a 3x3, stride-1, undilated convolution by Winograd's minimal
// filtering F(2x2, 3x3), transforms fused into one GEMM kernel. Launchers and CPU order model:
// kernels/conv_dgrad_winograd.py.
//
// The data gradient is a stride-1 correlation of dy with the flipped, transposed weights:
//     dx[n, k, y, x] = sum over (c, r, s) of Wt[k, c, r, s] * dy[n, c, y + r - q_h, x + s - q_w],
//     Wt[k, c, r, s] = w[c, k, 2 - r, 2 - s],  q = 2 - padding,  dy read as zero outside its extent
// (k: the conv's input channels, the outputs here; c: its output channels, the reduction). The same kernel
// computes a stride-1 forward conv (Wt = w, q = padding, dy = x): the "flip" argument of the filter
// transform picks the form. Cut dx into 2x2 tiles t = (n, P, Q) (rows 2P, 2P+1, cols 2Q, 2Q+1; tiles past
// the edge are computed and not stored); a tile's outputs are the correlation of a 4x4 patch d of dy
// (rows 2P - q_h .. 2P - q_h + 3) with g = Wt[k, c], which F(2x2, 3x3) computes with 16 products
// instead of 36:
//     y = A^T [ (G g G^T) (.) (B^T d B) ] A,
//     B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1],  G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1],
//     A^T = [1 1 1 0; 0 1 -1 -1].
// With U[xi][c][k] = (G g G^T)[xi] and V[xi][c][t] = (B^T d B)[xi] (xi = 4a + b), the sum over c is 16
// GEMMs M[xi][k][t] = sum_c U[xi][c][k] V[xi][c][t], and the output transform is applied per (k, t).
//
// Fused: wino_dgrad_filter writes U (16 * C * Kp floats, Kp: K rounded up to a block's 32 outputs, zeros
// past K) once per call; wino_dgrad_{nchw,cl} then compute, per block, 32 tiles x 32 outputs k: for every
// stage of 8 channels c, each thread transforms one (tile, c) patch of dy into shared memory (V) while the
// block copies U's stage beside it; each thread then accumulates an 8 k x 8 t block of one xi's GEMM in
// registers (an FFMA chain over c = 0, 1, ..., C - 1 per element, nothing else added to it); after the
// last stage the 16 xi of each (k, t) meet in shared memory for the output transform, and dx is stored
// once. V and M never touch global memory.
//
// Determinism: every dx element is one fixed expression of its inputs (no atomics, no split of the
// reduction, the same order in every block and on every GPU): bitwise reproducible.
//
// Arithmetic, in the order the CPU model reproduces (kernels/conv_dgrad_winograd.py):
//   U first along r, then along s, each  e0, h*((e0 + e2) + e1), h*((e0 + e2) - e1), e2  (h = 0.5:
//     the products are exact, and __fmul_rn keeps them from being contracted into a later addition,
//     which would differ for subnormal operands);
//   V first along rows, then along columns, each  e0 - e2, e1 + e2, e2 - e1, e1 - e3;
//   M with FFMA from +0 (the one part a CPU does not reproduce bit for bit);
//   y first along rows, then along columns, each  (e0 + e1) + e2, (e1 - e2) - e3.

#include "common.cuh"  // cp_async16, winograd_input_transform

#define WD_THREADS 256
#define WD_TILES 32      // 2x2 tiles per block
#define WD_OUT 32        // output channels k per block
#define WD_STAGE 8       // reduction channels c per stage
#define WD_VROW 36       // V row stride (floats): conflict-free stores for both loader maps, float4 reads
#define WD_UROW 32       // U row stride
#define WD_VSIZE (16 * WD_STAGE * WD_VROW)
#define WD_USIZE (16 * WD_STAGE * WD_UROW)
#define WD_SMEM (WD_VSIZE + 2 * WD_USIZE)  // floats of dynamic shared memory (51200 bytes)

// ------------------------------------------------------------------------------------------------
// Filter transform: one thread per (c, k), k fastest (coalesced stores of U rows).

extern "C" __global__ void __launch_bounds__(WD_THREADS)
wino_dgrad_filter(const float* __restrict__ w, float* __restrict__ U, int K, int C, int Kp, long long swk,
                  long long swc, long long swr, long long sws, int flip) {
    const long long total = (long long)C * Kp, plane = (long long)C * Kp;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const int k = (int)(e % Kp), c = (int)(e / Kp);
        float g[3][3];
#pragma unroll
        for (int r = 0; r < 3; ++r)
#pragma unroll
            for (int s = 0; s < 3; ++s)
                g[r][s] = k < K ? __ldg(w + k * swk + c * swc + (flip ? 2 - r : r) * swr + (flip ? 2 - s : s) * sws)
                                : 0.0f;
        float t[4][3];
#pragma unroll
        for (int s = 0; s < 3; ++s) {   // G g: along r
            const float a = g[0][s] + g[2][s];
            t[0][s] = g[0][s];
            t[1][s] = __fmul_rn(0.5f, a + g[1][s]);
            t[2][s] = __fmul_rn(0.5f, a - g[1][s]);
            t[3][s] = g[2][s];
        }
        float* out = U + (long long)c * Kp + k;
#pragma unroll
        for (int a = 0; a < 4; ++a) {   // (G g) G^T: along s
            const float b = t[a][0] + t[a][2];
            out[(4 * a + 0) * plane] = t[a][0];
            out[(4 * a + 1) * plane] = __fmul_rn(0.5f, b + t[a][1]);
            out[(4 * a + 2) * plane] = __fmul_rn(0.5f, b - t[a][1]);
            out[(4 * a + 3) * plane] = t[a][2];
        }
    }
}

// ------------------------------------------------------------------------------------------------
// The fused GEMM. Loader map (one (tile, c) patch per thread and stage): NCHW, a warp takes 32 tiles of one
// channel (neighbouring columns); channels_last, 4 tiles x 8 channels (32-byte runs of a pixel's
// channels). Compute map: xi = tid / 16, and the 16 threads of an xi hold 4 x 4 blocks of 8 k x 8 t.
// Output map: NCHW, passes over k (a warp stores 32 tiles of one k); channels_last, passes over tiles (a
// warp stores 32 consecutive k of one tile).

template <bool CL>
__device__ __forceinline__ void wino_dgrad_body(
        const float* __restrict__ in, const float* __restrict__ U, float* __restrict__ out, int C, int K, int Kp,
        int IH, int IW, int OH, int OW, int qh, int qw, int TP, int TQ, int T, long long sin_n, long long sin_c,
        long long sin_h, long long sin_w, long long so_n, long long so_c, long long so_h, long long so_w) {
    extern __shared__ __align__(16) float smem[];      // WD_SMEM floats
    float* Vs = smem;                                   // [16][WD_STAGE][WD_VROW]
    float* Us = smem + WD_VSIZE;                        // two buffers [16][WD_STAGE][WD_UROW]
    const int tid = threadIdx.x;
    const int t0 = blockIdx.x * WD_TILES, k0 = blockIdx.y * WD_OUT;

    // loader: tile lt, channel lc of each stage
    const int lt = CL ? tid / WD_STAGE : tid % WD_TILES;
    const int lc = CL ? tid % WD_STAGE : tid / WD_TILES;
    const int tl = t0 + lt;
    const bool tile_ok = tl < T;
    int n = 0, P = 0, Q = 0;
    if (tile_ok) {
        n = tl / (TP * TQ);
        const int l = tl - n * (TP * TQ);
        P = l / TQ;
        Q = l - P * TQ;
    }
    // the patch's in-bounds taps as a 16-bit mask (bit 4i + j: row i, column j), its offsets from row and
    // column strides: no per-tap registers (the launcher checks that spatial offsets fit in 32 bits)
    const int h0 = 2 * P - qh, w0 = 2 * Q - qw;
    unsigned mask = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (tile_ok && (unsigned)(h0 + i) < (unsigned)IH && (unsigned)(w0 + j) < (unsigned)IW)
                mask |= 1u << (4 * i + j);
    const int ish = (int)sin_h, isw = (int)sin_w;
    const float* pin = in + n * sin_n + (h0 * ish + w0 * isw);

    // a stage's global reads: this thread's 4x4 patch of dy into registers, and its four 16-byte pieces of
    // U's stage (16 x 8 rows of 32 k) into shared memory by cp.async, zeros past C
    auto load_patch = [&](int c0, float (&d)[4][4]) {
        const int c = c0 + lc;
        const unsigned live = c < C ? mask : 0u;
        const float* pc = pin + c * sin_c;
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                d[i][j] = (live >> (4 * i + j)) & 1u ? __ldg(pc + (i * ish + j * isw)) : 0.0f;
    };
    // U: piece i of this thread is row (tid / 8 + 32 i) = (xi, c) = (tid / 64 + 4 i, (tid / 8) % 8), k4 = tid % 8
    const int uc = (tid / 8) % WD_STAGE;
    const float* usrc = U + ((long long)(tid / 64) * C + uc) * Kp + k0 + 4 * (tid % 8);
    const int udst = (tid / 8) * WD_UROW + 4 * (tid % 8);
    auto load_u = [&](int c0, float* ub) {
        const bool ok = c0 + uc < C;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            cp_async16(ub + udst + i * 32 * WD_UROW, ok ? usrc + (c0 + i * 4LL * C) * Kp : U, ok);
        cp_async_commit();
    };

    // compute: xi, and the 8 k x 8 t block of its GEMM
    const int xi = tid / 16, kq = (tid % 16) / 4, tq = tid % 4;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
            acc[i][j] = 0.0f;

    // one shared V buffer, two U buffers: a stage's reads are issued before the previous stage's products
    float d[4][4];
    load_patch(0, d);
    load_u(0, Us);
    for (int c0 = 0, buf = 0; c0 < C; c0 += WD_STAGE, buf ^= 1) {
        winograd_input_transform(d, Vs + lc * WD_VROW + lt, WD_STAGE * WD_VROW);   // V of this thread's patch
        cp_async_wait<0>();
        __syncthreads();
        const float* ub = Us + buf * WD_USIZE;
        if (c0 + WD_STAGE < C) {   // the next stage's reads fly while this one multiplies
            load_u(c0 + WD_STAGE, Us + (buf ^ 1) * WD_USIZE);
            load_patch(c0 + WD_STAGE, d);
        }
        const int nc = min(WD_STAGE, C - c0);
#pragma unroll
        for (int cc = 0; cc < WD_STAGE; ++cc) {
            if (cc < nc) {
                const float4* ua = reinterpret_cast<const float4*>(ub + (xi * WD_STAGE + cc) * WD_UROW + kq * 8);
                const float4* vb = reinterpret_cast<const float4*>(Vs + (xi * WD_STAGE + cc) * WD_VROW + tq * 8);
                const float4 a0 = ua[0], a1 = ua[1], b0 = vb[0], b1 = vb[1];
                const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
                const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
                for (int i = 0; i < 8; ++i)
#pragma unroll
                    for (int j = 0; j < 8; ++j)
                        acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
            }
        }
        __syncthreads();
    }

    // output transform: 4 passes, each over a quarter of the block's (k, t) pairs
    float* Ms = smem;   // [16][8][WD_VROW]: xi, then 8 k (NCHW) or 8 tiles (channels_last), then 32 of the other
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        if (p > 0)
            __syncthreads();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (CL) {   // row: tile tq * 2 + h of this pass (tile tq * 8 + 2p + h), columns k
                float4* m = reinterpret_cast<float4*>(Ms + (xi * 8 + tq * 2 + h) * WD_VROW + kq * 8);
                m[0] = make_float4(acc[0][2 * p + h], acc[1][2 * p + h], acc[2][2 * p + h], acc[3][2 * p + h]);
                m[1] = make_float4(acc[4][2 * p + h], acc[5][2 * p + h], acc[6][2 * p + h], acc[7][2 * p + h]);
            } else {    // row: k kq * 2 + h of this pass (k kq * 8 + 2p + h), columns tiles
                float4* m = reinterpret_cast<float4*>(Ms + (xi * 8 + kq * 2 + h) * WD_VROW + tq * 8);
                m[0] = make_float4(acc[2 * p + h][0], acc[2 * p + h][1], acc[2 * p + h][2], acc[2 * p + h][3]);
                m[1] = make_float4(acc[2 * p + h][4], acc[2 * p + h][5], acc[2 * p + h][6], acc[2 * p + h][7]);
            }
        }
        __syncthreads();
        const int row = tid / 32, col = tid % 32;
        const int kl = CL ? col : (row / 2) * 8 + 2 * p + row % 2;
        const int tt = CL ? (row / 2) * 8 + 2 * p + row % 2 : col;
        const int k = k0 + kl, to = t0 + tt;
        if (k < K && to < T) {
            float m[4][4];
#pragma unroll
            for (int x = 0; x < 16; ++x)
                m[x / 4][x % 4] = Ms[(x * 8 + row) * WD_VROW + col];
            float r[2][4];
#pragma unroll
            for (int b = 0; b < 4; ++b) {   // A^T m: along rows
                r[0][b] = (m[0][b] + m[1][b]) + m[2][b];
                r[1][b] = (m[1][b] - m[2][b]) - m[3][b];
            }
            const int on = to / (TP * TQ), l = to - on * (TP * TQ), oP = l / TQ, oQ = l - oP * TQ;
            float* o = out + on * so_n + k * so_c;
#pragma unroll
            for (int i = 0; i < 2; ++i) {   // (A^T m) A: along columns
                const int y = 2 * oP + i;
                if (y < OH) {
                    const float y0 = (r[i][0] + r[i][1]) + r[i][2], y1 = (r[i][1] - r[i][2]) - r[i][3];
                    o[y * (int)so_h + (2 * oQ) * (int)so_w] = y0;
                    if (2 * oQ + 1 < OW)
                        o[y * (int)so_h + (2 * oQ + 1) * (int)so_w] = y1;
                }
            }
        }
    }
}

#define WD_ARGS const float* __restrict__ in, const float* __restrict__ U, float* __restrict__ out, int C, int K, \
    int Kp, int IH, int IW, int OH, int OW, int qh, int qw, int TP, int TQ, int T, long long sin_n, long long sin_c, \
    long long sin_h, long long sin_w, long long so_n, long long so_c, long long so_h, long long so_w
#define WD_PASS in, U, out, C, K, Kp, IH, IW, OH, OW, qh, qw, TP, TQ, T, sin_n, sin_c, sin_h, sin_w, so_n, so_c, \
    so_h, so_w

extern "C" __global__ void __launch_bounds__(WD_THREADS, 2) wino_dgrad_nchw(WD_ARGS) {
    wino_dgrad_body<false>(WD_PASS);
}

extern "C" __global__ void __launch_bounds__(WD_THREADS, 2) wino_dgrad_cl(WD_ARGS) {
    wino_dgrad_body<true>(WD_PASS);
}
