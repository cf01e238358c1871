// segsum.cuh: scatter-style sums, out[key] += value, shared by index_add.cu, scatter_add.cu and
// embedding_bwd.cu. Launchers and CPU order models: kernels/index_add.py.
//
// A launch sums n contributions into `space` destination rows of D floats. Contribution e has a
// destination row key[e] and D values: row e of src (row form: index_add, embedding_bwd), or element e
// of src with D = 1 (element form: scatter_add with a full index). Optionally (embedding_bwd) a row
// `skip` gets nothing, and each value is divided by its destination's count (scale_grad_by_freq):
// v / (float)count, IEEE division (NVRTC default), so no multiply-add can fuse it with the sum. Keys
// outside [0, rows) contribute nothing in either variant (the launchers raise on them when asked to
// check, after the kernels are queued), so a bad index never makes a kernel touch memory out of bounds;
// or, with the `trap` argument (check_range="device"), fail the kernel with a device-side assertion
// (seg_bad_index): no host synchronisation, PyTorch's own behaviour on CUDA.
//
//   atomic  one thread per (contribution, column): atomicAdd into the zeroed output. NONDETERMINISTIC:
//           a row with >= 3 contributions is summed in arrival order. Float atomicAdd flushes subnormal
//           operands and results to sign-preserving zero (PTX atom.add.f32).
//   sorted  segsum_keys narrows the keys to the smallest sortable type (int16 for up to 65535
//           destinations, stored as key - 32768; int32 as key - 2^31; else int64), out-of-range keys
//           becoming the sentinel `space`, and sorts them stably (few keys: each key's position
//           counted over all the keys, a tile sort and a merge by rank, or one block; more: a radix sort
//           of the destinations' significant bits; int64 keys:
//           torch.sort(stable=True); all deterministic, all the same result), so each row's
//           contributions lie together in source order; segsum_starts (or
//           the merge) finds where each row begins (start[space] = the number of valid keys, which is
//           the range check). A row of k contributions is cut into chunks of L = 32 * 2^e (smallest e
//           with ceil(k / L) <= 1024) consecutive contributions, each summed in source order from +0.0
//           by one warp (lanes = columns, one column slice of 32 * VEC per grid row y) or one thread
//           (segsum_scalar). One chunk: that is the row. More: the chunk partials are combined by a
//           fixed 32-ary tree, each node a halving tree over 32 consecutive children (missing ones
//           +0.0, exact because a sum from +0.0 is never -0.0): the last chunk of a group of 32 to
//           finish (ticket counter) builds the node, the last node of the row builds the root. Which
//           warp finishes last varies; the tree does not: DETERMINISTIC, and a row's bits depend only on
//           its own contributions in source order. Ordinary additions: subnormals kept (no -ftz), as the
//           CPU model keeps them.
//           Work split: one task per destination row (it writes the row, +0.0 where the row has no
//           contribution, so the output needs no zero fill, and sums the row's chunk 0) and one task per
//           32 sorted positions (it sums the chunks c >= 1 that start there: chunks are >= 32 long, so
//           at most one per row per tile). Each chunk is summed by exactly one task. Other splits: the
//           warp kernels may take destination rows 32 per task instead (empty rows written as zeros,
//           rows of one contribution loaded several at once), or, over an output zero-filled on a second
//           stream while the keys are sorted, sorted positions only (a tile of 32 also takes chunk 0 of
//           the rows that start in it; in the warp kernel `fill` warps share a tile, its lanes dealt
//           out among them); the thread kernel too (`fill`). Or (`gaps`) the same sums over an unfilled
//           output, with segsum_zero_gaps writing +0.0 beside them to the destinations no key reaches. Or (`once`)
//           the rows of two chunks or more only, with segsum_once writing every other destination (zeros and
//           the rows of one chunk) beside them.
//   fixed   order-independent fixed point, three launches and no sort (the direct schedule; the element
//           form's binned one and the row form's compact one, below, add the same integers): segsum_fixed_max finds the
//           largest finite |src| (one atomicMax per block on the float's bits: an integer max, exact in any
//           order), which with c = ceil(log2 N), N the source rows, fixes the shift s = 62 - c - E (E the
//           smallest integer with max |src| < 2^E). segsum_fixed_add rounds every finite term to the
//           nearest integer q = rint(v * 2^s) (ties to even; v * 2^s is exact in double) and atomically
//           adds it into an int64 accumulator per output element: |q| <= 2^(62 - c) and an element has at
//           most N terms, so no sum can overflow, and integer addition is associative, so the sum does not
//           depend on the order of arrival (nor on how a thread groups the terms it holds for a hot
//           destination before adding them). A non-finite term sets a flag instead (NaN, +Inf, -Inf; four
//           bits per element, eight elements per word). segsum_fixed_out rounds each integer to float32
//           (__ll2float_rn, to nearest even), scales it by 2^-s in double (exact) and narrows
//           (exact unless the result is subnormal or overflows); flagged elements become NaN (a NaN, or
//           both infinities) or the infinity. DETERMINISTIC, and the bits depend only on the multiset of
//           each element's terms, N and max |src|: not on the GPU, the launch shape, nor the order of the
//           source rows. Error per element: <= k 2^-(s+1) for k terms (the roundings to 2^-s), then one
//           float32 rounding; an element of zero sum is +0.0. Subnormal terms are kept.
// No float kernel arguments; ints are 64-bit where they can exceed 2^31.
#pragma once

#define SEG_FULL 0xffffffffu
#define SEG_CHUNK_MIN 32
#define SEG_MAX_CHUNKS 1024
#define SEG_FAN 32
#define SEG_WARPS 8  // warps per block of 256 threads


// Chunk length of a row of k contributions (kernels/index_add.py: chunk_len).
__device__ __forceinline__ long long seg_chunk_len(long long k) {
    long long L = SEG_CHUNK_MIN;
    while ((k + L - 1) / L > SEG_MAX_CHUNKS) L <<= 1;
    return L;
}

// Slot of a row's first chunk partial (row starting at sorted position s). Rows with >= 2 chunks have
// k > 32 contributions, so the slots 2 * floor(s / 32) + c (c < ceil(k / L) <= 2 * floor(k / 32)) of
// different rows never overlap and stay below 2 * floor(n / 32).
__device__ __forceinline__ long long seg_slot(long long s) { return 2 * (s >> 5); }

__device__ __forceinline__ float seg_value(float v, bool scaled, float count) {
    return scaled ? __fdiv_rn(v, count) : v;
}

// ------------------------------------------------------------------------------------------------
// atomic

// A key outside [0, rows) where the launcher asked for the device-side range check (check_range="device":
// no host synchronisation): print which op and index (once per module load), then fail the kernel with
// a device-side assertion, as PyTorch's own CUDA index kernels do. The CUDA context is unusable
// afterwards; the error surfaces at the next synchronisation ("device-side assert triggered").
#ifndef __CUDACC_RTC__  // NVRTC declares both itself
#include <cstdio>
extern "C" __device__ void __assertfail(const void* message, const void* file, unsigned int line, const void* function,
                                        size_t charsize);
#endif
__device__ unsigned seg_bad_index_reported = 0u;

__device__ __noinline__ void seg_bad_index(const char* op, long long m, long long rows) {
    if (atomicExch(&seg_bad_index_reported, 1u) == 0u)
        printf("nnrand %s: index %lld is out of range for %lld rows (expected 0 <= index < %lld)\n", op, m, rows,
               rows);
    __assertfail("nnrand: index out of range", __FILE__, __LINE__, "seg_bad_index", sizeof(char));
}

// counts[m] = how many of the n keys equal m, for m in [0, rows) (scale_grad_by_freq); other keys are
// not counted. Integer atomics: exact in any order. No host synchronisation (torch.bincount reads its
// input's maximum back).
extern "C" __global__ void __launch_bounds__(256)
segsum_count(const long long* __restrict__ key, long long n, long long rows, unsigned long long* __restrict__ counts) {
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += step) {
        const long long m = key[e];
        if (m >= 0 && m < rows) atomicAdd(counts + m, 1ull);
    }
}

// out[0 .. n) = +0.0 (16-byte stores; out from torch's allocator, 16-byte aligned). Launched with a few
// blocks per SM on a second stream beside the sort of the `fill` split (kernels/index_add.py): a grid of
// that size leaves room on every SM for the sort's kernels, which a fill over the whole GPU would keep
// waiting until its last wave (stores need no warps waiting on them, so a few blocks still saturate
// the memory's write bandwidth). Beside the one-block sort, the default before the rank sort, that
// overlap was not borne out (H200, bench/dev/segsum_phases.py --fill, 2048 tokens into a 32000 x 768
// gradient): the call (fill, sort, sums) took 63 us against 26 us for the fill and 16 for the key sort,
// each timed alone; a fill held to 16 registers, or with the most shared memory carved out, did not
// change the total.
// segsum_zero_cs: the same with streaming stores (st.global.cs, evict first), so that the fill does not push
// out of L2 what the kernels beside it keep there (the fixed variant's compact accumulators), nor leave it
// full of zeros still to write back when the sums that follow it read (the sorted fill split).
template <bool STREAMING>
__device__ __forceinline__ void seg_zero_body(float* __restrict__ out, long long n) {
    const long long step = (long long)gridDim.x * blockDim.x;
    const long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (long long i = i0; i < (n >> 2); i += step) {
        if (STREAMING) __stcs(reinterpret_cast<float4*>(out) + i, z);
        else reinterpret_cast<float4*>(out)[i] = z;
    }
    for (long long i = ((n >> 2) << 2) + i0; i < n; i += step) out[i] = 0.0f;
}

extern "C" __global__ void __launch_bounds__(256) segsum_zero(float* __restrict__ out, long long n) {
    seg_zero_body<false>(out, n);
}

extern "C" __global__ void __launch_bounds__(256) segsum_zero_cs(float* __restrict__ out, long long n) {
    seg_zero_body<true>(out, n);
}

// The `gaps` split's zeros: destinations no valid key reaches (start[m + 1] == start[m]) and the `skip`
// one get +0.0 in their `width` floats, out[m * width ..), after the sort and beside the sums, which
// write every other destination (kernels/index_add.py). A block takes 32 destinations: each warp reads
// their starts (one coalesced read), then each run of consecutive empty ones is one span of floats, written
// by the block's threads in turn in 16-byte stores (out is 16-byte aligned) between at most 3 single
// floats at either end: a tile with no contribution is written like a plain fill. Few blocks an SM (a
// grid-stride loop), so the latency-bound sums keep their SMs. 32 * width < 2^31: the offsets in a tile are
// ints, and the bounds tests compare tid with a span's length (never tid + offset, which could wrap).
#ifndef SEG_GAP_STREAMING
#define SEG_GAP_STREAMING 1   // the zeros as streaming stores (st.global.cs: evict first); 0: plain
#endif
__device__ __forceinline__ void seg_gap_store(float4* p) {
    const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (SEG_GAP_STREAMING) __stcs(p, z);
    else *p = z;
}

// +0.0 in the floats of the destinations of `gaps` (bits over the 32 destinations of the tile at base, each
// `width` floats), by the block's threads: each run of consecutive ones is one span of 16-byte stores (base
// is 16-byte aligned) between at most 3 single floats at either end. Block-uniform gaps.
__device__ __forceinline__ void seg_zero_runs(unsigned gaps, float* base, int width) {
    const int tid = threadIdx.x, threads = blockDim.x;
    while (gaps) {  // a run [a, b) of empty destinations
        const int a = __ffs(gaps) - 1;
        const unsigned rest = ~(gaps >> a);
        const int b = rest ? a + __ffs(rest) - 1 : 32;
        gaps &= b == 32 ? 0u : ~0u << b;
        const int lo = a * width, hi = b * width;   // the run's floats
        const int lo4 = (lo + 3) & ~3, hi4 = max(lo4, hi & ~3);
        for (int i = (lo4 >> 2) + tid; i < (hi4 >> 2); i += threads)
            seg_gap_store(reinterpret_cast<float4*>(base) + i);
        if (tid < min(lo4, hi) - lo) base[lo + tid] = 0.0f;   // at most 3 before (or the whole run)
        if (tid < hi - hi4) base[hi4 + tid] = 0.0f;           // at most 3 after
    }
}

extern "C" __global__ void __launch_bounds__(256)
segsum_zero_gaps(const long long* __restrict__ start, float* __restrict__ out, long long space, int width,
                 long long skip) {
    const int lane = threadIdx.x & 31;
    for (long long t = blockIdx.x; t < (space + 31) >> 5; t += gridDim.x) {
        const long long m = t * 32 + lane;
        const unsigned gaps = __ballot_sync(SEG_FULL, m < space && (m == skip || start[m + 1] == start[m]));
        seg_zero_runs(gaps, out + t * 32 * width, width);   // 16-byte aligned: 128 * width bytes a tile
    }
}

// Row form: e = i * D + d, value src[e] into out[key[i] * D + d]. Element form (scatter_add, D = the
// rows' width): e is the contribution, value src[e] into out[key[e] * D + e % D]. Returns the flat
// destination (-1: the skip row or a key outside [0, rows), nothing to add; with `trap` set a key outside
// [0, rows) fails the kernel, seg_bad_index) and sets v (divided by the destination's count when counts
// are given).
template <typename I>
__device__ __forceinline__ void seg_load(const float* __restrict__ src, const long long* __restrict__ key, I e, int D,
                                         int elementwise, long long& m, float& v) {
    m = key[elementwise ? e : e / D];
    v = src[e];
}

// The destination of contribution e from its loaded key m (see seg_contribution); v divided by the count.
template <typename I>
__device__ __forceinline__ long long seg_resolve(I e, int D, long long m, long long skip,
                                                 const long long* __restrict__ counts, long long rows,
                                                 const char* trap, float& v) {
    const I d = e - (e / D) * D;
    if (m < 0 || m >= rows) {
        if (trap != nullptr) seg_bad_index(trap, m, rows);
        return -1;
    }
    if (m == skip) return -1;
    if (counts != nullptr) v = __fdiv_rn(v, (float)counts[m]);
    return m * D + d;
}

template <typename I>
__device__ __forceinline__ long long seg_contribution(const float* __restrict__ src, const long long* __restrict__ key,
                                                      I e, int D, int elementwise, long long skip,
                                                      const long long* __restrict__ counts, long long rows,
                                                      const char* trap, float& v) {
    long long m;
    seg_load(src, key, e, D, elementwise, m, v);
    return seg_resolve(e, D, m, skip, counts, rows, trap, v);
}

template <typename I>
__device__ __forceinline__ void seg_atomic_body(const float* __restrict__ src, const long long* __restrict__ key,
                                                float* __restrict__ out, I total, int D, int elementwise,
                                                long long skip, const long long* __restrict__ counts,
                                                long long rows, const char* trap) {
    const I step = (I)gridDim.x * blockDim.x;
    for (I e = (I)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += step) {
        float v;
        const long long dst = seg_contribution(src, key, e, D, elementwise, skip, counts, rows, trap, v);
        if (dst >= 0) atomicAdd(out + dst, v);  // arrival order decides the rounding where rows collide
    }
}

#define SEG_ATOMIC_KERNEL(NAME, OPNAME)                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                                    \
    NAME(const float* __restrict__ src, const long long* __restrict__ key, float* __restrict__ out,      \
         long long total, int D, int elementwise, long long skip, const long long* __restrict__ counts,  \
         long long rows, int trap) {                                                                     \
        const char* op = trap ? OPNAME : nullptr;                                                        \
        if (total + (long long)gridDim.x * blockDim.x <= 2147483647LL)                                   \
            seg_atomic_body<int>(src, key, out, (int)total, D, elementwise, skip, counts, rows, op);     \
        else                                                                                             \
            seg_atomic_body<long long>(src, key, out, total, D, elementwise, skip, counts, rows, op);    \
    }

// ------------------------------------------------------------------------------------------------
// sorted: keys and row starts

// The destination of element e with index i (row form, width 0: i; element form: i * width + e % width),
// or `space` for an index outside [0, rows) (with `trap` set, that fails the kernel: seg_bad_index).
__device__ __forceinline__ long long seg_destination(long long i, long long e, long long width, long long rows,
                                                     long long space, const char* trap) {
    if (i >= 0 && i < rows) return width ? i * width + e % width : i;
    if (trap != nullptr) seg_bad_index(trap, i, rows);
    return space;
}

// skey_in[e] = destination - offset, or space - offset for an index outside [0, rows). Row form
// (width 0): destination key[e]; element form: key[e] * width + e % width. One pass replaces the
// range check's reduction and the cast (with `trap` set, a bad index fails the kernel instead).
template <typename K>
__device__ __forceinline__ void seg_keys_body(const long long* __restrict__ key, K* __restrict__ out, long long total,
                                              long long width, long long rows, long long offset, const char* trap) {
    const long long space = width ? rows * width : rows;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += step)
        out[e] = (K)(seg_destination(key[e], e, width, rows, space, trap) - offset);
}

// ------------------------------------------------------------------------------------------------
// sorted: one-block stable sort of few keys

// For n <= SEG_SORT_MAX contributions into space < 2^16 destinations, one block of 1024 threads replaces
// the keys kernel and torch.sort (a device radix sort: five launches, ~30 us on the H200 at n = 16384).
// It is instruction-bound on one SM, so the launcher takes it for the fewest keys only (else the merge
// sort below). Each element is packed as (destination << 16) | e
// (seg_destination: space for an index outside [0, rows); e < 2^14) in shared memory, and sorted by its
// destination, least significant 8-bit digit first (`passes` of them: 1 when space <= 255, else 2), each
// pass a stable counting sort: warp w holds elements [P w, P w + P) (P = 32 * ceil(n / 1024), the last
// ones padding of destination 0xffff, which sorts after every real element, the sentinel included,
// because a stable sort keeps them after it); walk 1 counts each digit per warp (lanes of one digit
// found by eight ballots, seg_same_digit; their highest lane adds their number), an exclusive scan over (digit,
// warp) in that order gives each warp's first slot per digit, walk 2 writes every element at its
// warp's running slot for its digit plus its rank among the lower lanes of the same digit. Counting
// sorts place equal digits in input order, so the result is torch.sort(stable=True)'s: the same skey
// and perm (tests/test_index_add.py compares them). DETERMINISTIC: no atomics, a fixed schedule.
#define SEG_SORT_MAX 16384
#define SEG_SORT_THREADS 1024
#define SEG_SORT_WARPS 32
#define SEG_SORT_DIGITS 256
#define SEG_SORT_HSTRIDE (SEG_SORT_DIGITS + 1)  // hist[warp * 257 + digit]: see seg_sort_scan
#define SEG_SORT_SMEM ((2 * SEG_SORT_MAX + SEG_SORT_HSTRIDE * SEG_SORT_WARPS + SEG_SORT_WARPS) * 4)

// The counts hist[w * SEG_SORT_HSTRIDE + d] of digit d in warp w: a warp's lanes touch their own
// digits' words, in different banks unless the digits are equal mod 32 (with the digit-major layout
// [d][w] every lane of a warp hit one bank). Exclusive prefix sum, in place, in (digit, warp) order by the
// whole block: thread t takes the 8 consecutive (d, w) = (t / 4, 8 (t % 4) + i), the words w * 257 + d
// of 32 different banks across a warp for each i (scratch: SEG_SORT_WARPS words).
__device__ __forceinline__ unsigned* seg_hist(unsigned* hist, unsigned d, int w) {
    return hist + w * SEG_SORT_HSTRIDE + d;
}

// Inclusive prefix sum of v over the lanes of a full warp.
__device__ __forceinline__ unsigned seg_warp_inclusive(unsigned v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned t = __shfl_up_sync(SEG_FULL, v, o);
        if (lane >= o) v += t;
    }
    return v;
}

__device__ __forceinline__ void seg_sort_scan(unsigned* hist, unsigned* scratch) {
    constexpr int PER = SEG_SORT_DIGITS * SEG_SORT_WARPS / SEG_SORT_THREADS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned d = threadIdx.x / (SEG_SORT_WARPS / PER);
    const int w0 = (threadIdx.x % (SEG_SORT_WARPS / PER)) * PER;
    unsigned v[PER], total = 0;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        v[i] = *seg_hist(hist, d, w0 + i);
        total += v[i];
    }
    const unsigned incl = seg_warp_inclusive(total);  // the threads' totals within the warp
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const unsigned w = scratch[lane];
        scratch[lane] = seg_warp_inclusive(w) - w;  // exclusive over warps
    }
    __syncthreads();
    unsigned run = scratch[warp] + incl - total;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        *seg_hist(hist, d, w0 + i) = run;
        run += v[i];
    }
}

// The lanes whose 8-bit digit equals this lane's: eight ballots, one per bit (constant time, where
// __match_any_sync takes longer the more distinct values a warp holds).
__device__ __forceinline__ unsigned seg_same_digit(unsigned d) {
    unsigned peers = SEG_FULL;
#pragma unroll
    for (int b = 0; b < 8; ++b) {
        const unsigned ones = __ballot_sync(SEG_FULL, (d >> b) & 1u);
        peers &= ((d >> b) & 1u) ? ones : ~ones;
    }
    return peers;
}

__device__ __forceinline__ void seg_sort_body(const long long* __restrict__ key, short* __restrict__ skey,
                                              long long* __restrict__ perm, int n, long long width, long long rows,
                                              long long offset, int passes, const char* trap) {
    extern __shared__ unsigned seg_sort_smem[];
    unsigned* hist = seg_sort_smem + 2 * SEG_SORT_MAX;  // seg_hist
    unsigned* scratch = hist + SEG_SORT_HSTRIDE * SEG_SORT_WARPS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per = 32 * ((n + SEG_SORT_THREADS - 1) / SEG_SORT_THREADS);  // elements per warp
    const long long space = width ? rows * width : rows;
    constexpr int LOADS = SEG_SORT_MAX / SEG_SORT_THREADS;
    long long idx[LOADS];  // every load in flight before any is used (one SM reads all the keys)
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
        const int e = j * SEG_SORT_THREADS + threadIdx.x;
        idx[j] = e < n ? key[e] : 0;
    }
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
        const int e = j * SEG_SORT_THREADS + threadIdx.x;
        if (e >= SEG_SORT_WARPS * per) break;
        const unsigned m = e < n ? (unsigned)seg_destination(idx[j], e, width, rows, space, trap)
                                 : 0xffffu;  // padding
        seg_sort_smem[e] = (m << 16) | (unsigned)e;
    }
    const unsigned below = (1u << lane) - 1u;
    for (int pass = 0; pass < passes; ++pass) {
        const unsigned* in = seg_sort_smem + (pass & 1) * SEG_SORT_MAX;  // two buffers, alternating
        unsigned* out = seg_sort_smem + ((pass + 1) & 1) * SEG_SORT_MAX;
        const int shift = 16 + 8 * pass;
        for (int i = threadIdx.x; i < SEG_SORT_HSTRIDE * SEG_SORT_WARPS; i += SEG_SORT_THREADS) hist[i] = 0u;
        __syncthreads();
        for (int r = 0; r < per; r += 32) {  // walk 1: each digit's count per warp
            const unsigned d = (in[warp * per + r + lane] >> shift) & 0xffu;
            const unsigned peers = seg_same_digit(d);
            if (lane == 31 - __clz(peers)) *seg_hist(hist, d, warp) += __popc(peers);
            __syncwarp();
        }
        __syncthreads();
        seg_sort_scan(hist, scratch);
        __syncthreads();
        for (int r = 0; r < per; r += 32) {  // walk 2: place, in input order within each digit
            const unsigned v = in[warp * per + r + lane];
            const unsigned d = (v >> shift) & 0xffu;
            const unsigned peers = seg_same_digit(d);
            const unsigned slot = *seg_hist(hist, d, warp);
            out[slot + __popc(peers & below)] = v;
            __syncwarp();
            if (lane == 31 - __clz(peers)) *seg_hist(hist, d, warp) = slot + __popc(peers);
            __syncwarp();
        }
        __syncthreads();
    }
    const unsigned* sorted = seg_sort_smem + (passes & 1) * SEG_SORT_MAX;
    for (int p = threadIdx.x; p < n; p += SEG_SORT_THREADS) {
        const unsigned v = sorted[p];
        skey[p] = (short)((long long)(v >> 16) - offset);
        perm[p] = (long long)(v & 0xffffu);
    }
}

#define SEG_SORT_KERNEL(PREFIX)                                                                          \
    extern "C" __global__ void __launch_bounds__(SEG_SORT_THREADS, 1)                                    \
    PREFIX##_sort_i16(const long long* __restrict__ key, short* __restrict__ skey, long long* __restrict__ perm, \
                      int n, long long width, long long rows, long long offset, int passes, int trap) {  \
        seg_sort_body(key, skey, perm, n, width, rows, offset, passes, trap ? #PREFIX : nullptr);        \
    }

// ------------------------------------------------------------------------------------------------
// sorted: rank sort of few keys (int16 or int32 keys, one launch over many blocks)

// The sorts above keep most of the GPU idle where n is a few thousand: the one-block sort runs on one SM,
// the merge sort's tile pass on ceil(n / 2048) blocks. Here every element finds its sorted position on
// its own: packed as p = (destination << DSHIFT) | e (unique; e < 2^16 beside int16 keys, whose
// destinations fit 16 bits, sentinel included), its position is #{u : p_u < p_e}: the destinations below
// its own, then the equal ones of elements before it, which is the position a stable sort gives it, so
// skey and perm are torch.sort(stable=True)'s. Block b ranks the elements [32 b, 32 b + 32), one per
// lane; every block makes all n packed keys itself (seg_destination), SEG_RANK_TILE at a time in shared
// memory, its 8 warps each comparing their lanes' elements with an eighth of the tile (16-byte broadcast
// reads), and the warps' counts are added. O(n^2) comparisons over ceil(n / 32) blocks: for the fewest
// keys only (kernels/index_add.py: default_sort). A bad index fails the kernel (`trap`) in the block that
// ranks it. DETERMINISTIC: integer counts, no atomics.
#define SEG_RANK_THREADS 256
#define SEG_RANK_TILE 2048
#define SEG_RANK_MAX 65536  // int16 keys pack the element number into 16 bits

template <typename P, int DSHIFT>
__device__ __forceinline__ P seg_rank_key(const long long* __restrict__ key, long long e, long long width,
                                          long long rows, long long space, const char* trap) {
    return ((P)seg_destination(key[e], e, width, rows, space, trap) << DSHIFT) | (P)e;
}

template <typename KT, typename P, int DSHIFT>
__device__ __forceinline__ void seg_rank_body(const long long* __restrict__ key, KT* __restrict__ skey,
                                              long long* __restrict__ perm, int n, long long width, long long rows,
                                              long long offset, const char* trap) {
    constexpr int PER_WARP = SEG_RANK_TILE / SEG_WARPS;
    constexpr int VEC = 16 / sizeof(P);  // packed keys per 16-byte read
    __shared__ __align__(16) P stage[SEG_RANK_TILE];
    __shared__ unsigned part[SEG_WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long space = width ? rows * width : rows;
    const int e = blockIdx.x * 32 + lane;  // every warp needs the block's elements; warp 0 traps on them
    const P mine = e < n ? seg_rank_key<P, DSHIFT>(key, e, width, rows, space, warp == 0 ? trap : nullptr) : (P)0;
    unsigned below = 0u;
    for (int base = 0; base < n; base += SEG_RANK_TILE) {
        __syncthreads();  // the previous tile is read
        for (int i = threadIdx.x; i < SEG_RANK_TILE; i += SEG_RANK_THREADS) {
            const int u = base + i;  // past the keys: all ones, below no element's packed key
            stage[i] = u < n ? seg_rank_key<P, DSHIFT>(key, u, width, rows, space, nullptr) : ~(P)0;
        }
        __syncthreads();
        const P* s = stage + warp * PER_WARP;
        const int len = min(PER_WARP, max(0, n - base - warp * PER_WARP));
        for (int i = 0; i < len; i += VEC) {
            P q[VEC];
            *reinterpret_cast<uint4*>(q) = *reinterpret_cast<const uint4*>(s + i);
#pragma unroll
            for (int v = 0; v < VEC; ++v) below += q[v] < mine;
        }
    }
    part[warp][lane] = below;
    __syncthreads();
    if (warp == 0 && e < n) {
        unsigned pos = 0u;
#pragma unroll
        for (int w = 0; w < SEG_WARPS; ++w) pos += part[w][lane];
        skey[pos] = (KT)((long long)(mine >> DSHIFT) - offset);
        perm[pos] = (long long)e;
    }
}

#define SEG_RANK_FOR(PREFIX, KEYNAME, KT, PT, DSHIFT)                                                    \
    extern "C" __global__ void __launch_bounds__(SEG_RANK_THREADS)                                       \
    PREFIX##_rank_##KEYNAME(const long long* __restrict__ key, KT* __restrict__ skey,                   \
                            long long* __restrict__ perm, int n, long long width, long long rows,        \
                            long long offset, int trap) {                                                \
        seg_rank_body<KT, PT, DSHIFT>(key, skey, perm, n, width, rows, offset, trap ? #PREFIX : nullptr); \
    }

// ------------------------------------------------------------------------------------------------
// sorted: tile sort and merge by rank (up to SEG_MSORT_MAX keys of int16 or int32)

// Two launches replace the keys kernel, torch.sort and segsum_starts where n is small (torch.sort is a
// chain of device radix-sort launches whose fixed cost dominates an embedding gradient's sort). Tile
// pass: block b sorts the keys [T b, T b + T) (T = SEG_MSORT_TILE), each packed as (destination <<
// DSHIFT) | position in the tile (unique, so a bitonic network, which is not stable, sorts them in a
// stable order), padding all ones (after every key, the sentinel included); it stores the tile's sorted
// destinations (0xffffffff for padding) and the source positions. Merge pass: a key at rank r of tile c
// goes to sorted position r + (keys <= it in the tiles before c) + (keys < it in the tiles after c),
// counted by binary searches in those tiles (staged in shared memory): the position a stable sort gives
// it, so skey and perm are torch.sort(stable=True)'s. With `with_starts`, the same pass's threads beyond
// the keys write start[m] = (keys < m in every tile) for m = 0 .. space (else the launcher runs
// segsum_starts: cheaper where the destinations far outnumber the keys). DETERMINISTIC: no atomics.
#define SEG_MSORT_TILE 2048
#define SEG_MSORT_THREADS 256
#define SEG_MSORT_PER 8  // keys per thread of the tile pass
#define SEG_MSORT_MAX 32768
#define SEG_MSORT_MERGE_THREADS 1024

// One bitonic stage of distance J (< SEG_MSORT_PER) on a thread's keys v[q] = s[i0 + q]: in registers.
template <int J, typename P>
__device__ __forceinline__ void seg_bitonic_regs(P (&v)[SEG_MSORT_PER], int i0, int k) {
#pragma unroll
    for (int q = 0; q < SEG_MSORT_PER; ++q)
        if ((q & J) == 0) {  // selects, no branch
            const P a = v[q], b = v[q + J];
            const P lo = a < b ? a : b, hi = a < b ? b : a;
            const bool up = ((i0 + q) & k) == 0;
            v[q] = up ? lo : hi;
            v[q + J] = up ? hi : lo;
        }
}

// A thread's SEG_MSORT_PER keys to and from shared memory s[i0 ..], 16 bytes per access (one word per
// access would be an 8-way bank conflict: the threads' runs are 8 words apart).
__device__ __forceinline__ void seg_put(unsigned* s, const unsigned (&v)[SEG_MSORT_PER]) {
#pragma unroll
    for (int q = 0; q < SEG_MSORT_PER; q += 4)
        *reinterpret_cast<uint4*>(s + q) = make_uint4(v[q], v[q + 1], v[q + 2], v[q + 3]);
}
__device__ __forceinline__ void seg_get(const unsigned* s, unsigned (&v)[SEG_MSORT_PER]) {
#pragma unroll
    for (int q = 0; q < SEG_MSORT_PER; q += 4) {
        const uint4 w = *reinterpret_cast<const uint4*>(s + q);
        v[q] = w.x, v[q + 1] = w.y, v[q + 2] = w.z, v[q + 3] = w.w;
    }
}
__device__ __forceinline__ void seg_put(unsigned long long* s, const unsigned long long (&v)[SEG_MSORT_PER]) {
#pragma unroll
    for (int q = 0; q < SEG_MSORT_PER; q += 2) *reinterpret_cast<ulonglong2*>(s + q) = make_ulonglong2(v[q], v[q + 1]);
}
__device__ __forceinline__ void seg_get(const unsigned long long* s, unsigned long long (&v)[SEG_MSORT_PER]) {
#pragma unroll
    for (int q = 0; q < SEG_MSORT_PER; q += 2) {
        const ulonglong2 w = *reinterpret_cast<const ulonglong2*>(s + q);
        v[q] = w.x, v[q + 1] = w.y;
    }
}

// The packed keys of one tile in ascending order: a bitonic network over SEG_MSORT_TILE words. Thread t
// holds words [8 t, 8 t + 8) in registers, where the stages of distance j < 8 run (30 of the 66); the
// others run in shared memory, each thread comparing the pairs (i, i + j), i = 2 p - (p mod j), for
// p = t + 256 q. Shared memory's bandwidth bounds the stages there, so fewer of them is what counts.
template <typename P>
__device__ __forceinline__ void seg_bitonic(P (&v)[SEG_MSORT_PER], P* s) {
    static_assert(SEG_MSORT_TILE == SEG_MSORT_PER * SEG_MSORT_THREADS, "a tile is the block's registers");
    const int t = threadIdx.x, i0 = SEG_MSORT_PER * t;
#pragma unroll 1
    for (int k = 2; k <= SEG_MSORT_TILE; k <<= 1) {
        if (k > SEG_MSORT_PER) {
            __syncthreads();  // every thread's reads of the previous round are done
            seg_put(s + i0, v);
            __syncthreads();
#pragma unroll 1
            for (int j = k >> 1; j >= SEG_MSORT_PER; j >>= 1) {
                constexpr int PAIRS = SEG_MSORT_PER / 2;
                int i[PAIRS];
                P a[PAIRS], b[PAIRS];
#pragma unroll
                for (int q = 0; q < PAIRS; ++q) {  // disjoint pairs: every read before any write
                    const int p = t + SEG_MSORT_THREADS * q;
                    i[q] = 2 * p - (p & (j - 1));  // bit j of i clear
                    a[q] = s[i[q]];
                    b[q] = s[i[q] + j];
                }
#pragma unroll
                for (int q = 0; q < PAIRS; ++q)
                    if ((a[q] > b[q]) == ((i[q] & k) == 0)) {
                        s[i[q]] = b[q];
                        s[i[q] + j] = a[q];
                    }
                __syncthreads();
            }
            seg_get(s + i0, v);
        }
        if (k >= 8) seg_bitonic_regs<4>(v, i0, k);
        if (k >= 4) seg_bitonic_regs<2>(v, i0, k);
        seg_bitonic_regs<1>(v, i0, k);
    }
}

template <typename P, int DSHIFT>
__device__ __forceinline__ void seg_msort_tile_body(const long long* __restrict__ key, unsigned* __restrict__ tkey,
                                                    int* __restrict__ tpos, long long n, long long width,
                                                    long long rows, const char* trap) {
    __shared__ __align__(16) P s[SEG_MSORT_TILE];
    const long long base = (long long)blockIdx.x * SEG_MSORT_TILE + SEG_MSORT_PER * threadIdx.x;
    const long long space = width ? rows * width : rows;
    long long idx[SEG_MSORT_PER];
#pragma unroll
    for (int q = 0; q < SEG_MSORT_PER; ++q) idx[q] = base + q < n ? key[base + q] : 0;  // all loads in flight
    P v[SEG_MSORT_PER];
#pragma unroll
    for (int q = 0; q < SEG_MSORT_PER; ++q) {
        const long long e = base + q;
        v[q] = e < n ? ((P)seg_destination(idx[q], e, width, rows, space, trap) << DSHIFT) |
                           (P)(SEG_MSORT_PER * threadIdx.x + q)
                     : ~(P)0;
    }
    seg_bitonic(v, s);
    const long long tile = (long long)blockIdx.x * SEG_MSORT_TILE;
#pragma unroll
    for (int q = 0; q < SEG_MSORT_PER; ++q) {
        tkey[base + q] = v[q] == ~(P)0 ? 0xffffffffu : (unsigned)(v[q] >> DSHIFT);
        tpos[base + q] = (int)(tile + (long long)(v[q] & (P)(SEG_MSORT_TILE - 1)));
    }
}

// How many of a tile's sorted destinations a[0 .. T) are < x (or <= x with `le`): binary search, a fixed
// log2(T) + 1 reads.
__device__ __forceinline__ int seg_tile_rank(const unsigned* a, unsigned x, bool le) {
    int lo = 0;
#pragma unroll
    for (int s = SEG_MSORT_TILE / 2; s > 0; s >>= 1) {
        const unsigned v = a[lo + s - 1];
        if (v < x || (le && v == x)) lo += s;
    }
    const unsigned v = a[lo];
    return lo + (v < x || (le && v == x));
}

template <typename K>
__device__ __forceinline__ void seg_msort_merge_body(const unsigned* __restrict__ tkey, const int* __restrict__ tpos,
                                                     long long n, long long space, long long offset, int with_starts,
                                                     K* __restrict__ skey, long long* __restrict__ perm,
                                                     long long* __restrict__ start) {
    extern __shared__ unsigned seg_msort_smem[];  // every tile's destinations
    const int tiles = (int)((n + SEG_MSORT_TILE - 1) / SEG_MSORT_TILE);
    for (int i = threadIdx.x; i < tiles * (SEG_MSORT_TILE / 4); i += blockDim.x)
        reinterpret_cast<uint4*>(seg_msort_smem)[i] = reinterpret_cast<const uint4*>(tkey)[i];
    __syncthreads();
    const long long total = n + (with_starts ? space + 1 : 0);
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += step) {
        const bool is_key = t < n;  // else start[t - n]
        const unsigned x = is_key ? seg_msort_smem[t] : (unsigned)(t - n);
        const int c = is_key ? (int)(t / SEG_MSORT_TILE) : -1;  // a start counts keys < m in every tile
        long long pos = is_key ? t - (long long)c * SEG_MSORT_TILE : 0;
        for (int c0 = 0; c0 < tiles; c0 += 4) {  // four independent searches in flight
            int r[4];
#pragma unroll
            for (int q = 0; q < 4; ++q)
                r[q] = c0 + q < tiles && c0 + q != c
                           ? seg_tile_rank(seg_msort_smem + (c0 + q) * SEG_MSORT_TILE, x, c0 + q < c) : 0;
            pos += r[0] + r[1] + r[2] + r[3];
        }
        if (is_key) {
            skey[pos] = (K)((long long)x - offset);
            perm[pos] = tpos[t];
        } else {
            start[t - n] = pos;
        }
    }
}

#define SEG_MSORT_FOR(PREFIX, KEYNAME, KT, PT, DSHIFT)                                                    \
    extern "C" __global__ void __launch_bounds__(SEG_MSORT_THREADS)                                      \
    PREFIX##_msort_tile_##KEYNAME(const long long* __restrict__ key, unsigned* __restrict__ tkey,        \
                                  int* __restrict__ tpos, long long n, long long width, long long rows, int trap) { \
        seg_msort_tile_body<PT, DSHIFT>(key, tkey, tpos, n, width, rows, trap ? #PREFIX : nullptr);      \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(SEG_MSORT_MERGE_THREADS)                                \
    PREFIX##_msort_merge_##KEYNAME(const unsigned* __restrict__ tkey, const int* __restrict__ tpos, long long n, \
                                   long long space, long long offset, int with_starts, KT* __restrict__ skey, \
                                   long long* __restrict__ perm, long long* __restrict__ start) {        \
        seg_msort_merge_body<KT>(tkey, tpos, n, space, offset, with_starts, skey, perm, start);          \
    }

// ------------------------------------------------------------------------------------------------
// sorted: device radix sort of many keys (int16 or int32 keys, beyond the merge sort)

// Replaces the keys kernel and torch.sort where n is large. torch.sort sorts every byte of the key type
// (four 8-bit passes for int32) and copies around them; the destinations 0 .. space (the sentinel
// included) have only b = bit_length(space) significant bits (17 for 10^5 rows). A least significant
// digit first radix sort in P = ceil(b / 9) passes of B = ceil(b / P) bits (R = 2^B digits), each pass
// three launches:
//   count  block t counts each digit among the keys [T t, T t + T) (T = SEG_RSORT_TILE) in shared memory
//          (integer atomics, exact in any order; a warp whose 32 keys share one digit adds 32 at once),
//          counts[t * R + d] (one coalesced row per tile). The first pass makes the keys from the index
//          (seg_destination: the sentinel `space` for a bad index, or the device-side assertion).
//   scan   block d: the exclusive prefix of digit d's counts over the tiles, prefix[d * tiles + t] (read
//          by column, written by row: no scattered partial writes), and its total.
//   place  block t again: warp w walks its T / 8 keys 32 at a time, finds the lanes of one digit by B
//          ballots (seg_same_bits) and ranks each key among the keys of its digit before it in the warp's
//          share (per-warp running counts); the warps' counts become an exclusive prefix per digit over
//          the tile, the tile's keys and values are staged in shared memory in digit order, and written
//          out in that order (a digit's keys in consecutive positions): at the digit's base (an exclusive
//          prefix of the totals) plus the tile's prefix for it. The first pass makes the keys from the
//          index again, each with its position e as the value. The last pass writes skey (destination -
//          offset) and perm (int64); the others a key and a value of 32 bits each.
// Each pass is a stable counting sort on one digit, so the whole is a stable sort: skey and perm are
// torch.sort(stable=True)'s. DETERMINISTIC: integer counts, ranks by a fixed schedule.
#define SEG_RSORT_TILE 2048
#define SEG_RSORT_THREADS 256
#define SEG_RSORT_ITEMS (SEG_RSORT_TILE / SEG_RSORT_THREADS)  // keys per lane
static_assert(SEG_WARPS * 32 == SEG_RSORT_THREADS, "a tile is SEG_WARPS warps' shares");
#define SEG_RSORT_BITS 9                                      // most bits per digit
#define SEG_RSORT_DIGITS (1 << SEG_RSORT_BITS)
#define SEG_RSORT_HSTRIDE (SEG_RSORT_DIGITS + 1)  // a warp's counts: one row of the block's [warp][digit]
// place's shared stage: the warps' counts, later the tile's keys and values
#define SEG_RSORT_STAGE (SEG_WARPS * SEG_RSORT_HSTRIDE > 2 * SEG_RSORT_TILE ? SEG_WARPS * SEG_RSORT_HSTRIDE \
                                                                      : 2 * SEG_RSORT_TILE)

// The lanes whose `bits`-bit digit equals this lane's (bits <= SEG_RSORT_BITS, the same in every lane).
__device__ __forceinline__ unsigned seg_same_bits(unsigned d, int bits) {
    unsigned peers = SEG_FULL;
#pragma unroll
    for (int b = 0; b < SEG_RSORT_BITS; ++b) {
        if (b < bits) {
            const unsigned ones = __ballot_sync(SEG_FULL, (d >> b) & 1u);
            peers &= ((d >> b) & 1u) ? ones : ~ones;
        }
    }
    return peers;
}

// k[r]: the key of element e0 + 32 r (0 past n): kin's, or, without kin (the first pass), the
// destination of the index (all loads in flight before any is used).
__device__ __forceinline__ void seg_rsort_keys(const long long* __restrict__ idx, const unsigned* __restrict__ kin,
                                               long long e0, long long n, long long width, long long rows,
                                               const char* trap, unsigned (&k)[SEG_RSORT_ITEMS]) {
    if (kin != nullptr) {
#pragma unroll
        for (int r = 0; r < SEG_RSORT_ITEMS; ++r) k[r] = e0 + 32 * r < n ? kin[e0 + 32 * r] : 0u;
        return;
    }
    const long long space = width ? rows * width : rows;
    long long i[SEG_RSORT_ITEMS];
#pragma unroll
    for (int r = 0; r < SEG_RSORT_ITEMS; ++r) i[r] = e0 + 32 * r < n ? idx[e0 + 32 * r] : 0;
#pragma unroll
    for (int r = 0; r < SEG_RSORT_ITEMS; ++r)
        k[r] = e0 + 32 * r < n ? (unsigned)seg_destination(i[r], e0 + 32 * r, width, rows, space, trap) : 0u;
}

// Place's walk: warp w's keys in order, 32 at a time; rank[r] = the number of keys of the same digit
// before key r in the warp's share; h the warp's running counts.
__device__ __forceinline__ void seg_rsort_walk(const unsigned (&k)[SEG_RSORT_ITEMS], long long e0, long long n,
                                               int shift, int bits, unsigned* h, unsigned (&rank)[SEG_RSORT_ITEMS]) {
    const int lane = threadIdx.x & 31;
    const unsigned below = (1u << lane) - 1u, mask = (1u << bits) - 1u;
#pragma unroll
    for (int r = 0; r < SEG_RSORT_ITEMS; ++r) {
        const bool valid = e0 + 32 * r < n;
        const unsigned live = __ballot_sync(SEG_FULL, valid);
        if (live == 0u) break;  // the same in every lane
        const unsigned d = (k[r] >> shift) & mask;
        const unsigned peers = seg_same_bits(d, bits) & live;
        if (valid) rank[r] = h[d] + __popc(peers & below);
        __syncwarp();
        if (valid && lane == 31 - __clz(peers)) h[d] += __popc(peers);
        __syncwarp();
    }
}

__device__ __forceinline__ void seg_rsort_count_body(const long long* __restrict__ idx,
                                                     const unsigned* __restrict__ kin, long long n, long long width,
                                                     long long rows, int shift, int bits,
                                                     unsigned* __restrict__ counts, const char* trap) {
    __shared__ unsigned hist[SEG_RSORT_DIGITS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned mask = (1u << bits) - 1u;
    for (int i = threadIdx.x; i < SEG_RSORT_DIGITS; i += SEG_RSORT_THREADS) hist[i] = 0u;
    const long long e0 = (long long)blockIdx.x * SEG_RSORT_TILE + warp * (SEG_RSORT_TILE / SEG_WARPS) + lane;
    unsigned k[SEG_RSORT_ITEMS];
    seg_rsort_keys(idx, kin, e0, n, width, rows, trap, k);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < SEG_RSORT_ITEMS; ++r) {  // integer counts: exact in any order
        const bool valid = e0 + 32 * r < n;
        const unsigned d = (k[r] >> shift) & mask, live = __ballot_sync(SEG_FULL, valid);
        if (live == SEG_FULL && __all_sync(SEG_FULL, d == __shfl_sync(SEG_FULL, d, 0))) {
            if (lane == 0) atomicAdd(hist + d, 32u);  // one hot digit: one atomic, not 32 on one word
        } else if (valid) {
            atomicAdd(hist + d, 1u);
        }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < (1 << bits); d += SEG_RSORT_THREADS)
        counts[(long long)blockIdx.x * (1 << bits) + d] = hist[d];
}

// Block d of R = gridDim.x digits: prefix[d * tiles + t] = the sum of counts[t' * R + d] over t' < t;
// totals[d] = the sum over every tile.
extern "C" __global__ void __launch_bounds__(SEG_RSORT_THREADS)
segsum_rsort_scan(const unsigned* __restrict__ counts, int tiles, unsigned* __restrict__ prefix,
                  unsigned* __restrict__ totals) {
    __shared__ unsigned wsum[SEG_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned* c = counts + blockIdx.x;
    unsigned* out = prefix + (long long)blockIdx.x * tiles;
    unsigned carry = 0u;
    for (int t0 = 0; t0 < tiles; t0 += SEG_RSORT_THREADS) {
        const int t = t0 + threadIdx.x;
        const unsigned v = t < tiles ? c[(long long)t * gridDim.x] : 0u;
        const unsigned incl = seg_warp_inclusive(v);
        if (lane == 31) wsum[warp] = incl;
        __syncthreads();
        unsigned before = 0u, all = 0u;
#pragma unroll
        for (int w = 0; w < SEG_WARPS; ++w) {
            before += w < warp ? wsum[w] : 0u;
            all += wsum[w];
        }
        if (t < tiles) out[t] = carry + before + incl - v;
        carry += all;
        __syncthreads();
    }
    if (threadIdx.x == 0) totals[blockIdx.x] = carry;
}

// Exclusive prefix over the digits of a block-wide array held two consecutive digits per thread (a, b:
// digits 2 t and 2 t + 1): the prefix of digit 2 t. wsum: SEG_WARPS words of scratch.
__device__ __forceinline__ unsigned seg_rsort_prefix2(unsigned a, unsigned b, unsigned* wsum) {
    static_assert(2 * SEG_RSORT_THREADS >= SEG_RSORT_DIGITS, "two digits per thread");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned incl = seg_warp_inclusive(a + b);
    __syncthreads();  // earlier readers of wsum are done
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    unsigned excl = incl - a - b;
#pragma unroll
    for (int w = 0; w < SEG_WARPS; ++w) excl += w < warp ? wsum[w] : 0u;
    return excl;
}

template <typename KT>
__device__ __forceinline__ void seg_rsort_place_body(const long long* __restrict__ idx,
                                                     const unsigned* __restrict__ kin, const int* __restrict__ vin,
                                                     long long n, long long width, long long rows, int shift,
                                                     int bits, const unsigned* __restrict__ prefix,
                                                     const unsigned* __restrict__ totals, unsigned* __restrict__ kout,
                                                     int* __restrict__ vout, KT* __restrict__ skey,
                                                     long long* __restrict__ perm, long long offset) {
    // the warps' counts [warp][digit] first; then the tile's keys and values in digit order
    __shared__ unsigned stage[SEG_RSORT_STAGE];
    __shared__ unsigned delta[SEG_RSORT_DIGITS];  // output position of the tile's i-th key in digit order - i
    __shared__ unsigned wsum[SEG_WARPS];
    unsigned* hist = stage;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int R = 1 << bits, d0 = 2 * threadIdx.x;
    const unsigned mask = (unsigned)R - 1u;
    const long long tile0 = (long long)blockIdx.x * SEG_RSORT_TILE;
    for (int i = threadIdx.x; i < SEG_WARPS * SEG_RSORT_HSTRIDE; i += SEG_RSORT_THREADS) hist[i] = 0u;
    const long long e0 = tile0 + warp * (SEG_RSORT_TILE / SEG_WARPS) + lane;
    unsigned k[SEG_RSORT_ITEMS], slot[SEG_RSORT_ITEMS];
    int v[SEG_RSORT_ITEMS];
    seg_rsort_keys(idx, kin, e0, n, width, rows, nullptr, k);
#pragma unroll
    for (int r = 0; r < SEG_RSORT_ITEMS; ++r)
        v[r] = vin == nullptr ? (int)(e0 + 32 * r) : (e0 + 32 * r < n ? vin[e0 + 32 * r] : 0);
    // the digit's first output position for this tile: the totals of the digits below it plus the
    // tile's prefix
    unsigned first0, first1;
    {
        const unsigned a = d0 < R ? totals[d0] : 0u, b = d0 + 1 < R ? totals[d0 + 1] : 0u;
        const unsigned excl = seg_rsort_prefix2(a, b, wsum);  // its __syncthreads order the zero fill too
        first0 = d0 < R ? excl + prefix[d0 * (long long)gridDim.x + blockIdx.x] : 0u;
        first1 = d0 + 1 < R ? excl + a + prefix[(d0 + 1) * (long long)gridDim.x + blockIdx.x] : 0u;
    }
    seg_rsort_walk(k, e0, n, shift, bits, hist + warp * SEG_RSORT_HSTRIDE, slot);
    __syncthreads();
    {  // the tile's digit starts (an exclusive prefix of its counts), then each warp's first slot per digit
        unsigned c0 = 0u, c1 = 0u;
#pragma unroll
        for (int w = 0; w < SEG_WARPS; ++w) {
            c0 += d0 < R ? hist[w * SEG_RSORT_HSTRIDE + d0] : 0u;
            c1 += d0 + 1 < R ? hist[w * SEG_RSORT_HSTRIDE + d0 + 1] : 0u;
        }
        const unsigned start = seg_rsort_prefix2(c0, c1, wsum);
        if (d0 < R) {
            delta[d0] = first0 - start;
            delta[d0 + 1] = first1 - (start + c0);  // R is even (bits >= 1)
            unsigned run0 = start, run1 = start + c0;
#pragma unroll
            for (int w = 0; w < SEG_WARPS; ++w) {
                unsigned* x = hist + w * SEG_RSORT_HSTRIDE + d0;
                const unsigned x0 = x[0], x1 = x[1];
                x[0] = run0;
                x[1] = run1;
                run0 += x0;
                run1 += x1;
            }
        }
    }
    __syncthreads();
    const unsigned* h = hist + warp * SEG_RSORT_HSTRIDE;
#pragma unroll
    for (int r = 0; r < SEG_RSORT_ITEMS; ++r)
        if (e0 + 32 * r < n) slot[r] += h[(k[r] >> shift) & mask];
    __syncthreads();  // the counts are read: the stage takes the keys
#pragma unroll
    for (int r = 0; r < SEG_RSORT_ITEMS; ++r) {
        if (e0 + 32 * r >= n) break;
        stage[slot[r]] = k[r];
        stage[SEG_RSORT_TILE + slot[r]] = (unsigned)v[r];
    }
    __syncthreads();
    const int count = (int)min((long long)SEG_RSORT_TILE, n - tile0);
    for (int i = threadIdx.x; i < count; i += SEG_RSORT_THREADS) {  // runs of one digit: consecutive positions
        const unsigned key = stage[i];
        const unsigned p = delta[(key >> shift) & mask] + (unsigned)i;
        if (skey != nullptr) {
            skey[p] = (KT)((long long)key - offset);
            perm[p] = (long long)(int)stage[SEG_RSORT_TILE + i];
        } else {
            kout[p] = key;
            vout[p] = (int)stage[SEG_RSORT_TILE + i];
        }
    }
}

// PREFIX_rsort_count, PREFIX_rsort_place_i16, PREFIX_rsort_place_i32 (the last pass's key type; the
// other passes pass skey = nullptr)
#define SEG_RSORT_KERNELS(PREFIX)                                                                        \
    extern "C" __global__ void __launch_bounds__(SEG_RSORT_THREADS)                                      \
    PREFIX##_rsort_count(const long long* __restrict__ idx, const unsigned* __restrict__ kin, long long n,  \
                         long long width, long long rows, int shift, int bits, unsigned* __restrict__ counts, \
                         int trap) {                                                                     \
        seg_rsort_count_body(idx, kin, n, width, rows, shift, bits, counts, trap ? #PREFIX : nullptr);   \
    }                                                                                                    \
    SEG_RSORT_PLACE(PREFIX, i16, short)                                                                  \
    SEG_RSORT_PLACE(PREFIX, i32, int)

#define SEG_RSORT_PLACE(PREFIX, KEYNAME, KT)                                                             \
    extern "C" __global__ void __launch_bounds__(SEG_RSORT_THREADS)                                      \
    PREFIX##_rsort_place_##KEYNAME(const long long* __restrict__ idx, const unsigned* __restrict__ kin,   \
                                   const int* __restrict__ vin, long long n, long long width, long long rows, \
                                   int shift, int bits, const unsigned* __restrict__ prefix,             \
                                   const unsigned* __restrict__ totals, unsigned* __restrict__ kout,     \
                                   int* __restrict__ vout, KT* __restrict__ skey, long long* __restrict__ perm, \
                                   long long offset) {                                                   \
        seg_rsort_place_body<KT>(idx, kin, vin, n, width, rows, shift, bits, prefix, totals, kout, vout, skey, \
                                 perm, offset);                                                          \
    }

// start[m] = first sorted position with key >= m, for m = 0 .. space (start[space] = valid keys). Each
// block first reads a sample of the sorted keys, skey[j * gap] for j < ceil(n / gap) (at most
// SEG_STARTS_SAMPLE, one round trip), and searches it in shared memory: the global binary search then
// spans one gap (about log2(n / 1024) dependent reads in place of log2(n)).
#define SEG_STARTS_SAMPLE 1024
template <typename K>
__device__ __forceinline__ void seg_starts_body(const K* __restrict__ skey, long long n, long long space,
                                                long long offset, long long* __restrict__ start) {
    __shared__ K sample[SEG_STARTS_SAMPLE];
    const long long gap = n > SEG_STARTS_SAMPLE ? (n + SEG_STARTS_SAMPLE - 1) / SEG_STARTS_SAMPLE : 1;
    const int count = (int)((n + gap - 1) / gap);
    for (int j = threadIdx.x; j < count; j += blockDim.x) sample[j] = skey[j * gap];
    __syncthreads();
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long m = (long long)blockIdx.x * blockDim.x + threadIdx.x; m <= space; m += step) {
        int a = 0, b = count;  // a: the sampled keys below m
        while (a < b) {
            const int mid = (a + b) >> 1;
            if ((long long)sample[mid] + offset < m) a = mid + 1;
            else b = mid;
        }
        // skey[(a - 1) gap] < m <= skey[a gap] (a = count: up to n): the first key >= m lies in between
        long long lo = a == 0 ? 0 : (long long)(a - 1) * gap + 1, hi = a < count ? (long long)a * gap : n;
        while (lo < hi) {
            const long long mid = (lo + hi) >> 1;
            if ((long long)skey[mid] + offset < m) lo = mid + 1;
            else hi = mid;
        }
        start[m] = lo;
    }
}

// ------------------------------------------------------------------------------------------------
// sorted: the tree over chunk partials

// Halving tree over `count` <= 32 values p[i * D] (i < count; +0.0 beyond): v[i] += v[i + half].
// Reads bypass L1: other warps wrote them.
__device__ __forceinline__ float seg_node(const float* p, int count, long long D) {
    float v[SEG_FAN];
#pragma unroll
    for (int i = 0; i < SEG_FAN; ++i) v[i] = i < count ? __ldcg(p + i * D) : 0.0f;
#pragma unroll
    for (int half = SEG_FAN / 2; half >= 1; half >>= 1)
#pragma unroll
        for (int i = 0; i < half; ++i) v[i] += v[i + half];
    return v[0];
}

// After chunk c of a row (nc >= 2 chunks, first slot `base`) has written its partials to part1 (this
// thread's columns [cb, ce)): the group's last chunk builds the group's node (to out when it is the
// root, else to part2), the row's last node builds the root. Ticket counters are per (slot, slice):
// slices of one row run independently. Called by every lane of a warp (team = 32) or by one thread
// (team = 1); lanes agree on everything but their columns.
template <int TEAM>
__device__ __forceinline__ void seg_combine(float* __restrict__ out, float* part1, float* part2,
                                            unsigned* cnt1, unsigned* cnt2, long long m, long long base,
                                            long long c, long long nc, int D, int cb, int ce,
                                            long long slice, long long slices) {
    const int lane = TEAM == 32 ? (threadIdx.x & 31) : 0;
    const long long g = c / SEG_FAN;
    const int in_group = (int)min((long long)SEG_FAN, nc - g * SEG_FAN);
    __threadfence();  // this chunk's partials are visible before its ticket
    if (TEAM == 32) __syncwarp();
    unsigned last = 0;
    if (lane == 0) {
        unsigned* t = cnt1 + (base + g) * slices + slice;
        last = atomicAdd(t, 1u) == (unsigned)(in_group - 1);
        if (last) *t = 0u;  // every chunk of the group has drawn: reset for the next launch
    }
    if (TEAM == 32) last = __shfl_sync(SEG_FULL, last, 0);
    if (!last) return;
    __threadfence();
    const long long groups = (nc + SEG_FAN - 1) / SEG_FAN;
    for (int col = cb; col < ce; ++col) {
        const float q = seg_node(part1 + (base + g * SEG_FAN) * D + col, in_group, D);
        if (groups == 1) out[m * D + col] = q;
        else part2[(base + g) * D + col] = q;
    }
    if (groups == 1) return;
    __threadfence();
    if (TEAM == 32) __syncwarp();
    last = 0;
    if (lane == 0) {
        unsigned* t = cnt2 + base * slices + slice;
        last = atomicAdd(t, 1u) == (unsigned)(groups - 1);
        if (last) *t = 0u;
    }
    if (TEAM == 32) last = __shfl_sync(SEG_FULL, last, 0);
    if (!last) return;
    __threadfence();
    for (int col = cb; col < ce; ++col) out[m * D + col] = seg_node(part2 + base * D + col, (int)groups, D);
}

// ------------------------------------------------------------------------------------------------
// sorted: warp tasks (row form, D >= 4)

template <int VEC>
struct SegVec;
template <>
struct SegVec<1> {
    __device__ static void load(const float* p, float* v) { v[0] = p[0]; }
    __device__ static void store(float* p, const float* v) { p[0] = v[0]; }
};
template <>
struct SegVec<2> {
    __device__ static void load(const float* p, float* v) {
        const float2 t = *reinterpret_cast<const float2*>(p);
        v[0] = t.x; v[1] = t.y;
    }
    __device__ static void store(float* p, const float* v) { *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]); }
};
template <>
struct SegVec<4> {
    __device__ static void load(const float* p, float* v) {
        const float4 t = *reinterpret_cast<const float4*>(p);
        v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
    }
    __device__ static void store(float* p, const float* v) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    }
};

// Floats per lane in flight in the warp sums (half of it at one column a lane) and blocks per SM of the
// tiles and fill kernels (their registers); bench/dev/segsum_phases.py --fill-grid tries others.
#ifndef SEG_LANE_FLOATS
#define SEG_LANE_FLOATS 16
#endif
#ifndef SEG_SUMS_BLOCKS
#define SEG_SUMS_BLOCKS 3
#endif

// Source rows a lane loads at once in the warp sums: SEG_LANE_FLOATS floats (half of them at one column a
// lane), U dividing 32 (a group of U rows never crosses a 32-position batch of perm).
template <int VEC>
__device__ constexpr int seg_lane_rows() {
    constexpr int U = VEC == 1 ? SEG_LANE_FLOATS / 2 : SEG_LANE_FLOATS / VEC;
    static_assert(U >= 1 && 32 % U == 0, "SEG_LANE_FLOATS: a power of two from 4 to 64");
    return U;
}

// The warp sums `len` contributions from sorted position q0 in source order: lane l holds columns
// col .. col + VEC - 1. perm is read 32 positions at a time (one per lane) and broadcast; U source rows
// are loaded at once (seg_lane_rows; by default 16 floats per lane in flight, 80 registers: 3 blocks per
// SM; predicated, so a short chunk costs one round trip), then added one at a time in order.
template <int VEC, int U = seg_lane_rows<VEC>()>
__device__ __forceinline__ void seg_warp_chunk(const float* __restrict__ src, const long long* __restrict__ perm,
                                               long long q0, int len, int D, int col, bool active, bool scaled,
                                               float count, float* acc) {
    static_assert(U >= 1 && 32 % U == 0, "U divides 32");
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
    for (int b = 0; b < len; b += 32) {
        const int nb = min(32, len - b);
        const long long mine = lane < nb ? perm[q0 + b + lane] : 0;
        for (int t = 0; t < nb; t += U) {  // t + u < 32: U divides 32
            float v[U][VEC];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const long long row = __shfl_sync(SEG_FULL, mine, t + u);
                if (active && t + u < nb) SegVec<VEC>::load(src + row * D + col, v[u]);
            }
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (t + u < nb)
#pragma unroll
                    for (int j = 0; j < VEC; ++j) acc[j] += seg_value(v[u][j], scaled, count);
        }
    }
}

// Sparse split: a tile's rows of one contribution (lanes in `singles`; lane h holds the row's
// destination m and the contribution's source row r), U of them at once: U source rows loaded before any
// is stored (independent loads in flight; taking them one after another left the warp waiting on two
// dependent loads per row). Each is out[m] = +0.0 + value, the row's one chunk as seg_warp_chunk sums it
// (so -0.0 still becomes +0.0), divided by its count 1 where scaled, as seg_value does.
template <int VEC>
__device__ __forceinline__ void seg_warp_singles(const float* __restrict__ src, float* __restrict__ out,
                                                 unsigned singles, long long r, long long m, int D, int col,
                                                 bool active, bool scaled) {
    constexpr int U = seg_lane_rows<VEC>();   // by default 8 to 16 floats per lane in flight
    while (singles) {            // warp-uniform
        long long dst[U];
        float v[U][VEC];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            dst[u] = -1;
            if (singles) {
                const int h = __ffs(singles) - 1;
                singles &= singles - 1;
                const long long hr = __shfl_sync(SEG_FULL, r, h);
                dst[u] = __shfl_sync(SEG_FULL, m, h);
                if (active) SegVec<VEC>::load(src + hr * D + col, v[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (dst[u] < 0 || !active) continue;
            float acc[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                acc[j] = 0.0f;
                acc[j] += seg_value(v[u][j], scaled, 1.0f);
            }
            SegVec<VEC>::store(out + dst[u] * D + col, acc);
        }
    }
}

// A row's chunk 0 (k >= 1 contributions from sorted position s): to the row when it is the only chunk,
// else to its partial slot and into the tree. U: source rows a lane loads at once.
template <int VEC, int U = seg_lane_rows<VEC>()>
__device__ __forceinline__ void seg_warp_first_chunk(const float* __restrict__ src, const long long* __restrict__ perm,
                                                     float* __restrict__ out, float* part1, float* part2,
                                                     unsigned* cnt1, unsigned* cnt2, long long m, long long s,
                                                     long long k, int D, int col, bool active, int cb, int ce,
                                                     bool scaled, long long slice, long long slices) {
    float acc[VEC];
    const long long L = seg_chunk_len(k), nc = (k + L - 1) / L;
    seg_warp_chunk<VEC, U>(src, perm, s, (int)min(L, k), D, col, active, scaled, (float)k, acc);
    if (nc == 1) {
        if (active) SegVec<VEC>::store(out + m * D + col, acc);
    } else {
        const long long base = seg_slot(s);
        if (active) SegVec<VEC>::store(part1 + base * D + col, acc);
        seg_combine<32>(out, part1, part2, cnt1, cnt2, m, base, 0, nc, D, cb, ce, slice, slices);
    }
}

// Task splits (SPLIT): SEG_SPLIT_ROWS: task w < space is destination row w (zeros when empty or skipped;
// else its chunk 0). SEG_SPLIT_TILES: task w < R = ceil(space / 32) is the tile of destination rows
// 32 w .. + 31: one coalesced read of their starts, zeros for the empty and skipped rows, the rows of one
// contribution through seg_warp_singles (their source rows read lane-parallel, the values U at a time),
// then chunk 0 of each longer row, one after another (so a warp spends no round trip on an empty row).
// Then, in both, position task w >= space (or R): the tile of sorted positions 32 * (w - space or R)
// .. + 31 and the chunks c >= 1 that start in it. SEG_SPLIT_FILL: position tasks only, over an output
// whose other rows are zeroed elsewhere (the launcher's fill split fills it on a second stream while the
// keys are sorted; its gaps split zeroes the rows no key reaches beside this kernel); a position
// tile also takes the rows that start in it: those of one contribution through seg_warp_singles, then
// chunk 0 of each longer row; `fill` warps share a tile (its lanes h with h % fill == the warp's
// number among them: more warps, each with a shorter chain of dependent loads, where the tiles are few).
// SEG_SPLIT_LONG (the once split's long rows): position tasks as in the fill split, taking only the rows of
// more than one chunk (k > SEG_CHUNK_MIN: chunk 0 of those starting in the tile, and the chunks c >= 1),
// with SEG_LONG_ROWS source rows a lane in flight; segsum_once writes every other destination.
// Grid row y: column slices y, y + gridDim.y, ... of 32 * VEC columns each.
// Every split sums the same chunks in the same order: the same bits.
#define SEG_SPLIT_ROWS 0
#define SEG_SPLIT_TILES 1
#define SEG_SPLIT_FILL 2
#define SEG_SPLIT_LONG 3
#ifndef SEG_LONG_ROWS
#define SEG_LONG_ROWS 32   // a chunk of 32 in one round trip (VEC 1: 32 floats a lane)
#endif
#ifndef SEG_LONG_BLOCKS
#define SEG_LONG_BLOCKS 2  // blocks per SM of the long-rows kernel: 128 registers, no spills
#endif

template <typename K, int VEC, int SPLIT>
__device__ __forceinline__ void seg_rows_body(const float* __restrict__ src, const K* __restrict__ skey,
                                              const long long* __restrict__ perm,
                                              const long long* __restrict__ start, float* __restrict__ out,
                                              float* part1, float* part2, unsigned* cnt1, unsigned* cnt2,
                                              long long n, int D, long long skip, int scaled, long long space,
                                              long long offset, int fill) {
    const int lane = threadIdx.x & 31;
    const long long slices = (D + 32 * VEC - 1) / (32 * VEC);
    const long long dtasks = SPLIT == SEG_SPLIT_ROWS ? space : SPLIT == SEG_SPLIT_TILES ? (space + 31) >> 5 : 0;
    const int group = SPLIT >= SEG_SPLIT_FILL ? fill : 1;   // warps per position tile: a power of two, 1 to 32
    constexpr int U = SPLIT == SEG_SPLIT_LONG ? SEG_LONG_ROWS : seg_lane_rows<VEC>();
    const long long tasks = dtasks + ((n + 31) >> 5) * group;
    const long long warps = (long long)gridDim.x * SEG_WARPS;
    for (long long slice = blockIdx.y; slice < slices; slice += gridDim.y) {
        const int col = (int)slice * 32 * VEC + lane * VEC;
        const bool active = col < D;  // D is a multiple of VEC
        const int cb = active ? col : 0, ce = active ? col + VEC : 0;
        for (long long w = (long long)blockIdx.x * SEG_WARPS + (threadIdx.x >> 5); w < tasks; w += warps) {
            float acc[VEC];
            if (w < dtasks) {  // warp-uniform
                if (SPLIT == SEG_SPLIT_ROWS) {
                    const long long m = w, s = start[m], k = start[m + 1] - s;
                    if (k == 0 || m == skip) {
#pragma unroll
                        for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
                        if (active) SegVec<VEC>::store(out + m * D + col, acc);
                    } else {
                        seg_warp_first_chunk<VEC, U>(src, perm, out, part1, part2, cnt1, cnt2, m, s, k, D, col,
                                                     active, cb, ce, scaled, slice, slices);
                    }
                    continue;
                }
                const long long m = w * 32 + lane;
                long long s = 0, k = 0, r = 0;
                if (m < space) {
                    s = start[m];
                    k = m == skip ? 0 : start[m + 1] - s;
                }
                if (k == 1) r = perm[s];
                const unsigned empty = __ballot_sync(SEG_FULL, m < space && k == 0);
                const unsigned singles = __ballot_sync(SEG_FULL, k == 1);
                unsigned longer = __ballot_sync(SEG_FULL, k > 1);
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
                for (unsigned e = empty; e; e &= e - 1)
                    if (active) SegVec<VEC>::store(out + (w * 32 + __ffs(e) - 1) * D + col, acc);
                seg_warp_singles<VEC>(src, out, singles, r, m, D, col, active, scaled);
                while (longer) {
                    const int h = __ffs(longer) - 1;
                    longer &= longer - 1;
                    seg_warp_first_chunk<VEC, U>(src, perm, out, part1, part2, cnt1, cnt2, w * 32 + h,
                                                 __shfl_sync(SEG_FULL, s, h), __shfl_sync(SEG_FULL, k, h), D, col,
                                                 active, cb, ce, scaled, slice, slices);
                }
                continue;
            }
            // group: a power of two; this warp's lanes of its tile are those h with h % group == its number
            const long long tile = (w - dtasks) >> (__ffs(group) - 1), p = tile * 32 + lane;
            const bool mine = (lane & (group - 1)) == (int)((w - dtasks) & (group - 1));
            long long m = 0, s = 0, k = 0, L = 1;
            bool head = false, first = false;
            if (p < n && mine) {  // (other lanes' positions: other warps')
                m = (long long)skey[p] + offset;
                if (m < space && m != skip) {
                    s = start[m];
                    k = start[m + 1] - s;
                    L = seg_chunk_len(k);
                    first = p == s;
                    head = !first && ((p - s) & (L - 1)) == 0;  // a chunk c >= 1
                }
            }
            if (SPLIT >= SEG_SPLIT_FILL) {  // the rows starting in this tile (long: of two chunks or more)
                if (SPLIT == SEG_SPLIT_FILL) {
                    const bool single = first && k == 1;
                    const long long r = single ? perm[p] : 0;
                    seg_warp_singles<VEC>(src, out, __ballot_sync(SEG_FULL, single), r, m, D, col, active,
                                          scaled);
                }
                const long long shortest = SPLIT == SEG_SPLIT_LONG ? SEG_CHUNK_MIN : 1;
                for (unsigned longer = __ballot_sync(SEG_FULL, first && k > shortest); longer; longer &= longer - 1) {
                    const int h = __ffs(longer) - 1;
                    seg_warp_first_chunk<VEC, U>(src, perm, out, part1, part2, cnt1, cnt2,
                                                 __shfl_sync(SEG_FULL, m, h), tile * 32 + h,
                                                 __shfl_sync(SEG_FULL, k, h), D, col, active, cb, ce, scaled, slice,
                                                 slices);
                }
            }
            unsigned heads = __ballot_sync(SEG_FULL, head);
            while (heads) {
                const int h = __ffs(heads) - 1;
                heads &= heads - 1;
                const long long hm = __shfl_sync(SEG_FULL, m, h), hs = __shfl_sync(SEG_FULL, s, h);
                const long long hk = __shfl_sync(SEG_FULL, k, h), hL = __shfl_sync(SEG_FULL, L, h);
                const long long hp = tile * 32 + h;
                const long long c = (hp - hs) / hL, nc = (hk + hL - 1) / hL, base = seg_slot(hs);
                seg_warp_chunk<VEC, U>(src, perm, hp, (int)min(hL, hk - (hp - hs)), D, col, active, scaled,
                                       (float)hk, acc);
                if (active) SegVec<VEC>::store(part1 + (base + c) * D + col, acc);
                seg_combine<32>(out, part1, part2, cnt1, cnt2, hm, base, c, nc, D, cb, ce, slice, slices);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// sorted: thread tasks (element form, and row form with D < 4)

// Task t < space: destination t (zeros when empty or skipped; else its chunk 0). Task t >= space:
// sorted position p = t - space, the chunk c >= 1 that starts there if one does. With `fill` (the other
// rows zeroed elsewhere: the fill and gaps splits): position tasks only, each also taking chunk 0 of a row
// that starts there. Column by column:
// perm[q] * D + d is the value of contribution q in column d (element form: D = 1, perm[q] is the
// flat src element); 8 contributions loaded at once, added in order.
template <typename K>
__device__ __forceinline__ void seg_scalar_body(const float* __restrict__ src, const K* __restrict__ skey,
                                                const long long* __restrict__ perm,
                                                const long long* __restrict__ start, float* __restrict__ out,
                                                float* part1, float* part2, unsigned* cnt1, unsigned* cnt2,
                                                long long n, int D, long long skip, int scaled, long long space,
                                                long long offset, int fill) {
    constexpr int U = 8;
    const long long step = (long long)gridDim.x * blockDim.x;
    const long long first = fill ? space : 0;  // no destination tasks over a zero-filled output
    for (long long t = first + (long long)blockIdx.x * blockDim.x + threadIdx.x; t < space + n; t += step) {
        long long m, s, k, p;
        if (t < space) {
            m = t;
            s = start[m];
            k = start[m + 1] - s;
            if (k == 0 || m == skip) {
                for (int d = 0; d < D; ++d) out[m * D + d] = 0.0f;
                continue;
            }
            p = s;
        } else {
            p = t - space;
            m = (long long)skey[p] + offset;
            if (m >= space || m == skip) continue;
            s = start[m];
            k = start[m + 1] - s;
            if ((p == s && !fill) || ((p - s) & (seg_chunk_len(k) - 1)) != 0) continue;
        }
        const long long L = seg_chunk_len(k);
        const long long c = (p - s) / L, end = p + min(L, k - (p - s)), nc = (k + L - 1) / L;
        const long long base = seg_slot(s);
        const float count = (float)k;
        for (int d = 0; d < D; ++d) {
            float acc = 0.0f;
            for (long long q = p; q < end; q += U) {
                long long r[U];
                float v[U];
#pragma unroll
                for (int u = 0; u < U; ++u) r[u] = q + u < end ? perm[q + u] : 0;
#pragma unroll
                for (int u = 0; u < U; ++u) v[u] = q + u < end ? src[r[u] * D + d] : 0.0f;
#pragma unroll
                for (int u = 0; u < U; ++u)
                    if (q + u < end) acc += seg_value(v[u], scaled, count);
            }
            if (nc == 1) out[m * D + d] = acc;
            else part1[(base + c) * D + d] = acc;
        }
        if (nc > 1) seg_combine<1>(out, part1, part2, cnt1, cnt2, m, base, c, nc, D, 0, D, 0, 1);
    }
}

#define SEG_SORTED_PASS src, skey, perm, start, out, part1, part2, cnt1, cnt2, n, D, skip, scaled, space, offset, fill

#define SEG_SORTED_ARGS_T(KT)                                                                            \
    const float* __restrict__ src, const KT* __restrict__ skey, const long long* __restrict__ perm,     \
        const long long* __restrict__ start, float* __restrict__ out, float* part1, float* part2,       \
        unsigned* cnt1, unsigned* cnt2, long long n, int D, long long skip, int scaled, long long space, \
        long long offset, int fill

#define SEG_ROWS_PASS SEG_SORTED_PASS

// PREFIX_rows<VEC>_<key> (SEG_SPLIT_ROWS), PREFIX_rows<VEC>_tiles_<key> and PREFIX_rows<VEC>_fill_<key>,
// separate kernels. The last two are held to SEG_SUMS_BLOCKS blocks per SM (by default 3: 80 registers;
// at the default U = 16 / VEC, ptxas -v shows a few bytes spilled in the VEC 2 kernels and VEC 4's rows):
// their warps wait on short chains of dependent loads, so more of them per SM beat more loads in flight
// per warp (measured on the H200 against 128 registers and 32 floats in flight, 2 blocks per SM).
#define SEG_ROWS_KERNEL(PREFIX, KEYNAME, KT, VEC)                                                        \
    extern "C" __global__ void __launch_bounds__(256) PREFIX##_rows##VEC##_##KEYNAME(SEG_SORTED_ARGS_T(KT)) { \
        seg_rows_body<KT, VEC, SEG_SPLIT_ROWS>(SEG_ROWS_PASS);                                           \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256, SEG_SUMS_BLOCKS)                                   \
    PREFIX##_rows##VEC##_tiles_##KEYNAME(SEG_SORTED_ARGS_T(KT)) {                                        \
        seg_rows_body<KT, VEC, SEG_SPLIT_TILES>(SEG_ROWS_PASS);                                          \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256, SEG_SUMS_BLOCKS)                                   \
    PREFIX##_rows##VEC##_fill_##KEYNAME(SEG_SORTED_ARGS_T(KT)) {                                         \
        seg_rows_body<KT, VEC, SEG_SPLIT_FILL>(SEG_ROWS_PASS);                                           \
    }

// ------------------------------------------------------------------------------------------------
// sorted, the once split: every destination written once, no zero fill (row form, warp kernels)
//
// segsum_once<VEC> takes `per` (at most SEG_WARPS) tiles of 32 destinations a block, warp w reading tile
// w's starts (one round trip for all of them), then: the rows of 1 to SEG_CHUNK_MIN contributions (one
// chunk) are summed, a thread per (row, VEC columns), U source rows at a time (their perm entries, then the
// rows), added in source order from +0.0: seg_warp_chunk's order and bits; then the empty and skipped
// destinations get +0.0 (seg_zero_runs, streaming stores, as the gaps split). Rows of more contributions
// (two chunks or more) are left to the long-rows kernel (SEG_SPLIT_LONG), by default queued before it on
// the caller's stream, segsum_once beside it on a second one (kernels/index_add.py ONCE_ORDER). The
// launcher picks `per` so that the grid fits in one wave of SEG_ONCE_BLOCKS blocks an SM (where the long
// kernel's blocks leave the room): every block's few dependent loads are meant to overlap the other
// blocks' stores. Measured, it does not run near a plain fill's speed where
// most of the output is zeroed (twice the fill's time at 2048 tokens into 32000 x 768, H200): no default
// takes the split (kernels/index_add.py default_split has the figures).
#ifndef SEG_ONCE_BLOCKS
#define SEG_ONCE_BLOCKS 4   // blocks per SM (its registers; kernels/index_add.py ONCE_BLOCKS_PER_SM)
#endif
#ifndef SEG_ONCE_U
#define SEG_ONCE_U 0        // source rows in flight per thread (0: 4 at VEC 4, else 8)
#endif

template <int VEC>
__device__ __forceinline__ void seg_once_body(const float* __restrict__ src, const long long* __restrict__ perm,
                                              const long long* __restrict__ start, float* __restrict__ out,
                                              int D, long long skip, int scaled, long long space, int per) {
    constexpr int U = SEG_ONCE_U ? SEG_ONCE_U : VEC == 4 ? 4 : 8;   // source rows in flight per thread
    __shared__ long long row_start[SEG_WARPS][32];   // per tile, its short rows in order: first sorted position,
    __shared__ unsigned char row_lane[SEG_WARPS][32];   // destination within the tile,
    __shared__ unsigned char row_count[SEG_WARPS][32];  // contributions (1 .. 32)
    __shared__ unsigned tile_gaps[SEG_WARPS];
    __shared__ int tile_first[SEG_WARPS + 1];   // the tiles' short rows: exclusive prefix
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int vecs = D / VEC;   // VEC divides D
    const long long tiles = (space + 31) >> 5;
    per = max(1, min(per, SEG_WARPS));   // a warp per tile (blocks of 256 threads)
    for (long long t0 = (long long)blockIdx.x * per; t0 < tiles; t0 += (long long)gridDim.x * per) {
        const int here = (int)min((long long)per, tiles - t0);
        if (warp < here) {
            const long long m = (t0 + warp) * 32 + lane;
            long long s = 0, k = 0;
            if (m < space) {
                s = start[m];
                k = m == skip ? 0 : start[m + 1] - s;
            }
            const bool is_short = k >= 1 && k <= SEG_CHUNK_MIN;
            const unsigned shorts = __ballot_sync(SEG_FULL, is_short);
            const unsigned gaps = __ballot_sync(SEG_FULL, m < space && k == 0);
            if (is_short) {
                const int i = __popc(shorts & ((1u << lane) - 1u));
                row_start[warp][i] = s;
                row_lane[warp][i] = (unsigned char)lane;
                row_count[warp][i] = (unsigned char)k;
            }
            if (lane == 0) {
                tile_gaps[warp] = gaps;
                tile_first[warp + 1] = __popc(shorts);
            }
        }
        __syncthreads();
        if (tid == 0) {
            tile_first[0] = 0;
            for (int w = 0; w < here; ++w) tile_first[w + 1] += tile_first[w];
        }
        __syncthreads();
        const long long items = (long long)tile_first[here] * vecs;   // up to 256 rows of D floats
        for (long long it = tid; it < items; it += blockDim.x) {
            const int r = (int)(it / vecs), col = (int)(it - (long long)r * vecs) * VEC;
            int w = 0;
            while (tile_first[w + 1] <= r) ++w;   // the row's tile
            const int i = r - tile_first[w], k = row_count[w][i];
            const long long s = row_start[w][i];
            float acc[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
            for (int q = 0; q < k; q += U) {
                long long from[U];
                float v[U][VEC];
#pragma unroll
                for (int u = 0; u < U; ++u) from[u] = q + u < k ? perm[s + q + u] : 0;
#pragma unroll
                for (int u = 0; u < U; ++u)
                    if (q + u < k) SegVec<VEC>::load(src + from[u] * D + col, v[u]);
#pragma unroll
                for (int u = 0; u < U; ++u)
                    if (q + u < k)
#pragma unroll
                        for (int j = 0; j < VEC; ++j) acc[j] += seg_value(v[u][j], scaled, (float)k);
            }
            SegVec<VEC>::store(out + ((t0 + w) * 32 + row_lane[w][i]) * D + col, acc);
        }
        for (int w = 0; w < here; ++w) seg_zero_runs(tile_gaps[w], out + (t0 + w) * 32 * D, D);
        __syncthreads();   // the shared state is rewritten by the next tiles
    }
}

#define SEG_ONCE_KERNEL(VEC)                                                                             \
    extern "C" __global__ void __launch_bounds__(256, SEG_ONCE_BLOCKS)                                   \
    segsum_once##VEC(const float* __restrict__ src, const long long* __restrict__ perm,                  \
                     const long long* __restrict__ start, float* __restrict__ out, int D, long long skip,  \
                     int scaled, long long space, int per) {                                             \
        seg_once_body<VEC>(src, perm, start, out, D, skip, scaled, space, per);                          \
    }
SEG_ONCE_KERNEL(1)
SEG_ONCE_KERNEL(2)
SEG_ONCE_KERNEL(4)

// PREFIX_keys_<key>, PREFIX_starts_<key>, PREFIX_rows<VEC>[_tiles|_fill]_<key>, PREFIX_rows1_long_<key>,
// PREFIX_scalar_<key> for key types i16, i32, i64 (segsum_once<VEC> above is one per module).
#define SEG_SORTED_FOR(PREFIX, KEYNAME, KT)                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                                    \
    PREFIX##_keys_##KEYNAME(const long long* __restrict__ key, KT* __restrict__ out, long long total,    \
                            long long width, long long rows, long long offset, int trap) {               \
        seg_keys_body<KT>(key, out, total, width, rows, offset, trap ? #PREFIX : nullptr);               \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                                    \
    PREFIX##_starts_##KEYNAME(const KT* __restrict__ skey, long long n, long long space, long long offset, \
                              long long* __restrict__ start) {                                           \
        seg_starts_body<KT>(skey, n, space, offset, start);                                              \
    }                                                                                                    \
    SEG_ROWS_KERNEL(PREFIX, KEYNAME, KT, 1)                                                              \
    SEG_ROWS_KERNEL(PREFIX, KEYNAME, KT, 2)                                                              \
    SEG_ROWS_KERNEL(PREFIX, KEYNAME, KT, 4)                                                              \
    extern "C" __global__ void __launch_bounds__(256, SEG_LONG_BLOCKS)                                   \
    PREFIX##_rows1_long_##KEYNAME(SEG_SORTED_ARGS_T(KT)) {                                               \
        seg_rows_body<KT, 1, SEG_SPLIT_LONG>(SEG_ROWS_PASS);                                             \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) PREFIX##_scalar_##KEYNAME(SEG_SORTED_ARGS_T(KT)) { \
        seg_scalar_body<KT>(SEG_SORTED_PASS);                                                            \
    }

// ------------------------------------------------------------------------------------------------
// fixed: order-independent fixed-point sums

#define SEG_FLAG_NAN 1u
#define SEG_FLAG_POS_INF 2u
#define SEG_FLAG_NEG_INF 4u
#define SEG_ABS_INF 0x7f800000u  // |x|'s bits at or above this: Inf or NaN
#define SEG_FIXED_BATCH 4        // elements per thread loaded at once by segsum_fixed_add

// The shift s: 62 - c - E with max |src| < 2^E (E = biased exponent - 126; -126 for a subnormal
// maximum); 0 when every finite |src| is zero. s lies in [62 - 63 - 128, 62 + 126], so 2^s and 2^-s
// are normal doubles.
__device__ __forceinline__ int seg_fixed_shift(unsigned maxbits, int log2n) {
    if (maxbits == 0u) return 0;
    const int be = (int)(maxbits >> 23);
    return 62 - log2n - (be == 0 ? -126 : be - 126);
}

__device__ __forceinline__ double seg_pow2(int e) { return __longlong_as_double((long long)(1023 + e) << 52); }

// The largest of the block's m (finite |x| as float bits: a finite float's magnitude orders as its bits)
// into *maxbits: one atomicMax per block, an integer max, exact in any order. Called by every thread of a
// block of SEG_WARPS warps; warp_max: SEG_WARPS words of shared scratch.
__device__ __forceinline__ void seg_block_max_into(unsigned m, unsigned* warp_max, unsigned* maxbits) {
    m = __reduce_max_sync(SEG_FULL, m);
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < SEG_WARPS; ++w) m = max(m, warp_max[w]);
        if (m) atomicMax(maxbits, m);
    }
}

// A finite term v as the integer rint(v 2^s) (scale = 2^s; v * 2^s is exact in double), in two's
// complement.
__device__ __forceinline__ unsigned long long seg_fixed_q(float v, double scale) {
    return (unsigned long long)__double2ll_rn((double)v * scale);
}

// A non-finite term v of flat destination dst: its flag (NaN, +Inf, -Inf; four bits per element, eight
// elements per word) set in flags.
__device__ __forceinline__ void seg_fixed_flag(unsigned* flags, unsigned long long dst, float v) {
    const unsigned f = v != v ? SEG_FLAG_NAN : (v > 0.0f ? SEG_FLAG_POS_INF : SEG_FLAG_NEG_INF);
    atomicOr(flags + (dst >> 3), f << (4 * (int)(dst & 7)));
}

// The largest finite |x| over n words as float bits, of this thread's share of a grid-stride pass.
__device__ __forceinline__ unsigned seg_finite_max(const unsigned* __restrict__ x, long long n) {
    unsigned m = 0u;
    const long long step = (long long)gridDim.x * blockDim.x;
    const long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool aligned = (reinterpret_cast<size_t>(x) & 15u) == 0;
    const long long n4 = aligned ? n >> 2 : 0;
    for (long long i = i0; i < n4; i += step) {
        const uint4 w = reinterpret_cast<const uint4*>(x)[i];
        const unsigned a[4] = {w.x & 0x7fffffffu, w.y & 0x7fffffffu, w.z & 0x7fffffffu, w.w & 0x7fffffffu};
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (a[j] < SEG_ABS_INF) m = max(m, a[j]);
    }
    for (long long i = 4 * n4 + i0; i < n; i += step) {
        const unsigned a = x[i] & 0x7fffffffu;
        if (a < SEG_ABS_INF) m = max(m, a);
    }
    return m;
}

// The largest finite |x| over n words as float bits.
extern "C" __global__ void __launch_bounds__(256)
segsum_fixed_max(const unsigned* __restrict__ x, long long n, unsigned* __restrict__ maxbits) {
    __shared__ unsigned warp_max[SEG_WARPS];
    seg_block_max_into(seg_finite_max(x, n), warp_max, maxbits);
}

// Contributions as seg_atomic_body's (seg_contribution); each finite term rounded to an integer multiple of 2^-s and
// added into acc (int64, two's complement through unsigned atomicAdd: the same bits as a signed add).
template <typename I>
__device__ __forceinline__ void seg_fixed_add_body(const float* __restrict__ src, const long long* __restrict__ key,
                                                   unsigned long long* __restrict__ acc, unsigned* __restrict__ flags,
                                                   I total, int D, int elementwise, long long skip,
                                                   const long long* __restrict__ counts, long long rows,
                                                   const unsigned* __restrict__ maxbits, int log2n,
                                                   const unsigned* __restrict__ rep, const char* trap) {
    const double scale = seg_pow2(seg_fixed_shift(*maxbits, log2n));
    const I step = (I)gridDim.x * blockDim.x;
    // A thread's elements e, e + step, ... share their column whenever step is a multiple of D, so a hot
    // destination recurs: the thread holds one destination's running sum and adds it once. It replaces
    // a held destination met only once (a cold one) by the next; a destination met twice stays held.
    // Integer sums, so how the terms are grouped changes nothing.
    // Elements are taken SEG_FIXED_BATCH at a time: their keys and values loaded before any is added
    // (independent loads in flight; one at a time, the loop waited on every load).
    long long held = -1;
    unsigned long long part = 0ull;
    int seen = 0;
    for (I e0 = (I)blockIdx.x * blockDim.x + threadIdx.x; e0 < total; e0 += SEG_FIXED_BATCH * step) {
        long long mb[SEG_FIXED_BATCH];
        float vb[SEG_FIXED_BATCH];
#pragma unroll
        for (int b = 0; b < SEG_FIXED_BATCH; ++b)
            if (e0 + b * step < total) seg_load(src, key, e0 + b * step, D, elementwise, mb[b], vb[b]);
#pragma unroll
        for (int b = 0; b < SEG_FIXED_BATCH; ++b) {
            const I e = e0 + b * step;
            if (e >= total) break;
            float v = vb[b];
            long long dst = seg_resolve(e, D, mb[b], skip, counts, rows, trap, v);
            if (dst < 0) continue;
            if (rep != nullptr) dst += ((long long)rep[mb[b]] - 1 - mb[b]) * D;  // compact: the representative's row
            if ((__float_as_uint(v) & 0x7fffffffu) < SEG_ABS_INF) {
                const unsigned long long q = seg_fixed_q(v, scale);
                if (dst == held) {
                    part += q;
                    ++seen;
                } else if (seen <= 1) {
                    if (part != 0ull) atomicAdd(acc + held, part);  // exact: the order cannot matter
                    held = dst;
                    part = q;
                    seen = 1;
                } else if (q != 0ull) {
                    atomicAdd(acc + dst, q);
                }
            } else {
                seg_fixed_flag(flags, (unsigned long long)dst, v);
            }
        }
    }
    if (part != 0ull) atomicAdd(acc + held, part);
}

#define SEG_FIXED_ADD_KERNEL(NAME, OPNAME)                                                               \
    extern "C" __global__ void __launch_bounds__(256)                                                    \
    NAME(const float* __restrict__ src, const long long* __restrict__ key, unsigned long long* __restrict__ acc, \
         unsigned* __restrict__ flags, long long total, int D, int elementwise, long long skip,           \
         const long long* __restrict__ counts, long long rows, const unsigned* __restrict__ maxbits,      \
         int log2n, const unsigned* __restrict__ rep, int trap) {                                        \
        const char* op = trap ? OPNAME : nullptr;                                                        \
        if (total + (long long)SEG_FIXED_BATCH * gridDim.x * blockDim.x <= 2147483647LL)                 \
            seg_fixed_add_body<int>(src, key, acc, flags, (int)total, D, elementwise, skip, counts, rows, \
                                    maxbits, log2n, rep, op);                                            \
        else                                                                                             \
            seg_fixed_add_body<long long>(src, key, acc, flags, total, D, elementwise, skip, counts, rows, \
                                          maxbits, log2n, rep, op);                                      \
    }

__device__ __forceinline__ float seg_fixed_value(long long a, unsigned f, double unscale) {
    if (f == 0u) return __double2float_rn((double)__ll2float_rn(a) * unscale);
    if ((f & SEG_FLAG_NAN) || f == (SEG_FLAG_POS_INF | SEG_FLAG_NEG_INF)) return __int_as_float(0x7fc00000);
    return __int_as_float(f == SEG_FLAG_POS_INF ? 0x7f800000 : (int)0xff800000u);
}

// out[j] = float32(acc[j] * 2^-s), or the flagged non-finite value. A thread per 8 elements: one flag
// word, four 16-byte loads, two 16-byte stores (the buffers come from torch's allocator: 16-byte
// aligned, and acc's 8-element groups start at multiples of 64 bytes).
extern "C" __global__ void __launch_bounds__(256)
segsum_fixed_out(const long long* __restrict__ acc, const unsigned* __restrict__ flags, float* __restrict__ out,
                 long long n, const unsigned* __restrict__ maxbits, int log2n) {
    const double unscale = seg_pow2(-seg_fixed_shift(*maxbits, log2n));
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g * 8 < n; g += step) {
        const unsigned f = flags[g];
        const long long j0 = g * 8;
        if (j0 + 8 <= n) {
            const longlong2* a2 = reinterpret_cast<const longlong2*>(acc + j0);
            float r[8];
#pragma unroll
            for (int h = 0; h < 4; ++h) {
                const longlong2 a = a2[h];
                r[2 * h] = seg_fixed_value(a.x, (f >> (8 * h)) & 7u, unscale);
                r[2 * h + 1] = seg_fixed_value(a.y, (f >> (8 * h + 4)) & 7u, unscale);
            }
            float4* o4 = reinterpret_cast<float4*>(out + j0);
            o4[0] = make_float4(r[0], r[1], r[2], r[3]);
            o4[1] = make_float4(r[4], r[5], r[6], r[7]);
        } else {
            for (long long j = j0; j < n; ++j) out[j] = seg_fixed_value(acc[j], (f >> (4 * (int)(j - j0))) & 7u, unscale);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// fixed, compact schedule (row form): the same integers, summed into one accumulator row per source row
// instead of one per destination, for fewer source rows N than destinations
//
// Each destination m that a source row names gets a representative, the last such row: rep[m] = i + 1,
// an integer max, so the same whatever the order of arrival (0: none). segsum_fixed_add, given rep, adds
// the terms of row i into accumulator row rep[key[i]] - 1 (the integers of the direct schedule: their
// sum does not depend on which row holds it). segsum_fixed_rows_out rounds each representative's row
// into its destination's floats as segsum_fixed_out does; every other destination keeps the +0.0 of
// a zero fill queued on a second stream beside these kernels (kernels/index_add.py). Same shift,
// integers and rounding as the direct schedule: the same bits. The accumulators take 8 N D bytes
// (the direct schedule's 8 x the output's rows x D) and the last pass reads only the representatives'.

// +0 in the `zero16` 16-byte words at acc (the accumulators and their flags: plain stores, which keep them
// in L2 for segsum_fixed_add), segsum_fixed_max's pass over the total words of src and, over the n keys
// (grid-stride), the rows' representatives; keys outside [0, rows) and the skip row get none (they add
// nothing; segsum_fixed_add fails the kernel on a bad key where the caller asks it to).
extern "C" __global__ void __launch_bounds__(256)
segsum_fixed_prep(const unsigned* __restrict__ x, long long total, const long long* __restrict__ key, long long n,
                  long long rows, long long skip, unsigned* __restrict__ rep, unsigned* __restrict__ maxbits,
                  uint4* __restrict__ acc, long long zero16) {
    __shared__ unsigned warp_max[SEG_WARPS];
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < zero16; i += step)
        acc[i] = make_uint4(0u, 0u, 0u, 0u);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const long long m = key[i];
        if (m >= 0 && m < rows && m != skip) atomicMax(rep + m, (unsigned)(i + 1));
    }
    seg_block_max_into(seg_finite_max(x, total), warp_max, maxbits);
}

// out[key[i], :] from accumulator row i (N x D elements, flags alike) where i is its destination's
// representative, VEC elements a thread (4 where D is a multiple of 4: 16-byte stores, two 16-byte loads;
// a group of 4 starts at a multiple of 4, so its flags are 16 bits of one word). Other rows write nothing.
template <int VEC>
__device__ __forceinline__ void seg_fixed_rows_out_body(const long long* __restrict__ acc,
                                                        const unsigned* __restrict__ flags,
                                                        const long long* __restrict__ key,
                                                        const unsigned* __restrict__ rep, float* __restrict__ out,
                                                        long long n, int D, long long rows, double unscale) {
    const long long step = (long long)gridDim.x * blockDim.x;
    const long long groups = n * D / VEC;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += step) {
        const long long e = g * VEC, i = e / D, c = e - i * D;
        const long long m = key[i];
        if (m < 0 || m >= rows || rep[m] != (unsigned)(i + 1)) continue;   // the skip row has no representative
        const unsigned f = flags[e >> 3] >> (4 * (int)(e & 7));
        float* o = out + m * D + c;
        if (VEC == 4) {
            const longlong2 a = reinterpret_cast<const longlong2*>(acc + e)[0];
            const longlong2 b = reinterpret_cast<const longlong2*>(acc + e)[1];
            *reinterpret_cast<float4*>(o) = make_float4(
                seg_fixed_value(a.x, f & 7u, unscale), seg_fixed_value(a.y, (f >> 4) & 7u, unscale),
                seg_fixed_value(b.x, (f >> 8) & 7u, unscale), seg_fixed_value(b.y, (f >> 12) & 7u, unscale));
        } else {
            *o = seg_fixed_value(acc[e], f & 7u, unscale);
        }
    }
}

#define SEG_FIXED_ROWS_OUT(VEC)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                                            \
    segsum_fixed_rows_out##VEC(const long long* __restrict__ acc, const unsigned* __restrict__ flags,            \
                               const long long* __restrict__ key, const unsigned* __restrict__ rep,              \
                               float* __restrict__ out, long long n, int D, long long rows,                       \
                               const unsigned* __restrict__ maxbits, int log2n) {                                \
        seg_fixed_rows_out_body<VEC>(acc, flags, key, rep, out, n, D, rows,                                      \
                                     seg_pow2(-seg_fixed_shift(*maxbits, log2n)));                               \
    }
SEG_FIXED_ROWS_OUT(1)
SEG_FIXED_ROWS_OUT(4)

// ------------------------------------------------------------------------------------------------
// fixed, binned schedule (element form): the same integers, summed in shared memory
//
// segsum_fixed_add makes one global int64 atomic per term; where the terms far outnumber the
// destinations those atomics bound it (L2's atomic units, not the bandwidth). The binned schedule adds
// the same integers q = rint(v 2^s) (same shift, same flags), so it gives the same bits: integer sums
// are exact, neither their order nor their grouping can change them. The destinations are cut into
// nb <= SEG_FBIN_MAX bins of BW = 2^bb consecutive ones, and a bin's terms are kept in pages of
// SEG_FBIN_PAGE entries (destination, float bits), taken from one pool as the bin fills, so no pass
// has to count the bins first. Two launches between the zero fill and segsum_fixed_out:
//   place   block t takes a tile of SEG_FBIN_TILE elements: each valid term ranked among the tile's
//           terms of its bin (the lanes of one bin found by ballots, seg_same_bits, their lowest lane
//           adding their number in shared memory), then one global atomicAdd per (tile, bin) on the
//           bin's cursor reserves that many consecutive positions of the bin. Position p lies on the
//           bin's page p / PAGE; the block whose range holds a page's first position takes the next
//           page of the pool for it (atomicAdd on the pool counter) and publishes it (page_of, +1;
//           0 = not yet), right after its reservation and before it waits for anything, so a block
//           waiting for a page published by another always sees it come. The tile is staged in shared
//           memory grouped by bin and written in runs. Where a term lands varies from run to run;
//           nothing downstream depends on it. A bad index fails the kernel here under `trap`, and adds
//           nothing otherwise. Also max |src| over every finite element (atomicMax), as
//           segsum_fixed_max takes it (bad indices' elements included).
//   reduce  block k takes pool page k (its bin and place in the bin recorded when it was taken; the
//           bin's cursor, final now, says how full it is): a shared accumulator per destination of the
//           bin zeroed (four 16-bit limbs, see the kernel), each finite term's q added with shared
//           atomics (a non-finite one sets its flag), and the nonzero sums added into acc with one global
//           atomic each: at most BW per page of SEG_FBIN_PAGE terms, where the direct schedule makes one
//           per term.
#define SEG_FBIN_BITS 9                     // bins at most 2^9 (seg_same_bits takes up to 9 bits)
#define SEG_FBIN_MAX (1 << SEG_FBIN_BITS)
#define SEG_FBIN_THREADS 256
#define SEG_FBIN_ITEMS 8                    // terms per thread of a place tile
#define SEG_FBIN_TILE (SEG_FBIN_ITEMS * SEG_FBIN_THREADS)
#define SEG_FBIN_PAGE_BITS 14
#define SEG_FBIN_PAGE (1 << SEG_FBIN_PAGE_BITS)  // entries per page: a tile's run of a bin spans <= 2 pages
#define SEG_FBIN_REDUCE_THREADS 512         // three blocks an SM (64 KB of limbs each)
#define SEG_FBIN_LOADS 8                    // entries per thread in flight in reduce
#define SEG_FBIN_PLACE_BLOCKS 5             // place blocks per SM: at most 51 registers a thread
static_assert(SEG_FBIN_THREADS == SEG_RSORT_THREADS, "the bins' prefix is seg_rsort_prefix2's");
static_assert(SEG_FBIN_MAX <= 2 * SEG_FBIN_THREADS, "two bins per thread in the prefix");
static_assert(SEG_FBIN_BITS <= SEG_RSORT_BITS, "seg_same_bits tells apart at most SEG_RSORT_BITS bits");
static_assert(SEG_FBIN_TILE <= SEG_FBIN_PAGE, "a tile's terms of one bin meet at most two pages");

// The lanes of this lane's bin among the lanes holding a valid destination d (d >= 0), or 0 for d < 0.
__device__ __forceinline__ unsigned seg_fbin_peers(int d, int bb, int nbits) {
    const unsigned live = __ballot_sync(SEG_FULL, d >= 0);
    const unsigned peers = seg_same_bits(d >= 0 ? (unsigned)(d >> bb) : 0u, nbits) & live;
    return d >= 0 ? peers : 0u;
}

// A pool page's number + 1 once published (page_of's word). The read is volatile: a side effect, so the
// loop stays a loop (a plain or cache-hinted load that nothing in this thread changes may be taken once,
// the compiler assuming the loop ends, and a page not yet published read as page 0 - 1).
__device__ __forceinline__ unsigned seg_fbin_await(const unsigned* word) {
    unsigned i;
    while ((i = *reinterpret_cast<const volatile unsigned*>(word)) == 0u) __nanosleep(32);
    return i;
}

// Place: see above. page_of[b * ppb + k] = 1 + the pool page holding positions [k PAGE, k PAGE + PAGE) of
// bin b; page_bin[i], page_idx[i]: the bin and k of pool page i. The launcher keeps every element number
// and destination inside an int.
__device__ __forceinline__ void seg_fbin_place_body(const float* __restrict__ src, const long long* __restrict__ key,
                                                    int total, int W, long long rows, int bb, int nb, int nbits,
                                                    unsigned* __restrict__ cursor, unsigned* __restrict__ pool,
                                                    unsigned* page_of, int ppb, unsigned* __restrict__ page_bin,
                                                    unsigned* __restrict__ page_idx, uint2* __restrict__ entries,
                                                    unsigned* __restrict__ maxbits, const char* trap) {
    __shared__ uint2 stage[SEG_FBIN_TILE];
    __shared__ unsigned tile_count[SEG_FBIN_MAX];  // this tile's terms per bin, then their first stage slot
    __shared__ unsigned pos[SEG_FBIN_MAX];         // the bin position of the bin's first staged term
    __shared__ unsigned page[2 * SEG_FBIN_MAX];    // the pool pages of the bin's run (the second if it crosses)
    __shared__ unsigned wsum[SEG_WARPS];
    __shared__ unsigned warp_max[SEG_WARPS];
    __shared__ unsigned staged;
    const int lane = threadIdx.x & 31;
    const int e0 = blockIdx.x * SEG_FBIN_TILE + threadIdx.x;
    for (int b = threadIdx.x; b < nb; b += SEG_FBIN_THREADS) tile_count[b] = 0u;
    long long m[SEG_FBIN_ITEMS];
    float v[SEG_FBIN_ITEMS];
#pragma unroll
    for (int r = 0; r < SEG_FBIN_ITEMS; ++r) {
        const int e = e0 + r * SEG_FBIN_THREADS;
        m[r] = e < total ? key[e] : 0;
        v[r] = e < total ? src[e] : 0.0f;
    }
    __syncthreads();
    int d[SEG_FBIN_ITEMS];
    unsigned rank[SEG_FBIN_ITEMS], mx = 0u;
    const int step = SEG_FBIN_THREADS % W;  // the column e mod W, advanced without a division per element
    int col = e0 % W;
#pragma unroll
    for (int r = 0; r < SEG_FBIN_ITEMS; ++r) {
        const bool in = e0 + r * SEG_FBIN_THREADS < total;
        d[r] = -1;
        if (in && m[r] >= 0 && m[r] < rows) d[r] = (int)m[r] * W + col;
        else if (in && trap != nullptr) seg_bad_index(trap, m[r], rows);
        col += step;
        col -= col >= W ? W : 0;
        const unsigned peers = seg_fbin_peers(d[r], bb, nbits);  // rank among the tile's terms of the bin
        const int leader = peers ? __ffs(peers) - 1 : lane;
        unsigned first = 0u;
        if (d[r] >= 0 && lane == leader) first = atomicAdd(tile_count + (d[r] >> bb), (unsigned)__popc(peers));
        rank[r] = __shfl_sync(SEG_FULL, first, leader) + __popc(peers & ((1u << lane) - 1u));
        const unsigned a = __float_as_uint(v[r]) & 0x7fffffffu;
        if (in && a < SEG_ABS_INF) mx = max(mx, a);
    }
    __syncthreads();
    const int b0 = 2 * threadIdx.x;
    {  // the bins' stage slots (an exclusive prefix, two bins per thread), reservations and new pages
        const unsigned a = b0 < nb ? tile_count[b0] : 0u, c = b0 + 1 < nb ? tile_count[b0 + 1] : 0u;
        const unsigned excl = seg_rsort_prefix2(a, c, wsum);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned cnt = h ? c : a;
            if (cnt == 0u) continue;
            const int b = b0 + h;
            const unsigned p = atomicAdd(cursor + b, cnt);
            pos[b] = p;
            const unsigned k0 = (p + SEG_FBIN_PAGE - 1) >> SEG_FBIN_PAGE_BITS;
            for (unsigned k = k0; (k << SEG_FBIN_PAGE_BITS) < p + cnt; ++k) {  // positions k PAGE held here
                const unsigned i = atomicAdd(pool, 1u);
                page_bin[i] = (unsigned)b;
                page_idx[i] = k;
                atomicExch(page_of + (long long)b * ppb + k, i + 1u);
            }
        }
        if (b0 < nb) tile_count[b0] = excl;
        if (b0 + 1 < nb) tile_count[b0 + 1] = excl + a;
        if (threadIdx.x == SEG_FBIN_THREADS - 1) staged = excl + a + c;
    }
    __syncthreads();
    // the pool pages of each bin's run: published by this block, or by the one holding the page's first
    // position, which reserved before this block did and publishes without waiting: it comes
    for (int b = threadIdx.x; b < nb; b += SEG_FBIN_THREADS) {
        const unsigned cnt = (b + 1 < nb ? tile_count[b + 1] : staged) - tile_count[b];
        if (cnt == 0u) continue;
        const unsigned k0 = pos[b] >> SEG_FBIN_PAGE_BITS, k1 = (pos[b] + cnt - 1) >> SEG_FBIN_PAGE_BITS;
        const unsigned* slot = page_of + (long long)b * ppb;
        page[2 * b] = seg_fbin_await(slot + k0) - 1u;
        page[2 * b + 1] = k1 != k0 ? seg_fbin_await(slot + k1) - 1u : 0u;
    }
#pragma unroll
    for (int r = 0; r < SEG_FBIN_ITEMS; ++r)
        if (d[r] >= 0) stage[tile_count[d[r] >> bb] + rank[r]] = make_uint2((unsigned)d[r], __float_as_uint(v[r]));
    __syncthreads();
    for (unsigned j = threadIdx.x; j < staged; j += SEG_FBIN_THREADS) {  // a bin's run: consecutive positions
        const uint2 x = stage[j];
        const unsigned b = x.x >> bb, p = pos[b] + (j - tile_count[b]);
        const unsigned pg = page[2 * b + ((p >> SEG_FBIN_PAGE_BITS) != (pos[b] >> SEG_FBIN_PAGE_BITS))];
        entries[((size_t)pg << SEG_FBIN_PAGE_BITS) + (p & (SEG_FBIN_PAGE - 1))] = x;
    }
    seg_block_max_into(mx, warp_max, maxbits);
}

#define SEG_FBIN_PLACE_KERNEL(NAME, OPNAME)                                                              \
    extern "C" __global__ void __launch_bounds__(SEG_FBIN_THREADS, SEG_FBIN_PLACE_BLOCKS)                \
    NAME(const float* __restrict__ src, const long long* __restrict__ key, int total, int W, long long rows, \
         int bb, int nb, int nbits, unsigned* __restrict__ cursor, unsigned* __restrict__ pool,          \
         unsigned* page_of, int ppb, unsigned* __restrict__ page_bin, unsigned* __restrict__ page_idx,    \
         uint2* __restrict__ entries, unsigned* __restrict__ maxbits, int trap) {                        \
        seg_fbin_place_body(src, key, total, W, rows, bb, nb, nbits, cursor, pool, page_of, ppb, page_bin, \
                            page_idx, entries, maxbits, trap ? OPNAME : nullptr);                        \
    }

// Reduce: see above. The accumulators are four 16-bit limbs per destination, each summed with native
// 32-bit shared atomics: a 64-bit shared atomicAdd is a compare-and-swap loop on these GPUs, and a page's
// at most 2^14 terms keep each limb's sum below 2^30. Bits: sum over the terms of u = (unsigned) q =
// sum over limbs k of (sum of u's limb k) 2^(16 k), modulo 2^64, which is the int64 sum's two's
// complement. Dynamic shared memory: 4 limbs x BW words (64 KB for the launcher's bins of 4096).
static_assert(SEG_FBIN_PAGE_BITS + 16 <= 31, "a page's limb sums fit 32 bits");
extern "C" __global__ void __launch_bounds__(SEG_FBIN_REDUCE_THREADS)
segsum_fbin_reduce(const uint2* __restrict__ entries, const unsigned* __restrict__ pool,
                   const unsigned* __restrict__ page_bin, const unsigned* __restrict__ page_idx,
                   const unsigned* __restrict__ cursor, int bb, unsigned long long* __restrict__ acc,
                   unsigned* __restrict__ flags, const unsigned* __restrict__ maxbits, int log2n) {
    extern __shared__ unsigned limb[];  // limb[k * BW + j]: limb k of destination j's sum
    constexpr unsigned T = SEG_FBIN_REDUCE_THREADS;
    if (blockIdx.x >= *pool) return;
    const unsigned bin = page_bin[blockIdx.x];
    const unsigned first = page_idx[blockIdx.x] << SEG_FBIN_PAGE_BITS;
    const unsigned n = min((unsigned)SEG_FBIN_PAGE, cursor[bin] - first);  // the bin's last page: partly full
    const uint2* page = entries + ((size_t)blockIdx.x << SEG_FBIN_PAGE_BITS);
    const double scale = seg_pow2(seg_fixed_shift(*maxbits, log2n));
    const int width = 1 << bb;
    for (int j = threadIdx.x; j < 4 * width; j += T) limb[j] = 0u;
    __syncthreads();
    for (unsigned p = threadIdx.x; p < n; p += SEG_FBIN_LOADS * T) {
        uint2 x[SEG_FBIN_LOADS];
#pragma unroll
        for (int u = 0; u < SEG_FBIN_LOADS; ++u) x[u] = p + u * T < n ? page[p + u * T] : make_uint2(0u, 0u);
#pragma unroll
        for (int u = 0; u < SEG_FBIN_LOADS; ++u) {
            if (p + u * T >= n) break;
            const float v = __uint_as_float(x[u].y);
            if ((x[u].y & 0x7fffffffu) < SEG_ABS_INF) {
                const unsigned long long q = seg_fixed_q(v, scale);
                if (q != 0ull) {
                    unsigned* l = limb + (x[u].x & (unsigned)(width - 1));
                    const unsigned lo = (unsigned)q, hi = (unsigned)(q >> 32);
                    atomicAdd(l, lo & 0xffffu);  // integer limbs: exact in any order
                    atomicAdd(l + width, lo >> 16);
                    atomicAdd(l + 2 * width, hi & 0xffffu);
                    atomicAdd(l + 3 * width, hi >> 16);
                }
            } else {
                seg_fixed_flag(flags, x[u].x, v);
            }
        }
    }
    __syncthreads();
    unsigned long long* out = acc + (long long)bin * width;
    for (int j = threadIdx.x; j < width; j += T) {
        const unsigned long long sum = (unsigned long long)limb[j] + ((unsigned long long)limb[width + j] << 16) +
                                       ((unsigned long long)limb[2 * width + j] << 32) +
                                       ((unsigned long long)limb[3 * width + j] << 48);
        if (sum != 0ull) atomicAdd(out + j, sum);
    }
}

#define SEG_KERNELS(PREFIX)                        \
    SEG_ATOMIC_KERNEL(PREFIX##_atomic, #PREFIX)    \
    SEG_SORT_KERNEL(PREFIX)                        \
    SEG_MSORT_FOR(PREFIX, i16, short, unsigned, 16) \
    SEG_MSORT_FOR(PREFIX, i32, int, unsigned long long, 32) \
    SEG_RANK_FOR(PREFIX, i16, short, unsigned, 16) \
    SEG_RANK_FOR(PREFIX, i32, int, unsigned long long, 32) \
    SEG_RSORT_KERNELS(PREFIX)                      \
    SEG_FIXED_ADD_KERNEL(PREFIX##_fixed_add, #PREFIX) \
    SEG_FBIN_PLACE_KERNEL(PREFIX##_fbin_place, #PREFIX) \
    SEG_SORTED_FOR(PREFIX, i16, short)             \
    SEG_SORTED_FOR(PREFIX, i32, int)               \
    SEG_SORTED_FOR(PREFIX, i64, long long)
