// segsum.cuh: scatter-style sums, out[key] += value, shared by index_add.cu, scatter_add.cu and
// embedding_bwd.cu. Launchers and CPU order models: kernels/index_add.py.
//
// A launch sums n contributions into rows of D floats. Contribution e has a destination row key[e] and
// D values: row e of src (row form: index_add, embedding_bwd), or element e of src with D = 1 (element
// form: scatter_add with a full index). Optionally (embedding_bwd) a row `skip` gets nothing, and each
// value is divided by its destination's count (scale_grad_by_freq): v / (float)count, IEEE division
// (NVRTC default), so no multiply-add can fuse it with the sum.
//
//   atomic  one thread per (contribution, column): atomicAdd into the zeroed output. NONDETERMINISTIC:
//           a row with >= 3 contributions is summed in arrival order. Float atomicAdd flushes subnormal
//           operands and results to sign-preserving zero (PTX atom.add.f32).
//   sorted  the launcher sorts the keys stably (torch.sort(stable=True): a radix sort, deterministic),
//           so each row's contributions lie together in source order; segsum_starts finds where each
//           row begins. A row of k contributions is cut into chunks of L = 32 * 2^e (smallest e with
//           ceil(k / L) <= 1024) consecutive contributions, each summed in source order from +0.0 by one
//           warp (lane = columns) or one thread (segsum_sorted_scalar). One chunk: that is the row.
//           More: the chunk partials are combined by a fixed 32-ary tree, each node a halving tree over
//           32 consecutive children (missing ones +0.0, exact because a sum from +0.0 is never -0.0):
//           the last chunk of a group of 32 to finish (ticket counter) builds the node, the last node of
//           the row builds the root. Which warp finishes last varies; the tree does not: DETERMINISTIC,
//           and a row's bits depend only on its own contributions in source order. Ordinary additions:
//           subnormals kept (no -ftz), as the CPU model keeps them.
// No float kernel arguments; ints are 64-bit where they can exceed 2^31.
#pragma once

#define SEG_FULL 0xffffffffu
#define SEG_CHUNK_MIN 32
#define SEG_MAX_CHUNKS 1024
#define SEG_FAN 32

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

// Row form: e = i * D + d, value src[e] into out[key[i] * D + d]. Element form (scatter_add, D = the
// rows' width): e is the contribution, value src[e] into out[key[e] * D + e % D].
template <typename I>
__device__ __forceinline__ void seg_atomic_body(const float* __restrict__ src, const long long* __restrict__ key,
                                                float* __restrict__ out, I total, int D, int elementwise,
                                                long long skip, const long long* __restrict__ counts) {
    const I step = (I)gridDim.x * blockDim.x;
    for (I e = (I)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += step) {
        const I i = elementwise ? e : e / D;
        const I d = e - (e / D) * D;
        const long long m = key[i];
        if (m == skip) continue;
        float v = src[e];
        if (counts != nullptr) v = __fdiv_rn(v, (float)counts[m]);
        atomicAdd(out + m * D + d, v);  // arrival order decides the rounding where rows collide
    }
}

#define SEG_ATOMIC_KERNEL(NAME)                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                                    \
    NAME(const float* __restrict__ src, const long long* __restrict__ key, float* __restrict__ out,      \
         long long total, int D, int elementwise, long long skip, const long long* __restrict__ counts) { \
        if (total + (long long)gridDim.x * blockDim.x <= 2147483647LL)                                   \
            seg_atomic_body<int>(src, key, out, (int)total, D, elementwise, skip, counts);               \
        else                                                                                             \
            seg_atomic_body<long long>(src, key, out, total, D, elementwise, skip, counts);              \
    }

// ------------------------------------------------------------------------------------------------
// sorted: row starts

// start[m] = first sorted position with key >= m, for m = 0 .. M (start[M] = n).
template <typename K>
__device__ __forceinline__ void seg_starts_body(const K* __restrict__ skey, long long n, long long M,
                                                long long* __restrict__ start) {
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long m = (long long)blockIdx.x * blockDim.x + threadIdx.x; m <= M; m += step) {
        long long lo = 0, hi = n;
        while (lo < hi) {
            const long long mid = (lo + hi) >> 1;
            if ((long long)skey[mid] < m) lo = mid + 1;
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

// After chunk c of a row (nc >= 2 chunks, first slot `base`) has written its partials to part1: the
// group's last chunk builds the group's node (to out when it is the root, else to part2), the row's
// last node builds the root. `cols` columns [col0, col0 + ncols) of this thread, `stride` apart.
// Called by every lane of a warp (team = 32) or by one thread (team = 1); lanes agree on everything
// but their columns.
template <int TEAM>
__device__ __forceinline__ void seg_combine(float* __restrict__ out, float* part1, float* part2,
                                            unsigned* cnt1, unsigned* cnt2, long long m, long long base,
                                            long long c, long long nc, int D, int col0, int colstep) {
    const int lane = TEAM == 32 ? (threadIdx.x & 31) : 0;
    const long long g = c / SEG_FAN;
    const int in_group = (int)min((long long)SEG_FAN, nc - g * SEG_FAN);
    __threadfence();  // this chunk's partials are visible before its ticket
    if (TEAM == 32) __syncwarp();
    unsigned last = 0;
    if (lane == 0) {
        last = atomicAdd(cnt1 + base + g, 1u) == (unsigned)(in_group - 1);
        if (last) cnt1[base + g] = 0u;  // every chunk of the group has drawn: reset for the next launch
    }
    if (TEAM == 32) last = __shfl_sync(SEG_FULL, last, 0);
    if (!last) return;
    __threadfence();
    const long long groups = (nc + SEG_FAN - 1) / SEG_FAN;
    for (int col = col0; col < D; col += colstep) {
        const float q = seg_node(part1 + (base + g * SEG_FAN) * D + col, in_group, D);
        if (groups == 1) out[m * D + col] = q;
        else part2[(base + g) * D + col] = q;
    }
    if (groups == 1) return;
    __threadfence();
    if (TEAM == 32) __syncwarp();
    last = 0;
    if (lane == 0) {
        last = atomicAdd(cnt2 + base, 1u) == (unsigned)(groups - 1);
        if (last) cnt2[base] = 0u;
    }
    if (TEAM == 32) last = __shfl_sync(SEG_FULL, last, 0);
    if (!last) return;
    __threadfence();
    for (int col = col0; col < D; col += colstep)
        out[m * D + col] = seg_node(part2 + base * D + col, (int)groups, D);
}

// ------------------------------------------------------------------------------------------------
// sorted: one warp per tile of 32 sorted positions (row form, D >= 4)

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

// Each warp owns a tile of 32 sorted positions and sums every chunk that starts in it (a chunk may run
// on into later tiles), its heads in position order. Lane l holds columns col0 + l * VEC .. + VEC - 1
// of each slice of 32 * VEC columns; the chunk's contributions are added one at a time in source
// order, 8 loads in flight.
template <typename K, int VEC>
__device__ __forceinline__ void seg_rows_body(const float* __restrict__ src, const K* __restrict__ skey,
                                              const long long* __restrict__ perm,
                                              const long long* __restrict__ start, float* __restrict__ out,
                                              float* part1, float* part2, unsigned* cnt1, unsigned* cnt2,
                                              long long n, int D, long long skip, int scaled) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    const long long tiles = (n + 31) >> 5;
    for (long long tile = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); tile < tiles;
         tile += warps) {
        const long long p = tile * 32 + lane;
        long long m = -1, s = 0, k = 0, L = 1;
        bool head = false;
        if (p < n) {
            m = (long long)skey[p];
            s = start[m];
            k = start[m + 1] - s;
            L = seg_chunk_len(k);
            head = ((p - s) & (L - 1)) == 0 && m != skip;
        }
        unsigned heads = __ballot_sync(SEG_FULL, head);
        while (heads) {
            const int h = __ffs(heads) - 1;
            heads &= heads - 1;
            const long long hm = __shfl_sync(SEG_FULL, m, h), hs = __shfl_sync(SEG_FULL, s, h);
            const long long hk = __shfl_sync(SEG_FULL, k, h), hL = __shfl_sync(SEG_FULL, L, h);
            const long long hp = tile * 32 + h;
            const long long c = (hp - hs) / hL;
            const int len = (int)min(hL, hk - (hp - hs));
            const long long nc = (hk + hL - 1) / hL;
            const float count = (float)hk;
            const long long base = seg_slot(hs);
            for (int col0 = 0; col0 < D; col0 += 32 * VEC) {
                const int col = col0 + lane * VEC;
                const bool active = col < D;  // D is a multiple of VEC
                float acc[VEC];
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
                for (int q0 = 0; q0 < len; q0 += 32) {
                    const int nb = min(32, len - q0);
                    const long long mine = lane < nb ? perm[hp + q0 + lane] : 0;
                    int t = 0;
                    for (; t + 8 <= nb; t += 8) {
                        float v[8][VEC];
#pragma unroll
                        for (int u = 0; u < 8; ++u) {
                            const long long row = __shfl_sync(SEG_FULL, mine, t + u);
                            if (active) SegVec<VEC>::load(src + row * D + col, v[u]);
                        }
#pragma unroll
                        for (int u = 0; u < 8; ++u)
#pragma unroll
                            for (int j = 0; j < VEC; ++j) acc[j] += seg_value(v[u][j], scaled, count);
                    }
                    for (; t < nb; ++t) {
                        const long long row = __shfl_sync(SEG_FULL, mine, t);
                        float v[VEC];
                        if (active) {
                            SegVec<VEC>::load(src + row * D + col, v);
#pragma unroll
                            for (int j = 0; j < VEC; ++j) acc[j] += seg_value(v[j], scaled, count);
                        }
                    }
                }
                if (active) {
                    if (nc == 1) SegVec<VEC>::store(out + hm * D + col, acc);
                    else SegVec<VEC>::store(part1 + (base + c) * D + col, acc);
                }
            }
            if (nc > 1) seg_combine<32>(out, part1, part2, cnt1, cnt2, hm, base, c, nc, D, lane, 32);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// sorted: one thread per sorted position (element form, and row form with D < 4)

// Thread p sums the chunk that starts at p, if one does, column by column: perm[q] * D + d is the
// value of contribution q in column d (element form: D = 1, perm[q] is the flat src element).
template <typename K>
__device__ __forceinline__ void seg_scalar_body(const float* __restrict__ src, const K* __restrict__ skey,
                                                const long long* __restrict__ perm,
                                                const long long* __restrict__ start, float* __restrict__ out,
                                                float* part1, float* part2, unsigned* cnt1, unsigned* cnt2,
                                                long long n, int D, long long skip, int scaled) {
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < n; p += step) {
        const long long m = (long long)skey[p];
        if (m == skip) continue;
        const long long s = start[m], k = start[m + 1] - s, L = seg_chunk_len(k);
        if (((p - s) & (L - 1)) != 0) continue;
        const long long c = (p - s) / L, end = p + min(L, k - (p - s)), nc = (k + L - 1) / L;
        const long long base = seg_slot(s);
        const float count = (float)k;
        for (int d = 0; d < D; ++d) {
            float acc = 0.0f;
            long long q = p;
            for (; q + 4 <= end; q += 4) {
                const long long r0 = perm[q], r1 = perm[q + 1], r2 = perm[q + 2], r3 = perm[q + 3];
                const float v0 = src[r0 * D + d], v1 = src[r1 * D + d], v2 = src[r2 * D + d], v3 = src[r3 * D + d];
                acc += seg_value(v0, scaled, count);
                acc += seg_value(v1, scaled, count);
                acc += seg_value(v2, scaled, count);
                acc += seg_value(v3, scaled, count);
            }
            for (; q < end; ++q) acc += seg_value(src[perm[q] * D + d], scaled, count);
            if (nc == 1) out[m * D + d] = acc;
            else part1[(base + c) * D + d] = acc;
        }
        if (nc > 1) seg_combine<1>(out, part1, part2, cnt1, cnt2, m, base, c, nc, D, 0, 1);
    }
}

#define SEG_SORTED_PASS src, skey, perm, start, out, part1, part2, cnt1, cnt2, n, D, skip, scaled

// PREFIX_starts_<key>, PREFIX_rows<VEC>_<key>, PREFIX_scalar_<key> for key types i16, i32, i64.
#define SEG_SORTED_FOR(PREFIX, KEYNAME, KT)                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                                    \
    PREFIX##_starts_##KEYNAME(const KT* __restrict__ skey, long long n, long long M, long long* __restrict__ start) { \
        seg_starts_body<KT>(skey, n, M, start);                                                          \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) PREFIX##_rows1_##KEYNAME(SEG_SORTED_ARGS_T(KT)) {  \
        seg_rows_body<KT, 1>(SEG_SORTED_PASS);                                                           \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) PREFIX##_rows2_##KEYNAME(SEG_SORTED_ARGS_T(KT)) {  \
        seg_rows_body<KT, 2>(SEG_SORTED_PASS);                                                           \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) PREFIX##_rows4_##KEYNAME(SEG_SORTED_ARGS_T(KT)) {  \
        seg_rows_body<KT, 4>(SEG_SORTED_PASS);                                                           \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) PREFIX##_scalar_##KEYNAME(SEG_SORTED_ARGS_T(KT)) { \
        seg_scalar_body<KT>(SEG_SORTED_PASS);                                                            \
    }

#define SEG_SORTED_ARGS_T(KT)                                                                            \
    const float* __restrict__ src, const KT* __restrict__ skey, const long long* __restrict__ perm,     \
        const long long* __restrict__ start, float* __restrict__ out, float* part1, float* part2,       \
        unsigned* cnt1, unsigned* cnt2, long long n, int D, long long skip, int scaled

#define SEG_KERNELS(PREFIX)                        \
    SEG_ATOMIC_KERNEL(PREFIX##_atomic)             \
    SEG_SORTED_FOR(PREFIX, i16, short)             \
    SEG_SORTED_FOR(PREFIX, i32, int)               \
    SEG_SORTED_FOR(PREFIX, i64, long long)
