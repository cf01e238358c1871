// fingerprint.cu: the per-output fingerprint of nnrand.trace in one pass over a tensor of 4-byte words.
// Launcher: nnrand/trace.py (fingerprint_cuda). Not a registry op: it measures, it computes no gradient.
//
//   fp  = sum_i (i + 1) * w_i over the words w_i read as int32, sign-extended, in wrapping 64-bit
//         arithmetic: integer addition is associative, so this is exact whatever the order
//   l2  = sqrt(sum_i x_i^2), x_i the words read as float32, accumulated in double
//   mx  = max_i |x_i| (NaN if any x_i is NaN)
// One launch per tensor (a recorded step fingerprints hundreds of outputs, so the host cost of a record
// is mostly its launches). Deterministic: every sum is added in an order fixed by n and the launch shape.
//   block b reduces words [b * chunk, (b + 1) * chunk): thread t adds words t, t + T, ... in order, then a
//   shared-memory halving tree over the T threads; the block's partial goes to scratch and the last
//   block to arrive (common.cuh: arrive_last) adds the B partials the same way, thread t taking partials
//   t, t + T, ..., and writes (fp, l2, mx) as three 8-byte values (fp's bits stored in a double's slot).
//   Which block arrives last changes nothing but who does the fixed-order combine.
#include "common.cuh"

#define FP_THREADS 256

struct FpPart {
    unsigned long long fp;
    double sq;
    float mx;
    int nan;
};

__device__ __forceinline__ void fp_tree(FpPart& p, FpPart* s) {
    const int t = threadIdx.x;
    s[t] = p;
    __syncthreads();
    for (int off = FP_THREADS / 2; off > 0; off >>= 1) {
        if (t < off) {
            s[t].fp += s[t + off].fp;
            s[t].sq += s[t + off].sq;
            s[t].mx = fmaxf(s[t].mx, s[t + off].mx);
            s[t].nan |= s[t + off].nan;
        }
        __syncthreads();
    }
    p = s[0];
}

__device__ __forceinline__ void fp_write(const FpPart& p, double* out) {
    out[0] = __longlong_as_double((long long)p.fp);
    out[1] = p.nan ? __longlong_as_double(0x7ff8000000000000ll) : sqrt(p.sq);
    out[2] = p.nan ? __longlong_as_double(0x7ff8000000000000ll) : (double)p.mx;
}

extern "C" __global__ void __launch_bounds__(FP_THREADS)
fingerprint(const unsigned int* __restrict__ w, long long n, long long chunk, unsigned long long* part_fp,
            double* part_sq, float* part_mx, int* part_nan, unsigned int* counter, double* out) {
    __shared__ FpPart s[FP_THREADS];
    __shared__ bool last;
    const long long begin = (long long)blockIdx.x * chunk;
    const long long end = begin + chunk < n ? begin + chunk : n;
    FpPart p = {0ull, 0.0, 0.0f, 0};
    for (long long i = begin + threadIdx.x; i < end; i += FP_THREADS) {
        const unsigned int word = w[i];
        p.fp += (unsigned long long)(i + 1) * (unsigned long long)(long long)(int)word;
        const float x = __int_as_float((int)word);
        p.sq += (double)x * (double)x;
        if (x != x) p.nan = 1;
        else p.mx = fmaxf(p.mx, fabsf(x));
    }
    fp_tree(p, s);
    // the combine of one partial would add it to zeros: the same bits
    if (gridDim.x == 1) {
        if (threadIdx.x == 0) fp_write(p, out);
        return;
    }
    if (threadIdx.x == 0) {
        part_fp[blockIdx.x] = p.fp;
        part_sq[blockIdx.x] = p.sq;
        part_mx[blockIdx.x] = p.mx;
        part_nan[blockIdx.x] = p.nan;
        last = arrive_last(counter, gridDim.x);
    }
    __syncthreads();   // also: every thread has read s[0] before the combine's tree writes s again
    if (!last) return;
    __threadfence();
    FpPart q = {0ull, 0.0, 0.0f, 0};
    for (int b = threadIdx.x; b < (int)gridDim.x; b += FP_THREADS) {
        q.fp += __ldcg(part_fp + b);
        q.sq += __ldcg(part_sq + b);
        q.mx = fmaxf(q.mx, __ldcg(part_mx + b));
        q.nan |= __ldcg(part_nan + b);
    }
    fp_tree(q, s);
    if (threadIdx.x == 0) fp_write(q, out);
}
