// common.cuh: reduction building blocks shared by the kernels in this folder.
//
// Every function adds in a fixed order that depends only on the launch shape, never on timing, and
// has an exact CPU model in kernels/order.py (warp_reduce <-> warp_tree, block_reduce <-> block_tree).
// Only additions (fma_step aside: the GEMM step, FFMA by design): no contraction can change the bits.
#pragma once

#define FULL_MASK 0xffffffffu

// ---------------------------------------------------------------------------------------------
// Activation dtype. A source that reads activations through act_t is compiled once per dtype:
// NNRAND_ACT 0 (default) float32, 1 bfloat16, 2 float16 (runtime.act_defines). Half values are widened to
// float32 exactly on load (every bf16/fp16 value is a float32), all arithmetic stays float32, and results
// are narrowed once, round to nearest even (fp16: cvt.rn, overflow -> Inf, subnormals kept). The bits of
// every non-NaN result equal widening the tensors, running the float32 kernel and rounding its output with
// torch, which is what the registry's half-precision call does on the CPU. A NaN stays a NaN, but its
// payload is not part of the contract (bf16 here: 0x7FC0; torch's conversions differ between CPU and GPU).
#ifndef NNRAND_ACT
#define NNRAND_ACT 0
#endif
#if NNRAND_ACT == 0
typedef float act_t;
__device__ __forceinline__ float widen(act_t v) { return v; }
__device__ __forceinline__ act_t narrow(float v) { return v; }
#else
typedef unsigned short act_t;
#if NNRAND_ACT == 1
__device__ __forceinline__ float widen(act_t v) { return __uint_as_float((unsigned int)v << 16); }
__device__ __forceinline__ act_t narrow(float v) {
    const unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (act_t)0x7fc0u;
    return (act_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#else
__device__ __forceinline__ float widen(act_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
}
__device__ __forceinline__ act_t narrow(float v) {
    act_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}
#endif
#endif

// VEC (1 or 4) consecutive activations widened to float32; VEC 4 is one 16-byte (float32) or 8-byte (half)
// load, so p must be aligned to VEC elements of act_t.
template <int VEC>
__device__ __forceinline__ void load_act(const act_t* p, float q[4]) {
    if (VEC == 4) {
#if NNRAND_ACT == 0
        const float4 v = *reinterpret_cast<const float4*>(p);
        q[0] = v.x; q[1] = v.y; q[2] = v.z; q[3] = v.w;
#else
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        q[0] = widen((act_t)(v.x & 0xffffu)); q[1] = widen((act_t)(v.x >> 16));
        q[2] = widen((act_t)(v.y & 0xffffu)); q[3] = widen((act_t)(v.y >> 16));
#endif
    } else {
        q[0] = widen(*p);
    }
}

// VEC (1 or 4) consecutive float32 values (p aligned to VEC floats); BYPASS_L1: through L2 only (__ldcg),
// for values other blocks wrote in this launch.
template <int VEC, bool BYPASS_L1>
__device__ __forceinline__ void load_vec(const float* p, float q[4]) {
    if (VEC == 4) {
        const float4 v = BYPASS_L1 ? __ldcg(reinterpret_cast<const float4*>(p)) : *reinterpret_cast<const float4*>(p);
        q[0] = v.x; q[1] = v.y; q[2] = v.z; q[3] = v.w;
    } else {
        q[0] = BYPASS_L1 ? __ldcg(p) : *p;
    }
}

template <int VEC>
__device__ __forceinline__ void store_act(act_t* p, const float r[4]) {
    if (VEC == 4) {
#if NNRAND_ACT == 0
        *reinterpret_cast<float4*>(p) = make_float4(r[0], r[1], r[2], r[3]);
#else
        uint2 v;
        v.x = (unsigned int)narrow(r[0]) | ((unsigned int)narrow(r[1]) << 16);
        v.y = (unsigned int)narrow(r[2]) | ((unsigned int)narrow(r[3]) << 16);
        *reinterpret_cast<uint2*>(p) = v;
#endif
    } else {
        *p = narrow(r[0]);
    }
}

// Lane 0 ends with a halving tree of the 32 lanes: v[i] += v[i + off], off = 16, 8, 4, 2, 1.
__device__ __forceinline__ float warp_reduce(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(FULL_MASK, v, off);
    return v;
}

// Sum over a 1-D block (blockDim.x a multiple of 32); the result is valid in thread 0. Each warp
// reduces its lanes, warp 0 reduces the per-warp sums (zero past the last warp). `scratch` holds 32
// floats of shared memory. Every thread of the block must call it.
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_reduce(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = 0.0f;
    if (warp == 0) r = warp_reduce(lane < nwarps ? scratch[lane] : 0.0f);
    __syncthreads();  // scratch may be reused by the caller
    return r;
}

// Fixed-order reduction of `count` partials by one 1-D block: thread t adds partials t, t + blockDim.x,
// ... in index order, then block_reduce. Reads bypass L1 (__ldcg): the partials were written by other
// blocks of the same launch. Result valid in thread 0.
__device__ __forceinline__ float reduce_partials(const float* partials, long long count, float* scratch) {
    float acc = 0.0f;
    const long long step = blockDim.x;
    long long i = threadIdx.x;
    for (; i + 3 * step < count; i += 4 * step) {  // four loads in flight, added in index order
        const float p0 = __ldcg(partials + i), p1 = __ldcg(partials + i + step);
        const float p2 = __ldcg(partials + i + 2 * step), p3 = __ldcg(partials + i + 3 * step);
        acc += p0; acc += p1; acc += p2; acc += p3;
    }
    for (; i < count; i += step) acc += __ldcg(partials + i);
    return block_reduce(acc, scratch);
}

// "Last block" protocol for single-pass deterministic reductions: each block publishes its partial,
// fences, and takes a ticket; the block that draws the last ticket sees every partial and reduces them
// in index order. Which block is last varies run to run; the order of the final sum does not.
// Call from thread 0 after writing the partial(s); returns true in the last block's thread 0, which
// also resets the counter to zero (every other block has drawn its ticket by then), so the counter
// buffer can be reused by the next launch on the same stream without a memset.
__device__ __forceinline__ bool arrive_last(unsigned int* counter, unsigned int expected) {
    __threadfence();
    const bool last = atomicAdd(counter, 1u) == expected - 1u;
    if (last) *counter = 0u;
    return last;
}

// Fixed-order combine of S split-K partials of one element, p[s * stride] for s < S: group g adds
// partials g, g + 8, g + 16, ... in order from +0.0, then the 8 group sums are added in index order
// from +0.0 (kernels/conv_wgrad.py: tree_combine models it). Reads bypass L1: other blocks wrote them.
#define COMBINE_GROUPS 8
__device__ __forceinline__ float ordered_combine(const float* p, int S, long long stride) {
    float part[COMBINE_GROUPS];
#pragma unroll
    for (int g = 0; g < COMBINE_GROUPS; ++g) part[g] = 0.0f;
    for (int s0 = 0; s0 < S; s0 += COMBINE_GROUPS) {
        float v[COMBINE_GROUPS];
#pragma unroll
        for (int g = 0; g < COMBINE_GROUPS; ++g) v[g] = s0 + g < S ? __ldcg(p + (long long)(s0 + g) * stride) : 0.0f;
#pragma unroll
        for (int g = 0; g < COMBINE_GROUPS; ++g)
            if (s0 + g < S) part[g] += v[g];
    }
    float r = 0.0f;
#pragma unroll
    for (int g = 0; g < COMBINE_GROUPS; ++g) r += part[g];
    return r;
}

// One K-step of a register-tiled SGEMM (the FFMA kernels of conv_wgrad*.cu): a / b are the step's rows
// of the shared A and B tiles; thread (ty, tx) holds TM x TN accumulators whose rows are the float4
// groups g * GM + 4 * ty and columns g * GN + 4 * tx. acc[i][j] += a[i] * b[j] with FFMA.
template <int TM, int TN, int GM, int GN>
__device__ __forceinline__ void fma_step(const float* a, const float* b, int ty, int tx, float (&acc)[TM][TN]) {
    float av[TM], bv[TN];
#pragma unroll
    for (int g = 0; g < TM / 4; ++g) {
        const float4 v = *reinterpret_cast<const float4*>(a + g * GM + ty * 4);
        av[4 * g] = v.x; av[4 * g + 1] = v.y; av[4 * g + 2] = v.z; av[4 * g + 3] = v.w;
    }
#pragma unroll
    for (int g = 0; g < TN / 4; ++g) {
        const float4 v = *reinterpret_cast<const float4*>(b + g * GN + tx * 4);
        bv[4 * g] = v.x; bv[4 * g + 1] = v.y; bv[4 * g + 2] = v.z; bv[4 * g + 3] = v.w;
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
}

// ---------------------------------------------------------------------------------------------
// A position (n, s) in a channel's virtual array of N rows of S values (NCHW reductions: bias_grad,
// bn_bwd); a step of step_n rows and step_s more values, carried into the next row. 32-bit counters:
// N and S are below 2^31; callers form 64-bit offsets.
struct Walk {
    int n, s;
};

__device__ __forceinline__ void advance(Walk& w, int step_n, int step_s, int S) {
    w.n += step_n;
    w.s += step_s;
    if (w.s >= S) { w.s -= S; ++w.n; }
}

// ---------------------------------------------------------------------------------------------
// n / d for 0 <= n < 2^31 and 1 <= d <= 2^31 by a high multiply, an add and a shift (the magic-number
// divider of torch's IntDivider): m = 2^32 (2^s - d) / d + 1 with 2^s >= d > 2^(s-1).
// kernels/adaptive_avg_pool2d_bwd.py: magic_divider is its host twin, tested exhaustively on small d.
struct FastDiv {
    unsigned d, m, s;
};

__device__ __forceinline__ FastDiv make_fastdiv(unsigned d) {
    unsigned s = 0;
    while (s < 31 && (1u << s) < d) ++s;
    if ((1u << s) < d) s = 32;  // d > 2^31: not used here (tile sizes stay far below)
    const unsigned long long m = ((1ull << 32) * ((1ull << s) - d)) / d + 1;
    FastDiv f = {d, (unsigned)m, s};
    return f;
}

__device__ __forceinline__ int fast_div(const FastDiv f, int n) {
    return (int)((__umulhi((unsigned)n, f.m) + (unsigned)n) >> f.s);
}

// ---------------------------------------------------------------------------------------------
// Asynchronous copies into shared memory (compute capability 8.0 and up).

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes from global to shared memory, or 16 zero bytes when !valid (src-size 0 reads nothing).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
// 4 bytes from global to shared memory, or 4 zero bytes when !valid (src-size 0 reads nothing). Through L1 (.ca:
// the only cache option for copies under 16 bytes).
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---------------------------------------------------------------------------------------------
// Winograd's input transform B^T d B of a 4x4 patch (F(2x2, 3x3) and F(3, 2) share it), first along
// rows, then along columns, each axis (e0 - e2, e1 + e2, e2 - e1, e1 - e3); element 4a + b is stored at
// out[(4a + b) * stride]. Additions only: no contraction can change the bits.

template <typename Stride>
__device__ __forceinline__ void winograd_input_transform(const float (&d)[4][4], float* out, Stride stride) {
    float s[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {   // B^T d: along rows
        s[0][j] = d[0][j] - d[2][j];
        s[1][j] = d[1][j] + d[2][j];
        s[2][j] = d[2][j] - d[1][j];
        s[3][j] = d[1][j] - d[3][j];
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {   // (B^T d) B: along columns
        out[(4 * a + 0) * stride] = s[a][0] - s[a][2];
        out[(4 * a + 1) * stride] = s[a][1] + s[a][2];
        out[(4 * a + 2) * stride] = s[a][2] - s[a][1];
        out[(4 * a + 3) * stride] = s[a][1] - s[a][3];
    }
}
