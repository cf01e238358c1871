// conv_mma.cu: bf16 / fp16 convolution backward on tensor cores (mma.sync m16n8k16, float32 accumulation).
// Launchers: kernels/conv_mma.py (used by conv_wgrad's and conv_dgrad's CUDA launchers for half inputs).
// Two engines: the mma.sync kernels below (any GPU from 8.0) and, at the end, wgmma kernels for sm_90a.
// Compiled once per dtype: NNRAND_ACT 1 bfloat16, 2 float16 (common.cuh).
//
// Both gradients are implicit GEMMs over channels_last (NHWC) tensors whose channel counts are multiples of
// 8, so that every 16-byte load holds 8 channels of one pixel and one tap:
//   wgrad  dw[m, r'] = sum_k dy[k, m] * x[pixel(k, r'), ci(r')]    m = co, r' = (kh, kw, ci), k = (n, oh, ow)
//   dgrad  dx[p, ci] = sum_q dy[pixel(p, q), co(q)] * w[q, ci]      p = (n, h, w), q = (kh, kw, co)
// Out-of-range taps (padding, and dgrad's positions the stride skips) are loaded as zeros, which add
// nothing. Block tiles BM x BN, K-step 32, 256 threads (8 warps as 2 x 4, each owning a (BM/2) x (BN/4)
// sub-tile), four shared-memory stages filled by cp.async up to three K-steps ahead of the multiplication
// (dynamic shared memory: the launcher raises the function's limit), rows padded by 8 halves so that
// ldmatrix reads are free of bank conflicts.
//
// Order of the arithmetic, and so determinism: every output element is accumulated by one thread's mma
// sequence, K-step after K-step in index order, whatever the timing. Inside one mma the tensor core adds
// 16 exact products to the accumulator with its own alignment and truncation, which no CPU reproduces
// (cpu_bitexact = False): the CPU models keep the reduction structure, the GPU kernels are tested bitwise
// against themselves and within a bound derived from that arithmetic (tests/test_conv_mma_gpu.py).
//   wgrad_split   chunk s of the reduction (conv_wgrad.half_plan, a function of the shapes
//                 only) stores its float32 partial tile to ws[s][m][r']; conv_mma_combine then adds the S
//                 partials of each element in the fixed order of ordered_combine (the tree variant).
//   wgrad_atomic  the same chunks, atomicAdd-ed into ws[m][r'] in arrival order: NONDETERMINISTIC (the
//                 atomic twin), then conv_mma_combine with S = 1 rounds and permutes.
//   dgrad         no split (P = N*H*W rows are plenty of tiles; 64-row tiles on wgmma where 128-row
//                 ones are few): deterministic.

#ifndef NNRAND_ACT
#define NNRAND_ACT 1  // bfloat16 unless told otherwise (kernels/conv_mma.py passes the dtype's define)
#endif
#include "common.cuh"  // act_t, narrow, ordered_combine

#if NNRAND_ACT == 1
#define MMA_AB "bf16"
#elif NNRAND_ACT == 2
#define MMA_AB "f16"
#else
#error "conv_mma.cu is compiled for half activations only (NNRAND_ACT 1 or 2)"
#endif

#define MM_THREADS 256
#define MM_BK 32
#define MM_PAD 8  // halves of padding per shared-memory row
#ifndef MM_STAGES
#define MM_STAGES 4  // shared-memory stages: loads run up to MM_STAGES - 1 K-steps ahead of the multiplication
#endif
static_assert(MM_STAGES >= 2, "the pipelines load at least one K-step ahead: at least 2 stages");

// The K-loop of the GEMMs over `steps` K-steps: LOAD fills stage `st` with K-step `j` (cp.async, one commit
// group per K-step, empty past the end), MULTIPLY consumes stage `cur`; loads run AHEAD K-steps ahead. One
// barrier per K-step: after this thread's copies of step `it` landed and PUBLISH ran, it publishes step `it`
// and retires the stage the next load overwrites, which RETIRE (run after MULTIPLY) guarantees is no longer
// read: mma.sync (MM_PIPELINE) reads its stage synchronously, AHEAD = MM_STAGES - 1.
#define MM_PIPELINE_GENERIC(LOAD, MULTIPLY, AHEAD, PUBLISH, RETIRE)                                     \
    for (int j = 0; j < (AHEAD); ++j) {                                                                 \
        const int st = j;                                                                               \
        if (j < steps) LOAD;                                                                            \
        cp_async_commit();                                                                              \
    }                                                                                                   \
    for (int it = 0; it < steps; ++it) {                                                                \
        cp_async_wait<(AHEAD) - 1>();                                                                   \
        PUBLISH;                                                                                        \
        __syncthreads();                                                                                \
        {                                                                                               \
            const int j = it + (AHEAD), st = j % MM_STAGES;                                             \
            if (j < steps) LOAD;                                                                        \
            cp_async_commit();                                                                          \
        }                                                                                               \
        const int cur = it % MM_STAGES;                                                                 \
        MULTIPLY;                                                                                       \
        RETIRE;                                                                                         \
    }
#define MM_PIPELINE(LOAD, MULTIPLY) MM_PIPELINE_GENERIC(LOAD, MULTIPLY, MM_STAGES - 1, (void)0, (void)0)

__device__ __forceinline__ void ldsm_x4(unsigned r[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned r[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// c += a (16x16, row) * b (16x8, col), float32 accumulators.
__device__ __forceinline__ void mma16816(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_AB "." MMA_AB ".f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

struct MmaConv {
    int n, h, w, cin, oh, ow, cout, kh, kw, sh, sw, ph, pw, dh, dw;
};
// The geometry travels as 15 int arguments (kernels/runtime.launch passes one 8-byte slot per argument)
#define MM_GEOMETRY int n, int h, int w, int cin, int oh, int ow, int cout, int kh, int kw, int sh, int sw, \
                    int ph, int pw, int dh, int dw
#define MM_CONV MmaConv{n, h, w, cin, oh, ow, cout, kh, kw, sh, sw, ph, pw, dh, dw}

// One K-step (32) of a warp's (MI*16) x (NI*8) sub-tile. A_KMAJOR: the A tile is stored [k][m] (wgrad:
// dy's channels run along m) and read with ldmatrix.trans; otherwise [m][k] (dgrad). B is always [k][n].
template <int MI, int NI, bool A_KMAJOR, int APITCH, int BPITCH>
__device__ __forceinline__ void warp_step(const act_t* As, const act_t* Bs, int wm0, int wn0, float (&acc)[MI][NI][4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int kk = 0; kk < MM_BK; kk += 16) {
        unsigned af[MI][4], bf[NI][2];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
            if (A_KMAJOR) {  // matrix j = lane / 8: k + (j / 2) * 8, m + (j % 2) * 8
                ldsm_x4_trans(af[mi], As + (kk + (lane >> 4) * 8 + (lane & 7)) * APITCH + wm0 + mi * 16 +
                                          ((lane >> 3) & 1) * 8);
            } else {         // matrix j: m + (j % 2) * 8, k + (j / 2) * 8
                ldsm_x4(af[mi], As + (wm0 + mi * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * APITCH + kk +
                                    (lane >> 4) * 8);
            }
        }
#pragma unroll
        for (int nj = 0; nj < NI / 2; ++nj) {  // matrix j: k + (j % 2) * 8, n + (j / 2) * 8
            unsigned t[4];
            ldsm_x4_trans(t, Bs + (kk + ((lane >> 3) & 1) * 8 + (lane & 7)) * BPITCH + wn0 + nj * 16 + (lane >> 4) * 8);
            bf[2 * nj][0] = t[0]; bf[2 * nj][1] = t[1];
            bf[2 * nj + 1][0] = t[2]; bf[2 * nj + 1][1] = t[3];
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) mma16816(acc[mi][ni], af[mi], bf[ni]);
    }
}

// Two adjacent float32 partials of a weight-gradient tile: stored (ATOMIC 0) or atomically added (ATOMIC 1).
template <int ATOMIC>
__device__ __forceinline__ void put_pair(float* p, float a, float b) {
    if (ATOMIC) {
        atomicAdd(p, a);
        atomicAdd(p + 1, b);
    } else {
        *reinterpret_cast<float2*>(p) = make_float2(a, b);
    }
}

// Accumulators set to +0: a flat fragment (wgmma) or an [MI][NI][4] one (mma.sync).
template <int L>
__device__ __forceinline__ void zero_acc(float (&acc)[L]) {
#pragma unroll
    for (int i = 0; i < L; ++i) acc[i] = 0.0f;
}
template <int MI, int NI>
__device__ __forceinline__ void zero_acc(float (&acc)[MI][NI][4]) {
    zero_acc(reinterpret_cast<float (&)[MI * NI * 4]>(acc));
}

// ---------------------------------------------------------------------------------------------------
// Weight gradient. Grid (R'/BN, M/BM, S); block z reduces k in [z*Kc, min(K, (z+1)*Kc)).
// ATOMIC 0: out = ws[S][M][R'] (plain stores); 1: out = ws[M][R'] zeroed, atomicAdd.

template <int BM, int BN, int ATOMIC>
__device__ __forceinline__ void wgrad_body(const act_t* __restrict__ x, const act_t* __restrict__ dy,
                                           float* __restrict__ out, const MmaConv& c, int K, int Kc) {
    constexpr int APITCH = BM + MM_PAD, BPITCH = BN + MM_PAD;
    constexpr int WM = BM / 2, WN = BN / 4, MI = WM / 16, NI = WN / 8;
    constexpr int AG = MM_BK * BM / 8 / MM_THREADS, BG = MM_BK * BN / 8 / MM_THREADS;  // 16-byte loads each
    static_assert(AG >= 1 && BG >= 1 && NI % 2 == 0, "tile too small for 256 threads");
    extern __shared__ __align__(1024) unsigned char mm_smem[];
    act_t* const As = reinterpret_cast<act_t*>(mm_smem);                     // [MM_STAGES][MM_BK * APITCH]
    act_t* const Bs = As + MM_STAGES * MM_BK * APITCH;                       // [MM_STAGES][MM_BK * BPITCH]

    const int tid = threadIdx.x, warp = tid >> 5;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int M = c.cout, R = c.kh * c.kw * c.cin;
    const int kbeg = blockIdx.z * Kc, kend = min(K, kbeg + Kc);
    const int ohw = c.oh * c.ow;

    // A: row k = idx / (BM/8), 8 channels at column (idx % (BM/8)) * 8; the column is the same for every g
    const int acol = (tid % (BM / 8)) * 8, arow = tid / (BM / 8);
    const bool acol_ok = m0 + acol < M;
    // B: column r' fixed per thread (its tap and channel), rows k vary
    const int bcol = (tid % (BN / 8)) * 8, brow = tid / (BN / 8);
    const int r = n0 + bcol;
    const bool bcol_ok = r < R;
    const int tap = bcol_ok ? r / c.cin : 0, ci = bcol_ok ? r - tap * c.cin : 0;
    const int tkh = tap / c.kw, tkw = tap - tkh * c.kw;
    const int offh = tkh * c.dh - c.ph, offw = tkw * c.dw - c.pw;

    auto load = [&](int stage, int kb) {
#pragma unroll
        for (int g = 0; g < AG; ++g) {
            const int k = kb + arow + g * (MM_THREADS / (BM / 8));
            const bool ok = acol_ok && k < kend;
            const act_t* src = ok ? dy + (size_t)k * M + m0 + acol : dy;
            cp_async16(As + stage * MM_BK * APITCH + (arow + g * (MM_THREADS / (BM / 8))) * APITCH + acol, src, ok);
        }
#pragma unroll
        for (int g = 0; g < BG; ++g) {
            const int row = brow + g * (MM_THREADS / (BN / 8));
            const int k = kb + row;
            bool ok = bcol_ok && k < kend;
            const act_t* src = x;
            if (ok) {
                const int nn = k / ohw, rem = k - nn * ohw;
                const int yo = rem / c.ow, xo = rem - yo * c.ow;
                const int ih = yo * c.sh + offh, iw = xo * c.sw + offw;
                ok = ih >= 0 && ih < c.h && iw >= 0 && iw < c.w;
                if (ok) src = x + (((size_t)nn * c.h + ih) * c.w + iw) * c.cin + ci;
            }
            cp_async16(Bs + stage * MM_BK * BPITCH + row * BPITCH + bcol, src, ok);
        }
    };

    float acc[MI][NI][4];
    zero_acc(acc);

    const int steps = (kend - kbeg + MM_BK - 1) / MM_BK;
    const int wm0 = (warp >> 2) * WM, wn0 = (warp & 3) * WN;
    MM_PIPELINE(load(st, kbeg + (j) * MM_BK),
                (warp_step<MI, NI, true, APITCH, BPITCH>(As + cur * MM_BK * APITCH, Bs + cur * MM_BK * BPITCH,
                                                         wm0, wn0, acc)))

    const int lane = tid & 31, gr = lane >> 2, gc = (lane & 3) * 2;
    float* base = ATOMIC ? out : out + (size_t)blockIdx.z * M * R;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
            const int col = n0 + wn0 + ni * 8 + gc;
            if (col >= R) continue;  // R is a multiple of 8: col + 1 < R too
#pragma unroll
            for (int hlf = 0; hlf < 2; ++hlf) {
                const int row = m0 + wm0 + mi * 16 + gr + hlf * 8;
                if (row >= M) continue;
                put_pair<ATOMIC>(base + (size_t)row * R + col, acc[mi][ni][2 * hlf], acc[mi][ni][2 * hlf + 1]);
            }
        }
}

#define WGRAD_KERNEL(NAME, BM, BN, ATOMIC)                                                                \
    extern "C" __global__ void __launch_bounds__(MM_THREADS)                                              \
        NAME(const act_t* x, const act_t* dy, float* out, MM_GEOMETRY, int K, int Kc) {                   \
        wgrad_body<BM, BN, ATOMIC>(x, dy, out, MM_CONV, K, Kc);                                           \
    }
// Every tile (BM, BN) in {64, 128}^2, split and atomic: PREFIX_{split|atomic}_{BM}x{BN}. Tile shapes never
// change the bits: every element's instruction sequence is the same in any tile.
#define WGRAD_TILES(KERNEL, PREFIX)                                                                       \
    KERNEL(PREFIX##_split_128x128, 128, 128, 0)                                                           \
    KERNEL(PREFIX##_split_128x64, 128, 64, 0)                                                             \
    KERNEL(PREFIX##_split_64x128, 64, 128, 0)                                                             \
    KERNEL(PREFIX##_split_64x64, 64, 64, 0)                                                               \
    KERNEL(PREFIX##_atomic_128x128, 128, 128, 1)                                                          \
    KERNEL(PREFIX##_atomic_128x64, 128, 64, 1)                                                            \
    KERNEL(PREFIX##_atomic_64x128, 64, 128, 1)                                                            \
    KERNEL(PREFIX##_atomic_64x64, 64, 64, 1)
WGRAD_TILES(WGRAD_KERNEL, conv_mma_wgrad)

// The S partials ws[s][m][r'] of every dw element added in ordered_combine's fixed order, rounded once to
// act_t and stored at dw's (co, ci, kh, kw) position. S = 1 (atomic, or one chunk) only rounds and permutes.
extern "C" __global__ void __launch_bounds__(256)
    conv_mma_combine(const float* __restrict__ ws, int S, int M, int cin, int taps, act_t* __restrict__ dw) {
    const int R = cin * taps;
    const long long MR = (long long)M * R;
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= MR) return;
    const int m = (int)(e / R), rp = (int)(e - (long long)m * R);
    const int tap = rp / cin, ci = rp - tap * cin;
    dw[(long long)m * R + (long long)ci * taps + tap] = narrow(ordered_combine(ws + e, S, MR));
}

// ---------------------------------------------------------------------------------------------------
// Data gradient. Grid (Cin/BN * P/BM) blocks, channel tiles fastest. wq: the weights packed as [kh][kw][co][ci] (row q, ci contiguous).
// dx pixel (n, y, x) of the launch's h x w grid is stored at dx + n*oxn + y*oxh + x*oxw (channels
// contiguous): the whole NHWC dx, or one stride phase of it (the launcher runs a strided conv as one
// stride-1 launch per phase, each over that phase's taps only, instead of loading zeros for the others).

template <int BM, int BN>
__device__ __forceinline__ void dgrad_body(const act_t* __restrict__ wq, const act_t* __restrict__ dy,
                                           act_t* __restrict__ dx, const MmaConv& c, int oxn, int oxh, int oxw) {
    constexpr int APITCH = MM_BK + MM_PAD, BPITCH = BN + MM_PAD;
    constexpr int WM = BM / 2, WN = BN / 4, MI = WM / 16, NI = WN / 8;
    constexpr int AG = BM * MM_BK / 8 / MM_THREADS, BG = MM_BK * BN / 8 / MM_THREADS;
    static_assert(AG >= 1 && BG >= 1 && NI % 2 == 0, "tile too small for 256 threads");
    extern __shared__ __align__(1024) unsigned char mm_smem[];
    act_t* const As = reinterpret_cast<act_t*>(mm_smem);                     // [MM_STAGES][BM * APITCH]
    act_t* const Bs = As + MM_STAGES * BM * APITCH;                          // [MM_STAGES][MM_BK * BPITCH]

    const int tid = threadIdx.x, warp = tid >> 5;
    // one grid dimension (pixel tiles can pass gridDim.y's 65535), channel tiles fastest
    const int nct = (c.cin + BN - 1) / BN;
    const int m0 = (int)(blockIdx.x / nct) * BM, n0 = (int)(blockIdx.x % nct) * BN;
    const int P = c.n * c.h * c.w, Q = c.kh * c.kw * c.cout;

    // A: rows p = m0 + tid / 4 + g * 64, 8 taps-channels at column (tid % 4) * 8 of the K-step
    const int akg = (tid & 3) * 8, arow = tid >> 2;
    int an[AG], ah[AG], aw[AG];
    bool aok[AG];
#pragma unroll
    for (int g = 0; g < AG; ++g) {
        const int p = m0 + arow + g * (MM_THREADS / 4);
        aok[g] = p < P;
        const int pp = aok[g] ? p : 0;
        an[g] = pp / (c.h * c.w);
        const int rem = pp - an[g] * c.h * c.w;
        ah[g] = rem / c.w;
        aw[g] = rem - ah[g] * c.w;
    }
    const int bcol = (tid % (BN / 8)) * 8, brow = tid / (BN / 8);
    const bool bcol_ok = n0 + bcol < c.cin;

    auto load = [&](int stage, int kb) {
        const int q = kb + akg;
        const bool qok = q < Q;
        const int tap = qok ? q / c.cout : 0, co = qok ? q - tap * c.cout : 0;
        const int tkh = tap / c.kw, tkw = tap - tkh * c.kw;
#pragma unroll
        for (int g = 0; g < AG; ++g) {
            const int yn = ah[g] + c.ph - tkh * c.dh, xn = aw[g] + c.pw - tkw * c.dw;
            bool ok = qok && aok[g] && yn >= 0 && xn >= 0;
            int yo = yn, xo = xn;
            if (c.sh != 1) { yo = yn / c.sh; ok = ok && yo * c.sh == yn; }
            if (c.sw != 1) { xo = xn / c.sw; ok = ok && xo * c.sw == xn; }
            ok = ok && yo < c.oh && xo < c.ow;
            const act_t* src = ok ? dy + (((size_t)an[g] * c.oh + yo) * c.ow + xo) * c.cout + co : dy;
            cp_async16(As + stage * BM * APITCH + (arow + g * (MM_THREADS / 4)) * APITCH + akg, src, ok);
        }
#pragma unroll
        for (int g = 0; g < BG; ++g) {
            const int row = brow + g * (MM_THREADS / (BN / 8));
            const bool ok = bcol_ok && kb + row < Q;
            const act_t* src = ok ? wq + (size_t)(kb + row) * c.cin + n0 + bcol : wq;
            cp_async16(Bs + stage * MM_BK * BPITCH + row * BPITCH + bcol, src, ok);
        }
    };

    float acc[MI][NI][4];
    zero_acc(acc);

    const int steps = (Q + MM_BK - 1) / MM_BK;
    const int wm0 = (warp >> 2) * WM, wn0 = (warp & 3) * WN;
    MM_PIPELINE(load(st, (j) * MM_BK),
                (warp_step<MI, NI, false, APITCH, BPITCH>(As + cur * BM * APITCH, Bs + cur * MM_BK * BPITCH,
                                                          wm0, wn0, acc)))

    const int lane = tid & 31, gr = lane >> 2, gc = (lane & 3) * 2;
    // where each of the thread's output rows starts (dense NHWC: row * cin; a stride phase: its pixel)
    const bool dense = oxw == c.cin && oxh == c.w * oxw && oxn == c.h * oxh;
    size_t rowoff[MI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int hlf = 0; hlf < 2; ++hlf) {
            const int row = min(m0 + wm0 + mi * 16 + gr + hlf * 8, P - 1);
            if (dense) {
                rowoff[mi][hlf] = (size_t)row * c.cin;
            } else {
                const int on = row / (c.h * c.w), orem = row - on * c.h * c.w;
                const int oy = orem / c.w, ox = orem - oy * c.w;
                rowoff[mi][hlf] = (size_t)on * oxn + (size_t)oy * oxh + (size_t)ox * oxw;
            }
        }
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
            const int col = n0 + wn0 + ni * 8 + gc;
            if (col >= c.cin) continue;
#pragma unroll
            for (int hlf = 0; hlf < 2; ++hlf) {
                const int row = m0 + wm0 + mi * 16 + gr + hlf * 8;
                if (row >= P) continue;
                const unsigned v = (unsigned)narrow(acc[mi][ni][2 * hlf]) |
                                   ((unsigned)narrow(acc[mi][ni][2 * hlf + 1]) << 16);
                *reinterpret_cast<unsigned*>(dx + rowoff[mi][hlf] + col) = v;
            }
        }
}

#define DGRAD_KERNEL(NAME, BM, BN)                                                                        \
    extern "C" __global__ void __launch_bounds__(MM_THREADS)                                              \
        NAME(const act_t* wq, const act_t* dy, act_t* dx, MM_GEOMETRY, int oxn, int oxh, int oxw) {       \
        dgrad_body<BM, BN>(wq, dy, dx, MM_CONV, oxn, oxh, oxw);                                           \
    }
DGRAD_KERNEL(conv_mma_dgrad_t128x128, 128, 128)
DGRAD_KERNEL(conv_mma_dgrad_t128x64, 128, 64)

// ===================================================================================================
// Hopper (sm_90a): the same two GEMMs on warpgroup MMAs (wgmma.mma_async m64nNk16, float32 accumulation),
// both operands read by the tensor cores from shared memory. Built only when the module is compiled for
// sm_90a (kernels/conv_mma.py does so on compute capability 9.0 and launches these there).
//
// Block: 256 threads = two warpgroups. BM 128: each warpgroup owns 64 rows x BN; BM 64: each owns all 64
// rows x BN/2. K-step 64. Shared memory holds each operand in wgmma's 128-byte-swizzled layout: atoms of
// 8 lines x 128 bytes (1024 bytes, 1024-aligned), the 16-byte chunk j of line i stored at chunk j ^ i, so
// that the tensor cores' reads, and the copies filling them, are free of bank conflicts.
//   K-major (dgrad: lines are rows, 64 k each):   row r at (r / 8) * 1024 + (r % 8) * 128.
//                                                 descriptor: SBO (next 8 rows) 1024; k16 step +32 bytes
//   MN-major (wgrad: lines are k, 64 rows each):  k at (k / 8) * (R / 64) * 1024 + (k % 8) * 128, rows
//                                                 r at (r / 64) * 1024 + (r % 64) * 2 (swizzled by chunk).
//                                                 descriptor: LBO (next 64 rows) 1024, SBO (next 8 k)
//                                                 (R / 64) * 1024; k16 step +2 SBO
// Each thread copies 16-byte chunks; 8 consecutive threads fill one 128-byte line (one global segment).
// Order: every output element is accumulated by one thread, K-step after K-step in index order, each K-step
// as 4 wgmma instructions in k order: deterministic, as the mma.sync kernels above.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#define WG_BK 64        // k per K-step: one 128-byte line of a K-major operand
static_assert(MM_STAGES >= 3, "the wgmma pipeline loads MM_STAGES - 2 K-steps ahead: at least 3 stages");
#define WG_SW128 (1ull << 62)

// Byte offsets in a swizzled operand tile. K-major: 8 k (chunk c) of row r. MN-major with R rows per line:
// 8 rows from r (a multiple of 8) of line k.
__device__ __forceinline__ int sw128_k(int r, int c) { return (r >> 3) * 1024 + (r & 7) * 128 + ((c ^ (r & 7)) << 4); }
template <int R>
__device__ __forceinline__ int sw128_mn(int k, int r) {
    return ((k >> 3) * (R / 64) + (r >> 6)) * 1024 + (k & 7) * 128 + ((((r >> 3) & 7) ^ (k & 7)) << 4);
}
__device__ __forceinline__ unsigned long long wg_desc(const void* p, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((smem_addr(p) & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32) | WG_SW128;
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Pins the accumulators in their registers at this point (no copies that would read them mid-flight).
template <int L>
__device__ __forceinline__ void wg_fence_acc(float (&acc)[L]) {
#pragma unroll
    for (int i = 0; i < L; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// d (64 x N, float32, the layout of wgmma's accumulator fragment) = A (64 x 16) * B (16 x N) + (accumulate ?
// d : 0); TA / TB: A / B MN-major (1) or K-major (0) in shared memory. One overload per N, chosen by the
// fragment's length N / 2. The first instruction of a tile starts from 0 this way: the accumulators get no
// other definition inside the pipeline (which would make ptxas serialize the wgmma).
template <int TA, int TB>
__device__ __forceinline__ void wgmma_tile(float (&d)[16], unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." MMA_AB "." MMA_AB " {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, p, 1, 1, %19, %20;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB));
}

template <int TA, int TB>
__device__ __forceinline__ void wgmma_tile(float (&d)[32], unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." MMA_AB "." MMA_AB " {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB));
}

template <int TA, int TB>
__device__ __forceinline__ void wgmma_tile(float (&d)[64], unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." MMA_AB "." MMA_AB " {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB));
}

// Issues one K-step of a warpgroup's 64 x TN tile (one commit group) from rows r0 of A and c0 of B. A_MN / B_MN: the operand is
// MN-major (lines of k), with AROWS / BROWS rows per line run; else K-major.
template <int TN, int AROWS, int BROWS, int A_MN, int B_MN>
__device__ __forceinline__ void wg_step(const act_t* As, const act_t* Bs, int r0, int c0, float (&acc)[TN / 2],
                                        bool first) {
    constexpr unsigned A_SBO = A_MN ? AROWS / 64 * 1024 : 1024, B_SBO = B_MN ? BROWS / 64 * 1024 : 1024;
    constexpr unsigned A_K16 = A_MN ? 2 * A_SBO : 32, B_K16 = B_MN ? 2 * B_SBO : 32;   // bytes per k16 step
    const unsigned char* a = reinterpret_cast<const unsigned char*>(As) +
                             (A_MN ? (r0 / 64) * 1024 + (r0 % 64) * 2 : (r0 / 8) * 1024);
    const unsigned char* b = reinterpret_cast<const unsigned char*>(Bs) +
                             (B_MN ? (c0 / 64) * 1024 + (c0 % 64) * 2 : (c0 / 8) * 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < WG_BK / 16; ++kk)
        wgmma_tile<A_MN, B_MN>(acc, wg_desc(a + kk * A_K16, 1024, A_SBO), wg_desc(b + kk * B_K16, 1024, B_SBO),
                               !first || kk > 0);
    wgmma_commit();
}

// The K-loop of the wgmma GEMMs: the multiplication of K-step `it` (ISSUE: one commit group of wgmma) is
// still running while step it + 1 waits for its copies, so loads run MM_STAGES - 2 steps ahead: the stage a
// load overwrites was read by step it - 2, which wait_group 1 retired. PUBLISH hands the copies to the async
// proxy the tensor cores read shared memory through.
#define WG_PIPELINE(LOAD, ISSUE)                                                                        \
    MM_PIPELINE_GENERIC(LOAD, ISSUE, MM_STAGES - 2, fence_proxy_async(), wgmma_wait<1>())               \
    wgmma_wait<0>();                                                                                    \
    wg_fence_acc(acc);                                                                                  \
    if (steps == 0) zero_acc(acc);

// Weight gradient on warpgroup MMAs: grid, split and outputs as wgrad_body.
template <int BM, int BN, int ATOMIC>
__device__ __forceinline__ void wg_wgrad_body(const act_t* __restrict__ x, const act_t* __restrict__ dy,
                                              float* __restrict__ out, const MmaConv& c, int K, int Kc) {
    constexpr int WGM = BM / 64, TN = BN * WGM / 2;   // warpgroups along M; columns per warpgroup
    constexpr int AG = WG_BK * BM / 8 / MM_THREADS, BG = WG_BK * BN / 8 / MM_THREADS;
    static_assert(AG >= 1 && BG >= 1 && (BM == 64 || BM == 128), "tile too small for 256 threads");
    extern __shared__ __align__(1024) unsigned char mm_smem[];
    act_t* const As = reinterpret_cast<act_t*>(mm_smem);            // [MM_STAGES][WG_BK * BM], MN-major, swizzled
    act_t* const Bs = As + MM_STAGES * WG_BK * BM;                  // [MM_STAGES][WG_BK * BN], MN-major, swizzled

    const int tid = threadIdx.x, wg = tid >> 7;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int M = c.cout, R = c.kh * c.kw * c.cin;
    const int kbeg = blockIdx.z * Kc, kend = min(K, kbeg + Kc);
    const int ohw = c.oh * c.ow;

    // chunk c = tid + g * 256: line k = c / (rows / 8), 8 channels at column (c % (rows / 8)) * 8
    const int acol = (tid % (BM / 8)) * 8;
    const bool acol_ok = m0 + acol < M;
    const int bcol = (tid % (BN / 8)) * 8;
    const int r = n0 + bcol;
    const bool bcol_ok = r < R;
    const int tap = bcol_ok ? r / c.cin : 0, ci = bcol_ok ? r - tap * c.cin : 0;
    const int tkh = tap / c.kw, tkw = tap - tkh * c.kw;
    const int offh = tkh * c.dh - c.ph, offw = tkw * c.dw - c.pw;
    const FastDiv div_ohw = make_fastdiv(ohw), div_ow = make_fastdiv(c.ow);   // the hot loop's divisions

    auto load = [&](int stage, int kb) {
#pragma unroll
        for (int g = 0; g < AG; ++g) {
            const int line = (tid + g * MM_THREADS) / (BM / 8), k = kb + line;
            const bool ok = acol_ok && k < kend;
            cp_async16(reinterpret_cast<unsigned char*>(As + stage * WG_BK * BM) + sw128_mn<BM>(line, acol),
                       ok ? dy + (size_t)k * M + m0 + acol : dy, ok);
        }
#pragma unroll
        for (int g = 0; g < BG; ++g) {
            const int line = (tid + g * MM_THREADS) / (BN / 8), k = kb + line;
            bool ok = bcol_ok && k < kend;
            const act_t* src = x;
            if (ok) {
                const int nn = fast_div(div_ohw, k), rem = k - nn * ohw;
                const int yo = fast_div(div_ow, rem), xo = rem - yo * c.ow;
                const int ih = yo * c.sh + offh, iw = xo * c.sw + offw;
                ok = ih >= 0 && ih < c.h && iw >= 0 && iw < c.w;
                if (ok) src = x + (((size_t)nn * c.h + ih) * c.w + iw) * c.cin + ci;
            }
            cp_async16(reinterpret_cast<unsigned char*>(Bs + stage * WG_BK * BN) + sw128_mn<BN>(line, bcol), src, ok);
        }
    };

    float acc[TN / 2];   // defined by the first K-step's wgmma (or zeroed after the loop when there is none)
    const int r0 = (wg % WGM) * 64, c0 = (wg / WGM) * TN;
    const int steps = (kend - kbeg + WG_BK - 1) / WG_BK;
    WG_PIPELINE(load(st, kbeg + (j) * WG_BK),
                (wg_step<TN, BM, BN, 1, 1>(As + cur * WG_BK * BM, Bs + cur * WG_BK * BN, r0, c0, acc, it == 0)))

    const int lane = tid & 31, gr = ((tid >> 5) & 3) * 16 + (lane >> 2), gc = (lane & 3) * 2;
    float* base = ATOMIC ? out : out + (size_t)blockIdx.z * M * R;
#pragma unroll
    for (int i = 0; i < TN / 8; ++i) {
        const int col = n0 + c0 + i * 8 + gc;
        if (col >= R) continue;  // R is a multiple of 8: col + 1 < R too
#pragma unroll
        for (int hlf = 0; hlf < 2; ++hlf) {
            const int row = m0 + r0 + gr + hlf * 8;
            if (row >= M) continue;
            put_pair<ATOMIC>(base + (size_t)row * R + col, acc[4 * i + 2 * hlf], acc[4 * i + 2 * hlf + 1]);
        }
    }
}

#define WG_WGRAD_KERNEL(NAME, BM, BN, ATOMIC)                                                             \
    extern "C" __global__ void __launch_bounds__(MM_THREADS)                                              \
        NAME(const act_t* x, const act_t* dy, float* out, MM_GEOMETRY, int K, int Kc) {                   \
        wg_wgrad_body<BM, BN, ATOMIC>(x, dy, out, MM_CONV, K, Kc);                                        \
    }
WGRAD_TILES(WG_WGRAD_KERNEL, conv_wg_wgrad)

// Data gradient on warpgroup MMAs: grid and outputs as dgrad_body, but the weights packed [ci][kh][kw][co]
// (wt: row ci, q = (kh, kw, co) contiguous: the K-major B operand). BM 128: each warpgroup owns 64 rows x
// BN; BM 64 (grids of few pixels: more, smaller blocks): each owns all 64 rows x BN/2. Either way an
// element gets the same k16 steps in the same order, by wgmma instructions of width TN; that an element's
// arithmetic does not depend on the width is the hardware's (test_dgrad_tile_shape_does_not_change_the_bits).
template <int BM, int BN>
__device__ __forceinline__ void wg_dgrad_body(const act_t* __restrict__ wt, const act_t* __restrict__ dy,
                                              act_t* __restrict__ dx, const MmaConv& c, int oxn, int oxh, int oxw) {
    constexpr int WGM = BM / 64, TN = BN * WGM / 2;   // warpgroups along M; columns per warpgroup
    constexpr int AG = BM * WG_BK / 8 / MM_THREADS, BG = BN * WG_BK / 8 / MM_THREADS;
    static_assert(AG >= 1 && BG >= 1 && (BM == 64 || BM == 128), "tile too small for 256 threads");
    extern __shared__ __align__(1024) unsigned char mm_smem[];
    act_t* const As = reinterpret_cast<act_t*>(mm_smem);            // [MM_STAGES][BM * WG_BK], K-major, swizzled
    act_t* const Bs = As + MM_STAGES * BM * WG_BK;                  // [MM_STAGES][BN * WG_BK], K-major, swizzled

    const int tid = threadIdx.x, wg = tid >> 7;
    // one grid dimension (pixel tiles can pass gridDim.y's 65535), channel tiles fastest
    const int nct = (c.cin + BN - 1) / BN;
    const int m0 = (int)(blockIdx.x / nct) * BM, n0 = (int)(blockIdx.x % nct) * BN;
    const int P = c.n * c.h * c.w, Q = c.kh * c.kw * c.cout;

    // copy g of a thread: row tid / 8 + 32 g, 8 k at (tid % 8) * 8 (8 threads read one row's 128 bytes)
    const int akc = tid & 7, akg = akc * 8;
    int an[AG], ah[AG], aw[AG];
    bool aok[AG];
#pragma unroll
    for (int g = 0; g < AG; ++g) {
        const int p = m0 + (tid >> 3) + g * (MM_THREADS / 8);
        aok[g] = p < P;
        const int pp = aok[g] ? p : 0;
        an[g] = pp / (c.h * c.w);
        const int rem = pp - an[g] * c.h * c.w;
        ah[g] = rem / c.w;
        aw[g] = rem - ah[g] * c.w;
    }

    const FastDiv div_cout = make_fastdiv(c.cout), div_kw = make_fastdiv(c.kw);

    auto load = [&](int stage, int kb) {
        const int q = kb + akg;
        const bool qok = q < Q;
        const int tap = qok ? fast_div(div_cout, q) : 0, co = qok ? q - tap * c.cout : 0;
        const int tkh = fast_div(div_kw, tap), tkw = tap - tkh * c.kw;
#pragma unroll
        for (int g = 0; g < AG; ++g) {
            const int yn = ah[g] + c.ph - tkh * c.dh, xn = aw[g] + c.pw - tkw * c.dw;
            bool ok = qok && aok[g] && yn >= 0 && xn >= 0;
            int yo = yn, xo = xn;
            if (c.sh != 1) { yo = yn / c.sh; ok = ok && yo * c.sh == yn; }
            if (c.sw != 1) { xo = xn / c.sw; ok = ok && xo * c.sw == xn; }
            ok = ok && yo < c.oh && xo < c.ow;
            const act_t* src = ok ? dy + (((size_t)an[g] * c.oh + yo) * c.ow + xo) * c.cout + co : dy;
            cp_async16(reinterpret_cast<unsigned char*>(As + stage * BM * WG_BK) +
                           sw128_k((tid >> 3) + g * (MM_THREADS / 8), akc), src, ok);
        }
#pragma unroll
        for (int g = 0; g < BG; ++g) {
            const int row = (tid >> 3) + g * (MM_THREADS / 8), n = n0 + row;
            const bool ok = n < c.cin && qok;
            cp_async16(reinterpret_cast<unsigned char*>(Bs + stage * BN * WG_BK) + sw128_k(row, akc),
                       ok ? wt + (size_t)n * Q + q : wt, ok);
        }
    };

    float acc[TN / 2];   // defined by the first K-step's wgmma (or zeroed after the loop when there is none)
    const int r0 = (wg % WGM) * 64, c0 = (wg / WGM) * TN;
    const int steps = (Q + WG_BK - 1) / WG_BK;
    WG_PIPELINE(load(st, (j) * WG_BK),
                (wg_step<TN, BM, BN, 0, 0>(As + cur * BM * WG_BK, Bs + cur * BN * WG_BK, r0, c0, acc, it == 0)))

    // The tile, rounded, staged in shared memory (the pipeline's, every wgmma retired), then stored as 16-byte
    // rows of 8 channels: whole sectors instead of 4-byte pieces.
    constexpr int CPITCH = BN + 8;   // halves; rows 4 banks apart, so the fragment writes do not conflict
    static_assert(BM * CPITCH <= MM_STAGES * (BM + BN) * WG_BK, "staging tile larger than the pipeline's memory");
    act_t* const Cs = As;
    __syncthreads();
    const int lane = tid & 31, gr = ((tid >> 5) & 3) * 16 + (lane >> 2), gc = (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < TN / 8; ++i)
#pragma unroll
        for (int hlf = 0; hlf < 2; ++hlf)
            *reinterpret_cast<unsigned*>(Cs + (r0 + gr + hlf * 8) * CPITCH + c0 + i * 8 + gc) =
                (unsigned)narrow(acc[4 * i + 2 * hlf]) | ((unsigned)narrow(acc[4 * i + 2 * hlf + 1]) << 16);
    __syncthreads();
    const bool dense = oxw == c.cin && oxh == c.w * oxw && oxn == c.h * oxh;
    const FastDiv div_hw = make_fastdiv(c.h * c.w), div_w = make_fastdiv(c.w);
#pragma unroll
    for (int g = 0; g < BM * BN / 8 / MM_THREADS; ++g) {
        const int idx = tid + g * MM_THREADS, row = idx / (BN / 8), col = (idx % (BN / 8)) * 8;
        const int pix = m0 + row;
        if (pix >= P || n0 + col >= c.cin) continue;
        size_t off;
        if (dense) {
            off = (size_t)pix * c.cin;
        } else {
            const int on = fast_div(div_hw, pix), orem = pix - on * c.h * c.w;
            const int oy = fast_div(div_w, orem), ox = orem - oy * c.w;
            off = (size_t)on * oxn + (size_t)oy * oxh + (size_t)ox * oxw;
        }
        *reinterpret_cast<uint4*>(dx + off + n0 + col) = *reinterpret_cast<const uint4*>(Cs + row * CPITCH + col);
    }
}

#define WG_DGRAD_KERNEL(NAME, BM, BN)                                                                     \
    extern "C" __global__ void __launch_bounds__(MM_THREADS)                                              \
        NAME(const act_t* wt, const act_t* dy, act_t* dx, MM_GEOMETRY, int oxn, int oxh, int oxw) {       \
        wg_dgrad_body<BM, BN>(wt, dy, dx, MM_CONV, oxn, oxh, oxw);                                        \
    }
WG_DGRAD_KERNEL(conv_wg_dgrad_t128x128, 128, 128)
WG_DGRAD_KERNEL(conv_wg_dgrad_t128x64, 128, 64)
WG_DGRAD_KERNEL(conv_wg_dgrad_t64x128, 64, 128)
WG_DGRAD_KERNEL(conv_wg_dgrad_t64x64, 64, 64)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
