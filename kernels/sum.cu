// sum.cu: 1-D float32 sum -> scalar. Launchers and CPU order models: kernels/sum.py.
//
// Variants (all share one partition: G = min(ceil(n / 4 / 256), 2048) blocks of 256 threads, each
// thread adds float4 slots i, i + 256G, ... into four lane accumulators; G depends only on n):
//   atomic     single pass; each block's partial is atomicAdd-ed into the output. NONDETERMINISTIC:
//              the order in which blocks arrive decides the rounding of the final sum.
//   tree       two passes; block partials to a workspace, one block reduces them in index order.
//              Deterministic.
//   lastblock  single pass; block partials to a workspace, the last block to finish (ticket counter)
//              reduces them in index order. Deterministic, the same bits as tree, one launch fewer.
//   exact      single pass, order-independent: each element becomes a 128-bit fixed-point integer
//              (unit 2^-56, |x| < 2^40, smaller bits truncated toward zero); integer addition is
//              associative, so every permutation of the input gives the same bits. The integer total
//              is rounded once to float32 (round to nearest even).
#include "common.cuh"

#define SUM_THREADS 256

// One thread's share of the grid-stride pass. Four float4 loads are issued before they are added so
// that enough bytes are in flight; the additions still happen in slot order (i, i + stride, ...),
// which is what the CPU model reproduces.
__device__ __forceinline__ float thread_sum(const float* __restrict__ x, long long n) {
    const long long full = n >> 2;            // complete float4 slots
    const long long slots = (n + 3) >> 2;     // the last one may be partial
    const long long stride = (long long)gridDim.x * blockDim.x;
    const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x);
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < full; i += 4 * stride) {
        const float4 v0 = x4[i], v1 = x4[i + stride], v2 = x4[i + 2 * stride], v3 = x4[i + 3 * stride];
        a0 += v0.x; a1 += v0.y; a2 += v0.z; a3 += v0.w;
        a0 += v1.x; a1 += v1.y; a2 += v1.z; a3 += v1.w;
        a0 += v2.x; a1 += v2.y; a2 += v2.z; a3 += v2.w;
        a0 += v3.x; a1 += v3.y; a2 += v3.z; a3 += v3.w;
    }
    for (; i < slots; i += stride) {
        float4 v;
        if (i < full) {
            v = x4[i];
        } else {  // the tail slot: missing elements read as +0.0, which leaves an accumulator unchanged
            const long long b = 4 * i;
            v.x = x[b];
            v.y = b + 1 < n ? x[b + 1] : 0.0f;
            v.z = b + 2 < n ? x[b + 2] : 0.0f;
            v.w = 0.0f;
        }
        a0 += v.x; a1 += v.y; a2 += v.z; a3 += v.w;
    }
    return (a0 + a1) + (a2 + a3);
}

extern "C" __global__ void __launch_bounds__(SUM_THREADS)
sum_atomic(const float* __restrict__ x, long long n, float* out) {
    __shared__ float scratch[32];
    const float v = block_reduce(thread_sum(x, n), scratch);
    if (threadIdx.x == 0) atomicAdd(out, v);  // arrival order decides the rounding
}

extern "C" __global__ void __launch_bounds__(SUM_THREADS)
sum_partials(const float* __restrict__ x, long long n, float* partials) {
    __shared__ float scratch[32];
    const float v = block_reduce(thread_sum(x, n), scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = v;
}

extern "C" __global__ void __launch_bounds__(SUM_THREADS)
sum_final(const float* partials, long long count, float* out) {
    __shared__ float scratch[32];
    const float v = reduce_partials(partials, count, scratch);
    if (threadIdx.x == 0) out[0] = v;
}

extern "C" __global__ void __launch_bounds__(SUM_THREADS)
sum_lastblock(const float* __restrict__ x, long long n, float* partials, unsigned int* counter, float* out) {
    __shared__ float scratch[32];
    __shared__ bool last;
    const float v = block_reduce(thread_sum(x, n), scratch);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = v;
        last = arrive_last(counter, gridDim.x);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float r = reduce_partials(partials, gridDim.x, scratch);
    if (threadIdx.x == 0) out[0] = r;
}

// ------------------------------------------------------------------------------------------------
// exact: 128-bit two's-complement fixed point, one unit = 2^-EXACT_FRAC.

#define EXACT_FRAC 56
#define EXACT_MAX_EXP 40  // |x| < 2^40 (exponent field < 127 + 40)
#define FLAG_NAN 1u
#define FLAG_POS_INF 2u
#define FLAG_NEG_INF 4u
#define FLAG_RANGE 8u

struct i128 {
    unsigned long long lo, hi;
};

__device__ __forceinline__ i128 add128(i128 a, i128 b) {
    i128 r;
    asm("add.cc.u64 %0, %2, %4;\n\taddc.u64 %1, %3, %5;"
        : "=l"(r.lo), "=l"(r.hi)
        : "l"(a.lo), "l"(a.hi), "l"(b.lo), "l"(b.hi));
    return r;
}

__device__ __forceinline__ i128 neg128(i128 a) {
    i128 r;
    r.lo = ~a.lo + 1ull;
    r.hi = ~a.hi + (r.lo == 0ull ? 1ull : 0ull);
    return r;
}

// x -> round_toward_zero(x * 2^56) as a 128-bit integer; NaN, Inf and out-of-range set flags instead.
__device__ __forceinline__ i128 to_fixed(float x, unsigned int& flags) {
    const unsigned int u = __float_as_uint(x);
    const unsigned int e = (u >> 23) & 0xffu;
    unsigned long long m = u & 0x7fffffu;
    i128 r = {0ull, 0ull};
    if (e == 0xffu) {
        flags |= m ? FLAG_NAN : ((u >> 31) ? FLAG_NEG_INF : FLAG_POS_INF);
        return r;
    }
    if (e >= 127u + EXACT_MAX_EXP) {
        flags |= FLAG_RANGE;
        return r;
    }
    int shift;  // x = m * 2^(shift - EXACT_FRAC)
    if (e == 0u) {
        shift = 1 - 150 + EXACT_FRAC;
    } else {
        m |= 0x800000ull;
        shift = (int)e - 150 + EXACT_FRAC;
    }
    if (shift < 0) {
        r.lo = shift > -24 ? (m >> -shift) : 0ull;
    } else if (shift < 64) {
        r.lo = m << shift;
        r.hi = shift > 40 ? (m >> (64 - shift)) : 0ull;
    } else {
        r.hi = m << (shift - 64);
    }
    return (u >> 31) ? neg128(r) : r;
}

// Round a 128-bit integer (|s| < 2^127) to the nearest float32 (ties to even), then scale by 2^-56.
__device__ __forceinline__ float fixed_to_float(i128 s) {
    const bool negative = (long long)s.hi < 0;
    if (negative) s = neg128(s);
    float mag;
    if (s.hi == 0ull) {
        mag = __ull2float_rn(s.lo);
    } else {
        const int lz = __clzll((long long)s.hi);
        unsigned long long top = lz ? ((s.hi << lz) | (s.lo >> (64 - lz))) : s.hi;
        const unsigned long long rest = s.lo << lz;
        top |= rest != 0ull ? 1ull : 0ull;  // sticky bit: far below the rounding position
        mag = ldexpf(__ull2float_rn(top), 64 - lz);
    }
    const float r = ldexpf(mag, -EXACT_FRAC);
    return negative ? -r : r;
}

__device__ __forceinline__ i128 shfl_down128(i128 v, int off) {
    i128 r;
    r.lo = __shfl_down_sync(FULL_MASK, v.lo, off);
    r.hi = __shfl_down_sync(FULL_MASK, v.hi, off);
    return r;
}

__device__ __forceinline__ i128 block_reduce128(i128 v, i128* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = add128(v, shfl_down128(v, off));
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    i128 r = {0ull, 0ull};
    if (warp == 0) {
        if (lane < nwarps) r = scratch[lane];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) r = add128(r, shfl_down128(r, off));
    }
    __syncthreads();
    return r;
}

extern "C" __global__ void __launch_bounds__(SUM_THREADS)
sum_exact(const float* __restrict__ x, long long n, i128* partials, unsigned int* counter,
          unsigned int* flags_out, float* out) {
    __shared__ i128 scratch[32];
    __shared__ unsigned int block_flags;
    __shared__ bool last;
    if (threadIdx.x == 0) block_flags = 0u;
    __syncthreads();

    const long long full = n >> 2, slots = (n + 3) >> 2;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x);
    unsigned int flags = 0u;
    i128 acc = {0ull, 0ull};
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < slots; i += stride) {
        float4 v;
        if (i < full) {
            v = x4[i];
        } else {
            const long long b = 4 * i;
            v.x = x[b];
            v.y = b + 1 < n ? x[b + 1] : 0.0f;
            v.z = b + 2 < n ? x[b + 2] : 0.0f;
            v.w = 0.0f;
        }
        acc = add128(acc, to_fixed(v.x, flags));
        acc = add128(acc, to_fixed(v.y, flags));
        acc = add128(acc, to_fixed(v.z, flags));
        acc = add128(acc, to_fixed(v.w, flags));
    }
    flags = __reduce_or_sync(FULL_MASK, flags);
    if ((threadIdx.x & 31) == 0 && flags) atomicOr(&block_flags, flags);
    const i128 v = block_reduce128(acc, scratch);  // its barriers also publish block_flags
    if (threadIdx.x == 0) {
        if (block_flags) atomicOr(flags_out, block_flags);  // OR is order-independent
        partials[blockIdx.x] = v;
        last = arrive_last(counter, gridDim.x);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    i128 total = {0ull, 0ull};
    for (long long i = threadIdx.x; i < gridDim.x; i += blockDim.x) {
        i128 p;
        p.lo = __ldcg(&partials[i].lo);
        p.hi = __ldcg(&partials[i].hi);
        total = add128(total, p);
    }
    total = block_reduce128(total, scratch);
    if (threadIdx.x == 0) {
        const unsigned int f = __ldcg(flags_out);
        float r = fixed_to_float(total);
        if ((f & FLAG_NAN) || ((f & FLAG_POS_INF) && (f & FLAG_NEG_INF)) || (f & FLAG_RANGE)) r = __int_as_float(0x7fffffff);
        else if (f & FLAG_POS_INF) r = __int_as_float(0x7f800000);
        else if (f & FLAG_NEG_INF) r = __int_as_float(0xff800000);
        out[0] = r;
    }
}
