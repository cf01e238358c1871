// conv_dgrad.cu: 2-D convolution data gradient dx[n,ci,h,w] = sum_{co,kh,kw} w[co,ci,kh,kw] *
// dy[n,co,oh,ow] over the taps with h = oh*s - p + kh*d (groups = 1, float32, NCHW or channels_last).
// Launchers and CPU order models: kernels/conv_dgrad.py.
//
// Variants:
//   atomic  scatter, as cuDNN's BwdData ALGO_0: a tiled SGEMM C = dy^T . w over the dy positions
//           (M = N*OH*OW rows, KH*KW*Cin columns, reduction over Cout), whose epilogue atomicAdds every C
//           element into the dx position its tap hits (col2im). NONDETERMINISTIC wherever windows overlap
//           (kernel extent > stride): the arrival order of a dx element's taps decides its rounding.
//   tree    gather: a tiled implicit GEMM over the dx positions (M = N*H*W rows, Cin columns, reduction
//           over Cout*KH*KW), one launch-grid slice per stride phase (h mod sh, w mod sw) so a block
//           visits only the taps that can hit its pixels (1 of 4 for a 3x3 stride-2 pixel on an even
//           row and column). Each dx element is one thread's FMA chain in a fixed order (taps with kh
//           then kw ascending, co ascending inside a tap) and is written once (or, split, its
//           ranges' partials are, then their sum): DETERMINISTIC. Tiles of 128 pixels x 64 channels,
//           or 128 x 128 (tree_*_wide[1], Cin >= 128): the same chains, so the same bits, either width.
//           Unsplit launches on the 128 x 64 tile may load stages of 16 output channels instead of 8
//           (tree_*_deep): the same chains again, the same bits.
//           Split K (stride 1, few blocks: small images, deep layers): the launcher splits that chain
//           into ksplit contiguous ranges of (tap, co chunk) slices, a function of the shape alone;
//           each range is one FMA chain written as a partial, and conv_dgrad_split_sum adds the
//           partials in split order: still one fixed order per element.
//           Cin <= 4 with dilation 1 (network stems) runs tree_stem instead: a few pixels per
//           thread, dy patch and weights staged in shared memory, its own fixed order.
//
// Both use FFMA, so neither matches its CPU model bit for bit (the models round each product apart).
// Self-contained: no shared header (the reductions here are GEMM accumulators, not common.cuh trees).

#define DG_BM 128            // block tile rows (pixels)
#define DG_BN 64             // block tile columns (Cin for tree, KH*KW*Cin for atomic); tree_*_wide: 128
#define DG_BK 8              // reduction slice per stage (output channels); tree_*_deep: 16
#define DG_THREADS 256       // 16 x 16 threads, each an 8 x TN register tile (TN = 4; tree_*_wide: 8)
#define DG_LDA (DG_BM + 4)   // shared row pitch: conflict-free transposed stores, float4 aligned
#define DG_MAXK 32           // largest kernel extent per axis (taps are listed in shared memory)
#define DG_STEM_MAX_THREADS 256  // tree_stem block, at most
#define DG_STEM_SPLIT 4          // tree_stem: lanes that split one pixel group's output channels

// The taps of one axis that reach stride phase r: k with (r + pad - k*dil) divisible by the stride,
// in increasing k, each with its dy offset (exact division, also for negative numerators). Returns
// how many; run by one thread, the others read the shared arrays after a barrier.
__device__ __forceinline__ int phase_taps(int r, int pad, int stride, int dil, int K, int* s_k, int* s_o) {
    int a = 0;
    for (int k = 0; k < K; ++k) {
        const int num = r + pad - k * dil;
        if (((num % stride) + stride) % stride == 0) { s_k[a] = k; s_o[a] = num / stride; ++a; }
    }
    return a;
}

// One template, two operand loaders and two epilogues (its shared arrays come from the entry points
// dgrad_gemm and dgrad_gemm_deep below, which declare them):
//   SCATTER = false (tree): rows are the dx pixels of one stride phase; A[m, (tap, co)] gathers dy at
//     the tap's position (zero outside dy); B[(tap, co), ci] = wt[kh][kw][co][ci]; C is stored to dx
//     (split K: to the split's partial buffer).
//   SCATTER = true (atomic): rows are dy pixels; A[m, co] = dy; B[co, (tap, ci)] = w_cl[co][kh][kw][ci];
//     C[m, (tap, ci)] is atomicAdd-ed into dx[n, ci, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw].
//   CL picks coalesced thread mappings for channels_last tensors (channel fastest in memory).
//   TN: columns per thread, 4 (a 128 x 64 tile) or 8 (tree only: 128 x 128, twice the FMAs per shared
//     load, for Cin >= 128). Each C element is the same FMA chain either way: the same bits.
//   BK: output channels per stage, DG_BK = 8 or 16 (tree_*_deep: half the barriers and twice the FMAs
//     between a stage's loads and their use). A chain visits the same (tap, co) in the same order either
//     way; besides those terms it holds, in a tap's last stage, the channels past Cout: A = B = +0. Such a
//     term is no identity: fma(+0, +0, acc) turns acc = -0.0 into +0.0 (-0 + +0 is +0 in round-to-
//     nearest), and a chain is -0.0 after negative products too small for a subnormal (fma(a, b, +-0)
//     rounds them to -0.0). Stages of 8 pad a tap's channels to a multiple of 8, stages of 16 to one of
//     16: 8 more such terms where Cout fills an odd number of 8-channel stages. The deep loader gives
//     those 8 B = -0.0 instead, and fma(+0, -0, acc) == acc for every acc, signed zeros included: each
//     chain ends with the bits of its 8-channel twin, for any Cout.
template <bool SCATTER, bool CL, int TN, int BK, int NT = DG_THREADS>
__device__ __forceinline__ void dgrad_gemm_body(
    const float* __restrict__ dy, const float* __restrict__ wmat, float* __restrict__ dx,
    int N, int Cin, int H, int W, int Cout, int OH, int OW, int KH, int KW,
    int sh, int sw, int ph, int pw, int dh, int dw,
    long long dy_sn, long long dy_sc, long long dy_sh, long long dy_sw,
    long long dx_sn, long long dx_sc, long long dx_sh, long long dx_sw, int skip_empty,
    int ksplit, float* __restrict__ part,
    float* smem, int* s_kh, int* s_oh, int* s_kw, int* s_ow, int& s_nkh, int& s_nkw, long long* s_row) {
    float* As = smem;                        // [2][BK][LDA], A transposed (k-major)
    constexpr int NTN = NT / 16;             // threads along the columns (16 along the rows)
    constexpr int BN = NTN * TN;             // block tile columns
    constexpr int GN = NTN * 4;              // stride between a thread's groups of 4 columns
    float* Bs = smem + 2 * BK * DG_LDA;      // [2][BK][BN]
    static_assert(2 * BK * (DG_LDA + BN) <= DG_BN * DG_LDA, "operands fit the C tile's buffer");
    static_assert(!SCATTER || TN == 4, "the scatter's tile is 128 x 64");
    static_assert(BK == 8 || BK == 16, "a stage is 8 or 16 output channels");
    static_assert(NT == DG_THREADS || (NT == 128 && TN == 8 && !SCATTER && !CL), "128 threads: NCHW tree, 8 x 8");
    constexpr int HALVES = BK / 8;           // a stage's halves of 8 channels

    const int t = threadIdx.x;
    int rh = 0, rw = 0, Hq, Wq;  // stride phase and the pixel grid of that phase
    if (SCATTER) {
        Hq = OH; Wq = OW;
    } else {
        // phases in reverse: blocks are dispatched z-slowest, and the last phase (odd row, odd column for
        // an odd kernel with "same" padding) holds the most taps: the longest blocks start first
        const int z = gridDim.z - 1 - blockIdx.z;
        rh = z / sw; rw = z % sw;
        Hq = rh < H ? (H - rh + sh - 1) / sh : 0;
        Wq = rw < W ? (W - rw + sw - 1) / sw : 0;
    }
    const int HWq = Hq * Wq;
    const int M = N * HWq;
    const int ncols = SCATTER ? KH * KW * Cin : Cin;
    // atomic: one 1-D grid with the column tile fastest, so the blocks holding the taps of one dy tile
    // (and so the overlapping contributions to one dx region) run side by side and race for real.
    const int ctiles = (ncols + BN - 1) / BN;
    // tree, split K: grid y is (column tile, split) with the split fastest; split ks reduces its own
    // contiguous range of the (tap, co chunk) slices and writes a partial tile (see the epilogue)
    const int ks = SCATTER ? 0 : (int)blockIdx.y % ksplit;
    const int m0 = (SCATTER ? (int)(blockIdx.x / ctiles) : (int)blockIdx.x) * DG_BM;
    const int c0 = (SCATTER ? (int)(blockIdx.x % ctiles) : (int)blockIdx.y / ksplit) * BN;
    if (m0 >= M) return;  // uniform over the block (phases differ in size)

    int ntaps = 1;
    if (!SCATTER) {
        // Taps that hit this phase: (rh + ph - kh*dh) divisible by sh; then oh = i + (rh + ph - kh*dh)/sh
        // for the phase row i (exact division, also for negative numerators).
        if (t == 0) {
            s_nkh = phase_taps(rh, ph, sh, dh, KH, s_kh, s_oh);
            s_nkw = phase_taps(rw, pw, sw, dw, KW, s_kw, s_ow);
        }
        __syncthreads();
        ntaps = s_nkh * s_nkw;
        if (ntaps == 0) {  // a phase no tap reaches: its dx is zero
            if (skip_empty) return;  // zero-filled before the launch
            // write the zeros here, straight (the C-tile epilogue's index arithmetic per element costs
            // more than the stores): NCHW: a thread keeps one pixel and walks channels;
            // channels_last: 16 threads cover 64 consecutive channels of a pixel with float4 stores.
            for (int cb = c0; cb < min(c0 + BN, ncols); cb += DG_BN) {
                const int nc = min(DG_BN, ncols - cb);
                if (CL && (nc & 3) == 0 && (dx_sc == 1) && ((dx_sw & 3) == 0) && ((dx_sh & 3) == 0) && ((dx_sn & 3) == 0)) {
                    for (int ml = t >> 4; ml < DG_BM; ml += NT >> 4) {
                        const int m = m0 + ml, q = (t & 15) * 4;
                        if (m >= M || q >= nc) continue;
                        const int n = m / HWq, r = m - n * HWq, i = r / Wq, j = r - i * Wq;
                        float* o = dx + (long long)n * dx_sn + (long long)(rh + sh * i) * dx_sh + (long long)(rw + sw * j) * dx_sw + cb + q;
                        *reinterpret_cast<float4*>(o) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    }
                } else {
                    const int ml = t & (DG_BM - 1), m = m0 + ml;
                    if (m < M) {
                        const int n = m / HWq, r = m - n * HWq, i = r / Wq, j = r - i * Wq;
                        float* o = dx + (long long)n * dx_sn + (long long)(rh + sh * i) * dx_sh + (long long)(rw + sw * j) * dx_sw;
                        for (int col = t / DG_BM; col < nc; col += NT / DG_BM) o[(long long)(cb + col) * dx_sc] = 0.0f;
                    }
                }
            }
            return;
        }
    }
    const int cochunks = (Cout + BK - 1) / BK;
    const int KT = ntaps * cochunks;
    const int kt0 = (int)((long long)KT * ks / ksplit), kt1 = (int)((long long)KT * (ks + 1) / ksplit);

    // A loads: NCHW -> each thread one pixel, BK * 128 / NT consecutive k (lanes run along pixels);
    //          CL   -> each thread 4 pixels, one k in each half of the stage (lanes run along channels).
    constexpr int NP = CL ? 4 : 1;
    const int a_k = CL ? (t & 7) : (t >> 7) * (DG_BM * BK / NT);
    int a_n[NP], a_i[NP], a_j[NP];
    bool a_in[NP], a_ok[NP];
    long long a_off[NP];
#pragma unroll
    for (int p = 0; p < NP; ++p) {
        const int ml = CL ? (t >> 3) + 32 * p : (t & 127);
        const int m = m0 + ml;
        a_in[p] = m < M;
        const int mm = a_in[p] ? m : 0;
        a_n[p] = mm / HWq;
        const int r = mm - a_n[p] * HWq;
        a_i[p] = r / Wq;
        a_j[p] = r - a_i[p] * Wq;
        a_ok[p] = a_in[p];
        a_off[p] = (long long)a_n[p] * dy_sn + (long long)a_i[p] * dy_sh + (long long)a_j[p] * dy_sw;
        // the epilogue's row decode, once per row here instead of once per stored element there
        if (!SCATTER && (CL ? (t & 7) == 0 : t < DG_BM))
            s_row[ml] = a_in[p] ? (long long)a_n[p] * dx_sn + (long long)(rh + sh * a_i[p]) * dx_sh +
                                      (long long)(rw + sw * a_j[p]) * dx_sw
                                : -1;
    }
    int tap = kt0 / cochunks, co0 = (kt0 - tap * cochunks) * BK, wrow = 0;  // wrow: first B row of the tap
    auto set_tap = [&](int tp) {
        if (SCATTER) return;
        const int a = tp / s_nkw, b = tp - a * s_nkw;
        const int doh = s_oh[a], dow = s_ow[b];
        wrow = (s_kh[a] * KW + s_kw[b]) * Cout;
#pragma unroll
        for (int p = 0; p < NP; ++p) {
            const int oh = a_i[p] + doh, ow = a_j[p] + dow;
            a_ok[p] = a_in[p] && oh >= 0 && oh < OH && ow >= 0 && ow < OW;
            a_off[p] = (long long)a_n[p] * dy_sn + (long long)oh * dy_sh + (long long)ow * dy_sw;
        }
    };

    // A elements a thread loads per stage; B: column passes of 32 lanes, and elements per half of 8 channels
    constexpr int RA = CL ? 4 * HALVES : DG_BM * BK / NT, CPR = BN / 32, RBH = 8 * BN / NT;
    float ra[RA], rb[RBH * HALVES];
    // A element e: pixel e % 4 and channel a_k + 8 * (e / 4) under CL, channel a_k + e under NCHW. B element
    // RBH * half + idx: channel (t >> 5) + (NT / 32) * (idx / CPR) of the half, column (t & 31) + 32 * (idx % CPR).
    auto load_tile = [&]() {
#pragma unroll
        for (int e = 0; e < RA; ++e) {
            const int p = CL ? e % 4 : 0;
            const int co = co0 + (CL ? a_k + 8 * (e / 4) : a_k + e);
            ra[e] = (a_ok[p] && co < Cout) ? __ldg(dy + a_off[p] + (long long)co * dy_sc) : 0.0f;
        }
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
            // a half wholly past Cout: channels no 8-channel stage holds, B = -0.0 (see BK above)
            const float pad = h > 0 && co0 + 8 * h >= Cout ? -0.0f : 0.0f;
#pragma unroll
            for (int e = 0; e < RBH; ++e) {
                const int co = co0 + 8 * h + (t >> 5) + (NT / 32) * (e / CPR);
                const int gc = c0 + (t & 31) + 32 * (e % CPR);
                rb[h * RBH + e] = (co < Cout && gc < ncols) ? __ldg(wmat + (long long)(wrow + co) * ncols + gc) : pad;
            }
        }
    };
    auto store_tile = [&](int buf) {
        float* A = As + buf * BK * DG_LDA;
        float* B = Bs + buf * BK * BN;
#pragma unroll
        for (int e = 0; e < RA; ++e) {
            if (CL) A[(a_k + 8 * (e / 4)) * DG_LDA + (t >> 3) + 32 * (e % 4)] = ra[e];
            else A[(a_k + e) * DG_LDA + (t & 127)] = ra[e];
        }
#pragma unroll
        for (int h = 0; h < HALVES; ++h)
#pragma unroll
            for (int e = 0; e < RBH; ++e)
                B[(8 * h + (t >> 5) + (NT / 32) * (e / CPR)) * BN + (t & 31) + 32 * (e % CPR)] = rb[h * RBH + e];
    };

    // Thread (tm, tn) owns rows tm*4 + {0..3} and 64 + tm*4 + {0..3}, columns tn*4 + {0..3} (and, TN = 8,
    // GN + tn*4 + {0..3}: 64 with 256 threads, 32 with 128).
    const int tm = t & 15, tn = t >> 4;
    float acc[8][TN];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;

    if (kt1 > kt0) {
        set_tap(tap);
        load_tile();
        store_tile(0);
        __syncthreads();
        for (int kt = kt0; kt < kt1; ++kt) {
            const int buf = (kt - kt0) & 1;
            const bool more = kt + 1 < kt1;
            if (more) {  // fetch the next slice into registers while this one is multiplied
                co0 += BK;
                if (co0 >= Cout) { co0 = 0; set_tap(++tap); }
                load_tile();
            }
            const float* A = As + buf * BK * DG_LDA;
            const float* B = Bs + buf * BK * BN;
#pragma unroll
            for (int kk = 0; kk < BK; ++kk) {
                const float4 a0 = *reinterpret_cast<const float4*>(A + kk * DG_LDA + tm * 4);
                const float4 a1 = *reinterpret_cast<const float4*>(A + kk * DG_LDA + 64 + tm * 4);
                const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
                float bv[TN];
#pragma unroll
                for (int h = 0; h < TN / 4; ++h) {
                    const float4 b = *reinterpret_cast<const float4*>(B + kk * BN + GN * h + tn * 4);
                    bv[4 * h] = b.x; bv[4 * h + 1] = b.y; bv[4 * h + 2] = b.z; bv[4 * h + 3] = b.w;
                }
#pragma unroll
                for (int i = 0; i < 8; ++i)
#pragma unroll
                    for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
            }
            if (more) store_tile(buf ^ 1);
            __syncthreads();
        }
    }

    // Epilogue through shared memory, Cs[col][row], so that lanes write along the fastest dx axis; 64
    // columns at a time (a 128-column tile: two rounds).
    float* Cs = smem;
#pragma unroll
    for (int hc = 0; hc < BN / DG_BN; ++hc) {
        if (hc > 0) __syncthreads();   // the previous round has read Cs
#pragma unroll
        for (int h = 0; h < TN / 4; ++h) {
            if (GN * h / DG_BN != hc) continue;   // this thread's column group h is in another round
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int col = GN * h - DG_BN * hc + tn * 4 + j, q = 4 * h + j;
                *reinterpret_cast<float4*>(Cs + col * DG_LDA + tm * 4) = make_float4(acc[0][q], acc[1][q], acc[2][q], acc[3][q]);
                *reinterpret_cast<float4*>(Cs + col * DG_LDA + 64 + tm * 4) = make_float4(acc[4][q], acc[5][q], acc[6][q], acc[7][q]);
            }
        }
        __syncthreads();
        const int cb = c0 + DG_BN * hc;   // this round's first column
        if (SCATTER) {
#pragma unroll 4
            for (int e = 0; e < (DG_BM * DG_BN) / NT; ++e) {
                const int idx = e * NT + t;
                const int ml = CL ? idx / DG_BN : idx % DG_BM;
                const int col = CL ? idx % DG_BN : idx / DG_BM;
                const int m = m0 + ml, gc = cb + col;
                if (m >= M || gc >= ncols) continue;
                const float v = Cs[col * DG_LDA + ml];
                const int n = m / HWq, r = m - n * HWq, i = r / Wq, j = r - i * Wq;
                const int tp = gc / Cin, ci = gc - tp * Cin, kh = tp / KW, kw = tp - kh * KW;
                const int h = i * sh - ph + kh * dh, w = j * sw - pw + kw * dw;
                if (h < 0 || h >= H || w < 0 || w >= W) continue;
                atomicAdd(dx + (long long)n * dx_sn + (long long)ci * dx_sc + (long long)h * dx_sh + (long long)w * dx_sw, v);
            }
        } else {
            // split K: partial ks goes to part + ks * (the dense dx's size), at dx's offsets
            float* out = ksplit > 1 ? part + (long long)ks * N * Cin * H * W : dx;
#pragma unroll 4
            for (int e = 0; e < (DG_BM * DG_BN) / NT; ++e) {
                const int idx = e * NT + t;
                const int ml = CL ? idx / DG_BN : idx % DG_BM;
                const int col = CL ? idx % DG_BN : idx / DG_BM;
                const long long row = s_row[ml];
                if (row < 0 || cb + col >= ncols) continue;
                out[row + (long long)(cb + col) * dx_sc] = Cs[col * DG_LDA + ml];
            }
        }
    }
}

#define DG_ARGS                                                                                    \
    const float* __restrict__ dy, const float* __restrict__ wmat, float* __restrict__ dx, int N,     \
        int Cin, int H, int W, int Cout, int OH, int OW, int KH, int KW, int sh, int sw, int ph,     \
        int pw, int dh, int dw, long long dy_sn, long long dy_sc, long long dy_sh, long long dy_sw,  \
        long long dx_sn, long long dx_sc, long long dx_sh, long long dx_sw, int skip_empty
#define DG_PASS                                                                                   \
    dy, wmat, dx, N, Cin, H, W, Cout, OH, OW, KH, KW, sh, sw, ph, pw, dh, dw, dy_sn, dy_sc, dy_sh, \
        dy_sw, dx_sn, dx_sc, dx_sh, dx_sw, skip_empty

// dgrad_gemm_body's shared memory, declared by each entry point: PTX names the arrays after the function that
// declares them, so the names in dgrad_gemm's kernels, and with them those kernels' PTX, do not depend on BK.
#define DG_GEMM_SHARED                                                                                \
    __shared__ __align__(16) float smem[DG_BN * DG_LDA]; /* operands while looping, C tile after */   \
    __shared__ int s_kh[DG_MAXK], s_oh[DG_MAXK], s_kw[DG_MAXK], s_ow[DG_MAXK];                        \
    __shared__ int s_nkh, s_nkw;                                                                       \
    __shared__ long long s_row[DG_BM]; /* tree: each tile row's dx offset (-1 past the last row) */
#define DG_GEMM_SHARED_PASS smem, s_kh, s_oh, s_kw, s_ow, s_nkh, s_nkw, s_row

// Stages of DG_BK output channels: every tree and atomic GEMM kernel but tree_*_deep.
template <bool SCATTER, bool CL, int TN = 4, int NT = DG_THREADS>
__device__ __forceinline__ void dgrad_gemm(DG_ARGS, int ksplit, float* __restrict__ part) {
    DG_GEMM_SHARED
    dgrad_gemm_body<SCATTER, CL, TN, DG_BK, NT>(DG_PASS, ksplit, part, DG_GEMM_SHARED_PASS);
}
// Stages of 16 output channels on the tree's 128 x 64 tile (tree_*_deep) or 128 x 128 (tree_*_wide_deep).
template <bool CL, int TN = 4, int NT = DG_THREADS>
__device__ __forceinline__ void dgrad_gemm_deep(DG_ARGS, int ksplit, float* __restrict__ part) {
    DG_GEMM_SHARED
    dgrad_gemm_body<false, CL, TN, 16, NT>(DG_PASS, ksplit, part, DG_GEMM_SHARED_PASS);
}

// The GEMM kernels also take the split: ksplit (1 for atomic) and the partials' buffer (null unless ksplit > 1).
extern "C" __global__ void __launch_bounds__(DG_THREADS, 2) conv_dgrad_tree_nchw(DG_ARGS, int ksplit, float* part) {
    dgrad_gemm<false, false>(DG_PASS, ksplit, part);
}
extern "C" __global__ void __launch_bounds__(DG_THREADS, 2) conv_dgrad_tree_cl(DG_ARGS, int ksplit, float* part) {
    dgrad_gemm<false, true>(DG_PASS, ksplit, part);
}
// Wide tiles (128 x 128) for Cin >= 128: the same per-element chains, fewer shared loads per FMA. Two
// register budgets: 128 a thread, two resident blocks per SM (grids of more blocks than SMs), and ~170,
// one block (fewer; no spills on channels_last, where 128 spills).
extern "C" __global__ void __launch_bounds__(DG_THREADS, 2) conv_dgrad_tree_nchw_wide(DG_ARGS, int ksplit, float* part) {
    dgrad_gemm<false, false, 8>(DG_PASS, ksplit, part);
}
extern "C" __global__ void __launch_bounds__(DG_THREADS, 2) conv_dgrad_tree_cl_wide(DG_ARGS, int ksplit, float* part) {
    dgrad_gemm<false, true, 8>(DG_PASS, ksplit, part);
}
extern "C" __global__ void __launch_bounds__(DG_THREADS, 1) conv_dgrad_tree_nchw_wide1(DG_ARGS, int ksplit, float* part) {
    dgrad_gemm<false, false, 8>(DG_PASS, ksplit, part);
}
extern "C" __global__ void __launch_bounds__(DG_THREADS, 1) conv_dgrad_tree_cl_wide1(DG_ARGS, int ksplit, float* part) {
    dgrad_gemm<false, true, 8>(DG_PASS, ksplit, part);
}
extern "C" __global__ void __launch_bounds__(DG_THREADS, 2) conv_dgrad_atomic_nchw(DG_ARGS, int ksplit, float* part) {
    dgrad_gemm<true, false>(DG_PASS, 1, nullptr);
}
extern "C" __global__ void __launch_bounds__(DG_THREADS, 2) conv_dgrad_atomic_cl(DG_ARGS, int ksplit, float* part) {
    dgrad_gemm<true, true>(DG_PASS, 1, nullptr);
}

// The split-K combine: dx[i] = ((part[0][i] + part[1][i]) + part[2][i]) + ..., in split order, one thread
// per element (grid-stride). Fixed order, one write: deterministic.
extern "C" __global__ void conv_dgrad_split_sum(const float* __restrict__ part, float* __restrict__ dx,
                                                long long numel, int ksplit) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < numel;
         i += (long long)gridDim.x * blockDim.x) {
        float s = part[i];
        for (int k = 1; k < ksplit; ++k) s += part[(long long)k * numel + i];
        dx[i] = s;
    }
}

// tree_stem: Cin <= 4 (network stems), dilation 1. A 64-column GEMM tile would waste 15/16 of its work
// on 3 input channels, so a group of KS adjacent lanes owns PX consecutive dx pixels of one row of one
// stride phase and NC of their channels (4, or 3 where Cin <= 3: no products for a padding channel):
// NC * PX accumulators per lane, the lanes of a group splitting the output channels (lane ks takes the
// groups of four ks, ks + KS, ...). With dilation 1 the taps of a phase reach consecutive dy rows and
// columns (tap column b+1 reads one dy column left of tap column b), so for one tap row and one output
// channel a lane reads a single dy row segment of PX + T - 1 values (T >= the taps of the phase along W)
// straight from global memory (L1-cached: the neighbouring groups read the same rows) and multiplies
// every tap column against it: more pixels per group, fewer loads per product (PX = 8 reads 11 values
// for 8 pixels' products, PX = 4 reads 7 for 4). How the segments are loaded (the only difference
// between the load kernels):
//   STEM_CL:     channels_last dy, Cout % 4 == 0: four output channels of a column are one float4;
//   STEM_ROWS:   NCHW dy, OW % 4 == 0, 16-byte aligned rows, PX % 4 == 0: aligned float4 chunks of the
//                row (each wholly inside or outside it), the segment cut out at a shift SFT that is the
//                same for the whole block (a template argument: no selects);
//   STEM_SCALAR: anything else, one load per value.
// The phase's weights ([tap][co] float4, ci padded to 4) are staged in shared memory, CW output channels
// at a time. Each lane's accumulators are FMA chains in a fixed order (weight chunks, tap rows
// ascending, its output channels ascending, tap columns descending); the group's partial sums then meet
// in a fixed butterfly, (s0 + s1) + (s2 + s3), which gives every lane the same bits. One write per
// element: deterministic, and the same order in every layout, pixel count PX and channel count NC (a
// dx element's chain does not depend on which other pixels or channels its lane holds). Positions
// outside dy read as 0 (their products add +-0). Dynamic shared memory: 16 * ntaps_max * CW bytes (the
// launcher keeps it <= 46 KiB); CW is a multiple of 4. A block is TI rows of TJ groups (any TJ <= 32:
// the launcher fits TJ * PX to the phase's width, so few lanes idle past its right edge).
enum StemLoad { STEM_SCALAR = 0, STEM_CL = 1, STEM_ROWS = 2 };

struct StemTile {
    int i, j, ks, nkh, nkw, ow0, cw0, cwn, CW;
    unsigned colok;     // bit e: dy column ow0 + e inside [0, OW)
    const float* dyn;   // dy of this image, advanced to column ow0 (STEM_ROWS: to the aligned chunk below it)
};

template <int PX, int T, int KS, int LOAD, int NC, int SFT>
__device__ __forceinline__ void stem_taps(float (&acc)[PX][NC], const StemTile& S, const float4* ws, const int* s_oh,
                                          int OH, int OW, long long dy_sc, long long dy_sh, long long dy_sw) {
    constexpr int SEG = PX + T - 1;               // dy columns a lane reads per (tap row, co)
    constexpr int CHUNKS = (SFT + SEG + 3) / 4;   // STEM_ROWS: aligned float4 chunks covering them
    for (int a = 0; a < S.nkh; ++a) {
        const int oh = S.i + s_oh[a];
        const bool rowok = oh >= 0 && oh < OH;
        const float* row = S.dyn + (long long)oh * dy_sh;
        const float4* wrow = ws + (a * S.nkw + S.nkw - 1) * S.CW;
        for (int c = 4 * S.ks; c < S.cwn; c += 4 * KS) {
            float seg[SEG][4];
            if (LOAD == STEM_CL) {  // co .. co+3 of one column are one float4
#pragma unroll
                for (int e = 0; e < SEG; ++e) {
                    const bool ok = rowok && ((S.colok >> e) & 1u);
                    const float4 v = ok ? __ldg(reinterpret_cast<const float4*>(row + (long long)e * dy_sw + S.cw0 + c))
                                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    seg[e][0] = v.x; seg[e][1] = v.y; seg[e][2] = v.z; seg[e][3] = v.w;
                }
            } else if (LOAD == STEM_ROWS) {  // chunk q holds columns ow0 - SFT + 4q .. +3
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const float* at = row + (long long)(S.cw0 + c + u) * dy_sc;
                    float v[CHUNKS * 4];
#pragma unroll
                    for (int q = 0; q < CHUNKS; ++q) {
                        const int col = S.ow0 - SFT + 4 * q;
                        const bool ok = rowok && c + u < S.cwn && col >= 0 && col < OW;
                        const float4 f = ok ? __ldg(reinterpret_cast<const float4*>(at + 4 * q)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                        v[4 * q] = f.x; v[4 * q + 1] = f.y; v[4 * q + 2] = f.z; v[4 * q + 3] = f.w;
                    }
#pragma unroll
                    for (int e = 0; e < SEG; ++e) seg[e][u] = v[SFT + e];
                }
            } else {
#pragma unroll
                for (int e = 0; e < SEG; ++e) {
                    const bool ok = rowok && ((S.colok >> e) & 1u);
                    const float* at = row + (long long)e * dy_sw + (long long)(S.cw0 + c) * dy_sc;
#pragma unroll
                    for (int u = 0; u < 4; ++u) seg[e][u] = (ok && c + u < S.cwn) ? __ldg(at + u * dy_sc) : 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
#pragma unroll
                for (int k = 0; k < T; ++k) {
                    if (k < S.nkw) {
                        const float4 q = wrow[c + u - k * S.CW];  // tap column nkw-1-k, co = cw0+c+u
#pragma unroll
                        for (int p = 0; p < PX; ++p) {
                            const float v = seg[p + k][u];
                            acc[p][0] = fmaf(v, q.x, acc[p][0]);
                            if (NC > 1) acc[p][1 % NC] = fmaf(v, q.y, acc[p][1 % NC]);
                            if (NC > 2) acc[p][2 % NC] = fmaf(v, q.z, acc[p][2 % NC]);
                            if (NC > 3) acc[p][3 % NC] = fmaf(v, q.w, acc[p][3 % NC]);
                        }
                    }
                }
            }
        }
    }
}

template <int PX, int T, int KS, int LOAD, int NC>
__device__ __forceinline__ void stem_body(DG_ARGS, int TJ, int TI, int tiles_i, int tiles_j, int CW) {
    extern __shared__ __align__(16) float4 ws[];  // [ntaps][CW]
    __shared__ int s_kh[DG_MAXK], s_oh[DG_MAXK], s_kw[DG_MAXK], s_ow[DG_MAXK];
    __shared__ int s_nkh, s_nkw;
    const int t = threadIdx.x, nthreads = blockDim.x;
    const int z = gridDim.z - 1 - blockIdx.z;  // longest phases first, as in dgrad_gemm
    const int rh = z / sw, rw = z % sw;
    const int Hq = rh < H ? (H - rh + sh - 1) / sh : 0;
    const int Wq = rw < W ? (W - rw + sw - 1) / sw : 0;
    int b = blockIdx.x;
    const int tile_j = b % tiles_j;
    b /= tiles_j;
    const int tile_i = b % tiles_i;
    const int n = b / tiles_i;
    const int i0 = tile_i * TI, j0 = tile_j * TJ * PX;
    if (i0 >= Hq || j0 >= Wq) return;  // uniform: this tile lies outside a smaller phase
    if (t == 0) {
        s_nkh = phase_taps(rh, ph, sh, dh, KH, s_kh, s_oh);
        s_nkw = phase_taps(rw, pw, sw, dw, KW, s_kw, s_ow);
    }
    __syncthreads();
    StemTile S;
    S.nkh = s_nkh;
    S.nkw = s_nkw;
    const int ntaps = S.nkh * S.nkw;
    if (ntaps == 0 && skip_empty) return;
    S.ks = t & (KS - 1);
    const int g = t / KS;
    S.i = i0 + g / TJ;
    S.j = j0 + (g % TJ) * PX;  // this group's first pixel
    S.CW = CW;
    float acc[PX][NC];
#pragma unroll
    for (int p = 0; p < PX; ++p)
#pragma unroll
        for (int u = 0; u < NC; ++u) acc[p][u] = 0.0f;
    if (ntaps > 0) {
        // tap column nkw-1-k of pixel p reads dy column ow0 + p + k
        S.ow0 = S.j + s_ow[S.nkw - 1];
        S.colok = 0;
#pragma unroll
        for (int e = 0; e < PX + T - 1; ++e) S.colok |= (unsigned)(S.ow0 + e >= 0 && S.ow0 + e < OW) << e;
        const int sft = S.ow0 & 3;  // STEM_ROWS: the same in the whole block (j is a multiple of 4)
        S.dyn = dy + (long long)n * dy_sn + (long long)(LOAD == STEM_ROWS ? S.ow0 - sft : S.ow0) * dy_sw;
        const float4* __restrict__ w4 = reinterpret_cast<const float4*>(wmat);
        for (S.cw0 = 0; S.cw0 < Cout; S.cw0 += CW) {
            S.cwn = min(CW, Cout - S.cw0);
            __syncthreads();  // the previous chunk has been read
            for (int x = t; x < ntaps * CW; x += nthreads) {
                const int tp = x / CW, c = x - tp * CW, a = tp / S.nkw, bb = tp - a * S.nkw;
                ws[x] = c < S.cwn ? __ldg(w4 + (long long)(s_kh[a] * KW + s_kw[bb]) * Cout + S.cw0 + c)
                                  : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
            __syncthreads();
            if (LOAD == STEM_ROWS) {
                switch (sft) {
                    case 0: stem_taps<PX, T, KS, LOAD, NC, 0>(acc, S, ws, s_oh, OH, OW, dy_sc, dy_sh, dy_sw); break;
                    case 1: stem_taps<PX, T, KS, LOAD, NC, 1>(acc, S, ws, s_oh, OH, OW, dy_sc, dy_sh, dy_sw); break;
                    case 2: stem_taps<PX, T, KS, LOAD, NC, 2>(acc, S, ws, s_oh, OH, OW, dy_sc, dy_sh, dy_sw); break;
                    default: stem_taps<PX, T, KS, LOAD, NC, 3>(acc, S, ws, s_oh, OH, OW, dy_sc, dy_sh, dy_sw); break;
                }
            } else {
                stem_taps<PX, T, KS, LOAD, NC, 0>(acc, S, ws, s_oh, OH, OW, dy_sc, dy_sh, dy_sw);
            }
        }
    }
    // the group's partial sums, (s0 + s1) + (s2 + s3) for KS = 4: the same bits in every lane (a + b = b + a)
    const unsigned group = ((1u << KS) - 1u) << ((t & 31) & ~(KS - 1));  // blocks hold whole groups
#pragma unroll
    for (int m = 1; m < KS; m <<= 1)
#pragma unroll
        for (int p = 0; p < PX; ++p)
#pragma unroll
            for (int u = 0; u < NC; ++u) acc[p][u] += __shfl_xor_sync(group, acc[p][u], m);
    if (S.i >= Hq) return;
#pragma unroll
    for (int p = 0; p < PX; ++p) {
        if (S.j + p >= Wq || p % KS != S.ks) continue;  // the group's lanes share the stores
        float* o = dx + (long long)n * dx_sn + (long long)(rh + sh * S.i) * dx_sh + (long long)(rw + sw * (S.j + p)) * dx_sw;
#pragma unroll
        for (int u = 0; u < NC; ++u)
            if (u < Cin) o[u * dx_sc] = acc[p][u];
    }
}

// conv_dgrad_tree_stem_p<PX>_t<T>_c<NC>_<load>: the launcher picks PX (4 or 8 pixels per group), T >=
// the most taps of any phase along W, NC (3 where Cin <= 3, else 4) and the load mode its checks allow.
#define DG_STEM_ONE(PX, T, NC, NAME, LOAD)                                                              \
    extern "C" __global__ void __launch_bounds__(DG_STEM_MAX_THREADS, 1)                                \
        conv_dgrad_tree_stem_p##PX##_t##T##_c##NC##_##NAME(DG_ARGS, int TJ, int TI, int tiles_i, int tiles_j, \
                                                          int CW) {                                     \
        stem_body<PX, T, DG_STEM_SPLIT, LOAD, NC>(DG_PASS, TJ, TI, tiles_i, tiles_j, CW);               \
    }
#define DG_STEM_LOADS(PX, T, NC)                     \
    DG_STEM_ONE(PX, T, NC, scalar, STEM_SCALAR)      \
    DG_STEM_ONE(PX, T, NC, cl, STEM_CL)              \
    DG_STEM_ONE(PX, T, NC, rows, STEM_ROWS)
#define DG_STEM_KERNEL(T)                            \
    DG_STEM_LOADS(4, T, 3) DG_STEM_LOADS(4, T, 4)    \
    DG_STEM_LOADS(8, T, 3) DG_STEM_LOADS(8, T, 4)
DG_STEM_KERNEL(2)
DG_STEM_KERNEL(4)
DG_STEM_KERNEL(7)

// Deep stages (16 output channels a stage, dgrad_gemm_body's BK) on the 128 x 64 tile, for unsplit launches
// (a split's ranges are counted in stages of 8): the chains of conv_dgrad_tree_nchw / _cl, half the barriers.
// Last in the file, so the kernels above keep their PTX (which numbers labels by the function's place).
extern "C" __global__ void __launch_bounds__(DG_THREADS, 2)
    conv_dgrad_tree_nchw_deep(DG_ARGS, int ksplit, float* part) {
    dgrad_gemm_deep<false>(DG_PASS, ksplit, part);
}
extern "C" __global__ void __launch_bounds__(DG_THREADS, 2)
    conv_dgrad_tree_cl_deep(DG_ARGS, int ksplit, float* part) {
    dgrad_gemm_deep<true>(DG_PASS, ksplit, part);
}
// Deep stages on the wide tile (two-block register budget), for unsplit wide launches: the chains of
// conv_dgrad_tree_nchw_wide / _cl_wide.
extern "C" __global__ void __launch_bounds__(DG_THREADS, 2)
    conv_dgrad_tree_nchw_wide_deep(DG_ARGS, int ksplit, float* part) {
    dgrad_gemm_deep<false, 8>(DG_PASS, ksplit, part);
}
extern "C" __global__ void __launch_bounds__(DG_THREADS, 2)
    conv_dgrad_tree_cl_wide_deep(DG_ARGS, int ksplit, float* part) {
    dgrad_gemm_deep<true, 8>(DG_PASS, ksplit, part);
}
// The 128 x 64 tile on 128 threads, each an 8 x 8 register tile (columns tn*4 and 32 + tn*4), NCHW: as many
// FMAs per shared load as the wide tile, for narrow launches of many blocks (conv_dgrad.py, T128). Three blocks
// an SM (up to 168 registers a thread: four, at 128, spilled and gained nothing). The chains of
// conv_dgrad_tree_nchw and _nchw_deep, so their bits.
extern "C" __global__ void __launch_bounds__(128, 3)
    conv_dgrad_tree_nchw_t128(DG_ARGS, int ksplit, float* part) {
    dgrad_gemm<false, false, 8, 128>(DG_PASS, ksplit, part);
}
extern "C" __global__ void __launch_bounds__(128, 3)
    conv_dgrad_tree_nchw_t128_deep(DG_ARGS, int ksplit, float* part) {
    dgrad_gemm_deep<false, 8, 128>(DG_PASS, ksplit, part);
}
