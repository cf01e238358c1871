// fingerprint.cu: the per-output fingerprint of nnrand.trace in one pass over a tensor of 4-byte words.
// Launcher: nnrand/trace.py (fingerprint_cuda). Not a registry op: it measures, it computes no gradient.
//
//   fp  = sum_i (i + 1) * w_i over the words w_i read as int32, sign-extended, in wrapping 64-bit
//         arithmetic: integer addition is associative, so this is exact whatever the order
//   l2  = sqrt(sum_i x_i^2), x_i the words read as float32, accumulated in double
//   mx  = max_i |x_i| (NaN if any x_i is NaN)
// Kernels (both deterministic: every sum is added in an order fixed by n and the launch shape):
//   fingerprint_blocks  block b reduces words [b * chunk, (b + 1) * chunk): thread t adds words t, t + T,
//                       ... in order, then a shared-memory halving tree over the T threads
//   fingerprint_combine one block adds the B block partials the same way and writes (fp, l2, mx) as three
//                       8-byte values (fp's bits stored in a double's slot)
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

extern "C" __global__ void __launch_bounds__(FP_THREADS)
fingerprint_blocks(const unsigned int* __restrict__ w, long long n, long long chunk, unsigned long long* part_fp,
                   double* part_sq, float* part_mx, int* part_nan) {
    __shared__ FpPart s[FP_THREADS];
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
    if (threadIdx.x == 0) {
        part_fp[blockIdx.x] = p.fp;
        part_sq[blockIdx.x] = p.sq;
        part_mx[blockIdx.x] = p.mx;
        part_nan[blockIdx.x] = p.nan;
    }
}

extern "C" __global__ void __launch_bounds__(FP_THREADS)
fingerprint_combine(const unsigned long long* part_fp, const double* part_sq, const float* part_mx,
                    const int* part_nan, int blocks, double* out) {
    __shared__ FpPart s[FP_THREADS];
    FpPart p = {0ull, 0.0, 0.0f, 0};
    for (int b = threadIdx.x; b < blocks; b += FP_THREADS) {
        p.fp += part_fp[b];
        p.sq += part_sq[b];
        p.mx = fmaxf(p.mx, part_mx[b]);
        p.nan |= part_nan[b];
    }
    fp_tree(p, s);
    if (threadIdx.x == 0) {
        out[0] = __longlong_as_double((long long)p.fp);
        out[1] = p.nan ? __longlong_as_double(0x7ff8000000000000ll) : sqrt(p.sq);
        out[2] = p.nan ? __longlong_as_double(0x7ff8000000000000ll) : (double)p.mx;
    }
}
