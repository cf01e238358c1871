// sum.cu: 1-D float32 sum -> scalar. Launchers and CPU order models: kernels/sum.py.
//
// Variants (all share one partition: G = min(ceil(n / 4 / 256), 1024) blocks of 256 threads, each
// thread adds float4 slots i, i + 256G, ... into four lane accumulators; G depends only on n):
//   atomic     single pass; each block's partial is atomicAdd-ed into the output. NONDETERMINISTIC:
//              the order in which blocks arrive decides the rounding of the final sum.
//   tree       two passes; block partials to a workspace, one block reduces them in index order.
//              Deterministic.
//   lastblock  single pass; block partials to a workspace, the last block to finish (ticket counter)
//              reduces them in index order. Deterministic, the same bits as tree, one launch fewer.
//   exact      single pass, order-independent: each element becomes an integer number of 2^-56 units
//              (|x| < 2^32, rounded to nearest at 2^-56) through four 22-bit windows extracted with
//              float additions; integer addition is associative, so every permutation of the input
//              gives the same bits. The integer total is rounded once to float32 (nearest even).
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

extern "C" __global__ void __launch_bounds__(SUM_THREADS, 8)
sum_atomic(const float* __restrict__ x, long long n, float* out) {
    __shared__ float scratch[32];
    const float v = block_reduce(thread_sum(x, n), scratch);
    if (threadIdx.x == 0) atomicAdd(out, v);  // arrival order decides the rounding
}

extern "C" __global__ void __launch_bounds__(SUM_THREADS, 8)
sum_partials(const float* __restrict__ x, long long n, float* partials) {
    __shared__ float scratch[32];
    const float v = block_reduce(thread_sum(x, n), scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = v;
}

extern "C" __global__ void __launch_bounds__(SUM_THREADS, 8)
sum_final(const float* partials, long long count, float* out) {
    __shared__ float scratch[32];
    const float v = reduce_partials(partials, count, scratch);
    if (threadIdx.x == 0) out[0] = v;
}

extern "C" __global__ void __launch_bounds__(SUM_THREADS, 8)
sum_lastblock(const float* __restrict__ x, long long n, float* partials, unsigned int* counter, float* out) {
    // counter: zero on entry, left at zero by the last block (see arrive_last)
    __shared__ float scratch[32];
    __shared__ bool last;
    const float v = block_reduce(thread_sum(x, n), scratch);
    if (gridDim.x == 1) {  // a single block: its partial is the result (the same bits as the final pass)
        if (threadIdx.x == 0) out[0] = v;
        return;
    }
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
// exact: every element is split, with float additions only, into four integer "windows" of 22 bits:
//   t = r + C_k (C_k = 1.5 * 2^(K_k + 23)) rounds r to a multiple of 2^K_k, and because t stays in one
//   binade, bits(t) - bits(C_k) is that multiple as an integer; r - (t - C_k) is the exact remainder.
//   K = 10, -12, -34, -56, so |x| < 2^32 is represented exactly down to 2^-56, the last window rounding
//   to nearest (error <= 2^-57 per element). The window integers are summed exactly (int32 within an
//   unrolled step, int64 per thread, 128-bit across threads), so the total does not depend on order.

#define EXACT_FRAC 56
#define EXACT_MAX_BITS 0x4F800000u  // bits of 2^32: |x| must be below
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

// q * 2^S as a 128-bit two's-complement integer (S a compile-time constant below 128).
template <int S>
__device__ __forceinline__ i128 shifted(long long q) {
    static_assert(S >= 0 && S < 128, "shift out of range");
    i128 r;
    if constexpr (S == 0) {
        r.lo = (unsigned long long)q;
        r.hi = (unsigned long long)(q >> 63);
    } else if constexpr (S < 64) {
        r.lo = (unsigned long long)q << S;
        r.hi = (unsigned long long)(q >> (64 - S));  // arithmetic shift: sign extension
    } else {
        r.lo = 0ull;
        r.hi = (unsigned long long)q << (S - 64);
    }
    return r;
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

struct Windows {
    int w0, w1, w2, w3;      // window integers of the current step (|w| <= 2^22 per element)
    unsigned int maxbits;    // largest |x| bit pattern seen: range, Inf and NaN screening
};

__device__ __forceinline__ void split(float x, Windows& a) {
    const float C0 = 12884901888.0f;           // 1.5 * 2^33  -> unit 2^10
    const float C1 = 3072.0f;                  // 1.5 * 2^11  -> unit 2^-12
    const float C2 = 0.75f / 1024.0f;          // 1.5 * 2^-11 -> unit 2^-34
    const float C3 = 1.74622982740402221680e-10f;  // 1.5 * 2^-33 -> unit 2^-56
    a.maxbits = max(a.maxbits, __float_as_uint(x) & 0x7fffffffu);
    float t = x + C0;
    a.w0 += __float_as_int(t) - __float_as_int(C0);
    float r = x - (t - C0);
    t = r + C1;
    a.w1 += __float_as_int(t) - __float_as_int(C1);
    r = r - (t - C1);
    t = r + C2;
    a.w2 += __float_as_int(t) - __float_as_int(C2);
    r = r - (t - C2);
    t = r + C3;
    a.w3 += __float_as_int(t) - __float_as_int(C3);
}

__device__ __forceinline__ void split4(float4 v, Windows& a) {
    split(v.x, a); split(v.y, a); split(v.z, a); split(v.w, a);
}

__device__ __forceinline__ unsigned int classify(float x) {
    const unsigned int u = __float_as_uint(x), m = u & 0x7fffffffu;
    if (m > 0x7f800000u) return FLAG_NAN;
    if (m == 0x7f800000u) return (u >> 31) ? FLAG_NEG_INF : FLAG_POS_INF;
    return m >= EXACT_MAX_BITS ? FLAG_RANGE : 0u;
}

// flags_out[0] receives the flags of this launch (for the host's range check); state[0] is the ticket
// counter and state[1] the flag accumulator, both left at zero by the last block.
extern "C" __global__ void __launch_bounds__(SUM_THREADS, 6)
sum_exact(const float* __restrict__ x, long long n, i128* partials, unsigned int* state,
          unsigned int* flags_out, float* out) {
    __shared__ i128 scratch[32];
    __shared__ unsigned int block_flags;
    __shared__ bool last;
    if (threadIdx.x == 0) block_flags = 0u;

    const long long full = n >> 2, slots = (n + 3) >> 2;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x);
    long long q0 = 0, q1 = 0, q2 = 0, q3 = 0;
    Windows a = {0, 0, 0, 0, 0u};
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long i = first;
    for (; i + 3 * stride < full; i += 4 * stride) {
        const float4 v0 = x4[i], v1 = x4[i + stride], v2 = x4[i + 2 * stride], v3 = x4[i + 3 * stride];
        a.w0 = a.w1 = a.w2 = a.w3 = 0;  // 16 elements: |sum| <= 2^26, no int32 overflow
        split4(v0, a); split4(v1, a); split4(v2, a); split4(v3, a);
        q0 += a.w0; q1 += a.w1; q2 += a.w2; q3 += a.w3;
    }
    for (; i < slots; i += stride) {
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
        a.w0 = a.w1 = a.w2 = a.w3 = 0;
        split4(v, a);
        q0 += a.w0; q1 += a.w1; q2 += a.w2; q3 += a.w3;
    }
    unsigned int flags = 0u;
    if (a.maxbits >= EXACT_MAX_BITS) {  // rare: find out which kind of bad value this thread saw
        for (long long j = first; j < slots; j += stride)
            for (long long e = 4 * j; e < 4 * j + 4 && e < n; ++e) flags |= classify(x[e]);
    }
    __syncthreads();  // block_flags initialised
    flags = __reduce_or_sync(FULL_MASK, flags);
    if ((threadIdx.x & 31) == 0 && flags) atomicOr(&block_flags, flags);
    i128 acc = add128(add128(shifted<66>(q0), shifted<44>(q1)), add128(shifted<22>(q2), shifted<0>(q3)));
    const i128 v = block_reduce128(acc, scratch);  // its barriers also publish block_flags
    if (threadIdx.x == 0) {
        if (block_flags) atomicOr(state + 1, block_flags);  // OR is order-independent
        partials[blockIdx.x] = v;
        last = arrive_last(state, gridDim.x);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    i128 total = {0ull, 0ull};
    for (long long j = threadIdx.x; j < gridDim.x; j += blockDim.x) {
        i128 p;
        p.lo = __ldcg(&partials[j].lo);
        p.hi = __ldcg(&partials[j].hi);
        total = add128(total, p);
    }
    total = block_reduce128(total, scratch);
    if (threadIdx.x == 0) {
        const unsigned int f = __ldcg(state + 1);
        state[1] = 0u;
        flags_out[0] = f;
        float r = fixed_to_float(total);
        if ((f & FLAG_NAN) || ((f & FLAG_POS_INF) && (f & FLAG_NEG_INF)) || (f & FLAG_RANGE))
            r = __int_as_float(0x7fffffff);
        else if (f & FLAG_POS_INF)
            r = __int_as_float(0x7f800000);
        else if (f & FLAG_NEG_INF)
            r = __int_as_float(0xff800000);
        out[0] = r;
    }
}
