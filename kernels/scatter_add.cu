// scatter_add.cu: out (M, D) = 0; out[index[i, j], j] += src[i, j] (torch's scatter_add_ along dim 0, index
// of src's shape). Launchers and CPU order models: kernels/scatter_add.py; kernels: segsum.cuh.
// An index that is one column broadcast along dim 1 (stride 0, as graph libraries expand edge indices)
// is index_add's row form; any other index is the element form: N * D contributions of one value each,
// the destination of src[i, j] being out[index[i, j], j].
//
// Variants:
//   atomic  one thread per element, atomicAdd (as PyTorch's CUDA scatter_add). NONDETERMINISTIC.
//   sorted  stable sort by destination (row form: by index; element form: by index * D + j), then each
//           destination sums its contributions in source order (i ascending) in chunks of 32 * 2^e,
//           partials combined by a fixed 32-ary tree. DETERMINISTIC.
//   fixed   order-independent fixed-point sums (segsum.cuh): int64 atomics per term (direct), or, for
//           the element form with several terms per destination, terms placed in pages per bin of
//           destinations and summed in shared memory (binned). The same bits. DETERMINISTIC.
#include "segsum.cuh"

SEG_KERNELS(scatter_add)
