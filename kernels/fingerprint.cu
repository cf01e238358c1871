// fingerprint.cu: the per-output fingerprint of nnrand.trace in one pass over a tensor's elements.
// Launcher: nnrand/trace.py (fingerprint_cuda). Not a registry op: it measures, it computes no gradient.
//
//   fp  = sum_j (j + 1) * b_j over the tensor's words b_j in wrapping 64-bit arithmetic: a word is an
//         element of 1 byte (zero-extended), 2 or 4 bytes (sign-extended), or either 4-byte half of an
//         8-byte element (low, then high: element i is words 2i and 2i + 1; as one 64-bit word, an even
//         weight would lose its top bit); integer addition is associative, so this is exact in any order
//   l2  = sqrt(sum_i x_i^2), x_i the elements' values as double, accumulated in double
//   mx  = max_i |x_i| as double (NaN if any x_i is NaN)
// The element type is a kind code (FP_F32 ... FP_I8 below; nnrand/trace.py: FP_KINDS), bool read as u8.
// A recorded step fingerprints hundreds of outputs, so the host cost of a record is mostly its launch:
// `fingerprint` takes one tensor, `fingerprint_batch` up to FP_BATCH tensors (the outputs of several ops,
// a snapshot of the parameters). A tensor of n elements gets B = clamp(ceil(n / (T * 64)), 1, 1024) blocks
// (nnrand/trace.py: fp_blocks) in either kernel, and its result depends on n and B only:
//   block b reduces elements [b * chunk, (b + 1) * chunk), chunk = ceil(n / B) rounded up to a multiple
//   of 4 (nnrand/trace.py: fp_chunk; the last block may get fewer): for 4-byte elements thread t adds the
//   groups of 4 consecutive elements starting at 4t, 4(t + T), ... in order, each group's elements in
//   order (a 16-byte load where the tensor is 16-byte aligned, four loads where not: the same order);
//   for other sizes thread t adds elements t, t + T, ... in order. Then a halving tree over the T threads
//   (within each warp by shuffles, then over the warps: fp_tree); the block's partial goes to scratch and the
//   tensor's last block to arrive (common.cuh: arrive_last) adds the B partials the same way, thread t
//   taking partials t, t + T, ..., and writes (fp, l2, mx) as three 8-byte values (fp's bits stored in a
//   double's slot). Which block arrives last changes nothing but who does the fixed-order combine. For a
//   float32 tensor, mx kept in double is the float maximum widened: the same bits as a float maximum.
#include "common.cuh"

#define FP_THREADS 256
#define FP_WARPS (FP_THREADS / 32)
static_assert(FP_THREADS % 32 == 0 && (FP_WARPS & (FP_WARPS - 1)) == 0 && FP_WARPS <= 32,
              "fp_tree: a power-of-two number of warps, at most 32");
#define FP_UNROLL 4   // groups of 4 elements a thread loads before adding them (4-byte kinds)

#define FP_F32 0
#define FP_I32 1
#define FP_F64 2
#define FP_I64 3
#define FP_F16 4
#define FP_BF16 5
#define FP_I16 6
#define FP_U8 7
#define FP_I8 8

struct FpPart {
    unsigned long long fp;
    double sq;
    double mx;
    int nan;
};

// element i of a tensor of kind K: its term of fp (its words times their weights) and its value
template <int K>
__device__ __forceinline__ void fp_elem(const void* __restrict__ w, long long i, unsigned long long& term,
                                        double& x) {
    unsigned long long bits;
    if (K == FP_F32 || K == FP_I32) {
        const int v = (int)__ldg(static_cast<const unsigned int*>(w) + i);
        bits = (unsigned long long)(long long)v;
        x = K == FP_F32 ? (double)__int_as_float(v) : (double)v;
    } else if (K == FP_F64 || K == FP_I64) {
        const long long v = (long long)__ldg(static_cast<const unsigned long long*>(w) + i);
        x = K == FP_F64 ? __longlong_as_double(v) : (double)v;
        const unsigned long long lo = (unsigned long long)(long long)(int)(unsigned int)v;
        const unsigned long long hi = (unsigned long long)(long long)(int)(unsigned int)(v >> 32);
        term = (unsigned long long)(2 * i + 1) * lo + (unsigned long long)(2 * i + 2) * hi;
        return;
    } else if (K == FP_F16 || K == FP_BF16 || K == FP_I16) {
        const unsigned short h = __ldg(static_cast<const unsigned short*>(w) + i);
        bits = (unsigned long long)(long long)(short)h;
        if (K == FP_I16) {
            x = (double)(short)h;
        } else if (K == FP_BF16) {
            x = (double)__uint_as_float((unsigned int)h << 16);
        } else {
            float f;
            asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
            x = (double)f;
        }
    } else {   // FP_U8, FP_I8: the byte zero-extended for the fingerprint
        const unsigned char c = __ldg(static_cast<const unsigned char*>(w) + i);
        bits = (unsigned long long)c;
        x = K == FP_U8 ? (double)c : (double)(signed char)c;
    }
    term = (unsigned long long)(i + 1) * bits;
}

// an element's value added to a partial's sum of squares and maximum
__device__ __forceinline__ void fp_value(FpPart& p, double x) {
    p.sq += x * x;
    if (x != x) p.nan = 1;
    else p.mx = fmax(p.mx, fabs(x));
}

// element i of a tensor of kind K added to a partial: its term of fp, then its value
template <int K>
__device__ __forceinline__ void fp_add(FpPart& p, const void* __restrict__ w, long long i) {
    unsigned long long term;
    double x;
    fp_elem<K>(w, i, term, x);
    p.fp += term;
    fp_value(p, x);
}

// a 4-byte element of kind K (FP_F32 or FP_I32) as a double
template <int K>
__device__ __forceinline__ double fp_word_value(unsigned int v) {
    return K == FP_F32 ? (double)__uint_as_float(v) : (double)(int)v;
}

// the group of 4 consecutive 4-byte words at g (one 16-byte load where aligned, four where not)
__device__ __forceinline__ uint4 fp_group(const unsigned int* __restrict__ u, long long g, bool vec) {
    uint4 q;
    if (vec) {
        q = __ldg(reinterpret_cast<const uint4*>(u + g));
    } else {
        q.x = __ldg(u + g);
        q.y = __ldg(u + g + 1);
        q.z = __ldg(u + g + 2);
        q.w = __ldg(u + g + 3);
    }
    return q;
}

// a group of 4 elements of kind K (FP_F32 or FP_I32) starting at element g added to a partial: one 64-bit
// product, sum_e (g + 1 + e) b_e = (g + 1) sum_e b_e + b_1 + 2 b_2 + 3 b_3 (a ring: exact in wrapping
// arithmetic); the values in element order
template <int K>
__device__ __forceinline__ void fp_add_group(FpPart& p, const uint4& q, long long g) {
    const unsigned long long b0 = (unsigned long long)(long long)(int)q.x;
    const unsigned long long b1 = (unsigned long long)(long long)(int)q.y;
    const unsigned long long b2 = (unsigned long long)(long long)(int)q.z;
    const unsigned long long b3 = (unsigned long long)(long long)(int)q.w;
    p.fp += (unsigned long long)(g + 1) * (b0 + b1 + b2 + b3) + b1 + 2 * b2 + 3 * b3;
    fp_value(p, fp_word_value<K>(q.x));
    fp_value(p, fp_word_value<K>(q.y));
    fp_value(p, fp_word_value<K>(q.z));
    fp_value(p, fp_word_value<K>(q.w));
}

__device__ __forceinline__ void fp_merge(FpPart& p, const FpPart& q) {
    p.fp += q.fp;
    p.sq += q.sq;
    p.mx = fmax(p.mx, q.mx);
    p.nan |= q.nan;
}

__device__ __forceinline__ FpPart fp_shfl_down(const FpPart& p, int off) {
    FpPart q;
    q.fp = __shfl_down_sync(0xffffffffu, p.fp, off);
    q.sq = __shfl_down_sync(0xffffffffu, p.sq, off);
    q.mx = __shfl_down_sync(0xffffffffu, p.mx, off);
    q.nan = __shfl_down_sync(0xffffffffu, p.nan, off);
    return q;
}

// The block's T partials combined in a fixed order: a halving tree within each warp (lane l takes lane
// l + off's partial, off = 16, 8, ..., 1), then a halving tree over the FP_WARPS warp partials (warp w
// takes warp w + off's, off = FP_WARPS / 2, ..., 1); every thread returns with the result (s: FP_WARPS
// entries; the caller synchronises before reusing it).
__device__ __forceinline__ void fp_tree(FpPart& p, FpPart* s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) fp_merge(p, fp_shfl_down(p, off));
    if (lane == 0) s[warp] = p;
    __syncthreads();
    if (warp == 0) {
        FpPart q = lane < FP_WARPS ? s[lane] : FpPart{0ull, 0.0, 0.0, 0};
#pragma unroll
        for (int off = FP_WARPS / 2; off > 0; off >>= 1) fp_merge(q, fp_shfl_down(q, off));
        if (lane == 0) s[0] = q;
    }
    __syncthreads();
    p = s[0];
}

__device__ __forceinline__ void fp_write(const FpPart& p, double* out) {
    out[0] = __longlong_as_double((long long)p.fp);
    out[1] = p.nan ? __longlong_as_double(0x7ff8000000000000ll) : sqrt(p.sq);
    out[2] = p.nan ? __longlong_as_double(0x7ff8000000000000ll) : (double)p.mx;
}

// Block b of B of one tensor: its partial, and where B > 1 the fixed-order combine by the last block.
// part_* and counter are the tensor's own: scratch from its first block's index on, its ticket counter.
template <int K>
__device__ __forceinline__ void fp_block(const void* __restrict__ w, long long n, long long chunk, int b,
                                         int blocks, unsigned long long* part_fp, double* part_sq,
                                         double* part_mx, int* part_nan, unsigned int* counter, double* out,
                                         FpPart* s, bool* last) {
    const long long begin = (long long)b * chunk;
    const long long end = begin + chunk < n ? begin + chunk : n;
    FpPart p = {0ull, 0.0, 0.0, 0};
    if (K == FP_F32 || K == FP_I32) {
        // groups of 4 (fp_add_group)
        const unsigned int* u = static_cast<const unsigned int*>(w);
        const bool vec = ((unsigned long long)u & 15) == 0;   // chunk is a multiple of 4: every group aligned
        long long g = begin + 4 * threadIdx.x;
        // FP_UNROLL whole groups loaded before any is added (loads in flight: the kernel is bound by memory
        // latency otherwise), then added in the same order as one at a time
        for (; g + 4 * FP_THREADS * (FP_UNROLL - 1) + 4 <= end; g += 4 * FP_THREADS * FP_UNROLL) {
            uint4 q[FP_UNROLL];
#pragma unroll
            for (int k = 0; k < FP_UNROLL; ++k) q[k] = fp_group(u, g + 4 * FP_THREADS * k, vec);
#pragma unroll
            for (int k = 0; k < FP_UNROLL; ++k) fp_add_group<K>(p, q[k], g + 4 * FP_THREADS * k);
        }
        for (; g < end; g += 4 * FP_THREADS) {
            if (g + 4 <= end) {
                fp_add_group<K>(p, fp_group(u, g, vec), g);
            } else {
                for (long long i = g; i < end; ++i) fp_add<K>(p, w, i);
            }
        }
    } else {
        for (long long i = begin + threadIdx.x; i < end; i += FP_THREADS) fp_add<K>(p, w, i);
    }
    fp_tree(p, s);
    // the combine of one partial would add it to zeros: the same bits
    if (blocks == 1) {
        if (threadIdx.x == 0) fp_write(p, out);
        return;
    }
    if (threadIdx.x == 0) {
        part_fp[b] = p.fp;
        part_sq[b] = p.sq;
        part_mx[b] = p.mx;
        part_nan[b] = p.nan;
        *last = arrive_last(counter, blocks);
    }
    __syncthreads();   // also: every thread has read s[0] before the combine's tree writes s again
    if (!*last) return;
    __threadfence();
    FpPart q = {0ull, 0.0, 0.0, 0};
    for (int k = threadIdx.x; k < blocks; k += FP_THREADS) {
        q.fp += __ldcg(part_fp + k);
        q.sq += __ldcg(part_sq + k);
        q.mx = fmax(q.mx, __ldcg(part_mx + k));
        q.nan |= __ldcg(part_nan + k);
    }
    fp_tree(q, s);
    if (threadIdx.x == 0) fp_write(q, out);
}

// fp_block for a kind given at run time (one branch per block)
__device__ __forceinline__ void fp_block_kind(int kind, const void* w, long long n, long long chunk, int b,
                                              int blocks, unsigned long long* part_fp, double* part_sq,
                                              double* part_mx, int* part_nan, unsigned int* counter,
                                              double* out, FpPart* s, bool* last) {
#define FP_CASE(K) case K: fp_block<K>(w, n, chunk, b, blocks, part_fp, part_sq, part_mx, part_nan, counter, \
                                       out, s, last); break;
    switch (kind) {
        FP_CASE(FP_F32) FP_CASE(FP_I32) FP_CASE(FP_F64) FP_CASE(FP_I64) FP_CASE(FP_F16) FP_CASE(FP_BF16)
        FP_CASE(FP_I16) FP_CASE(FP_U8) FP_CASE(FP_I8)
        default: break;   // the launcher passes only these kinds
    }
#undef FP_CASE
}

extern "C" __global__ void __launch_bounds__(FP_THREADS)
fingerprint(const void* __restrict__ w, long long n, long long chunk, int kind, unsigned long long* part_fp,
            double* part_sq, double* part_mx, int* part_nan, unsigned int* counter, double* out) {
    __shared__ FpPart s[FP_WARPS];
    __shared__ bool last;
    fp_block_kind(kind, w, n, chunk, blockIdx.x, gridDim.x, part_fp, part_sq, part_mx, part_nan, counter, out, s,
                  &last);
}

// Up to FP_BATCH descriptors passed by value: the parameter block is 3848 bytes of batch and 40 of
// pointers, under the 4 KB every CUDA 12 driver takes. Descriptor j owns the launch's blocks [first_j,
// first_j + blocks_j) (in descriptor order, first_0 = 0), the scratch partials at the same indices and
// ticket counter j. first, blocks and kind share one 8-byte slot (int, then two shorts; blocks <= 1024).
#define FP_BATCH 96

struct FpDesc {
    const void* w;
    long long n;
    long long chunk;
    double* out;
    int first;
    short blocks;
    short kind;
};

struct FpBatch {
    long long count;
    FpDesc d[FP_BATCH];
};

extern "C" __global__ void __launch_bounds__(FP_THREADS)
fingerprint_batch(const FpBatch batch, unsigned long long* part_fp, double* part_sq, double* part_mx,
                  int* part_nan, unsigned int* counters) {
    __shared__ FpPart s[FP_WARPS];
    __shared__ bool last;
    // this block's tensor: the last j with first_j <= blockIdx.x
    int lo = 0, hi = (int)batch.count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (batch.d[mid].first <= (int)blockIdx.x) lo = mid;
        else hi = mid - 1;
    }
    const FpDesc& d = batch.d[lo];
    fp_block_kind(d.kind, d.w, d.n, d.chunk, (int)blockIdx.x - d.first, d.blocks, part_fp + d.first,
                  part_sq + d.first, part_mx + d.first, part_nan + d.first, counters + lo, d.out, s, &last);
}
