// index_add.cu: out (M, D) = 0; out[index[i], :] += src[i, :] for i < N (torch's index_add_ along dim 0).
// Launchers and CPU order models: kernels/index_add.py; the kernels are those of segsum.cuh (row form).
//
// Variants:
//   atomic  one thread per element of src, atomicAdd into the zeroed output (as PyTorch's CUDA
//           index_add does). NONDETERMINISTIC where >= 3 rows of src share an index.
//   sorted  stable sort of the indices (16-bit keys up to 65535 rows), then each output row sums its
//           source rows in source order in chunks of 32 * 2^e, chunk partials combined by a fixed 32-ary
//           tree of halving trees; a warp per output row writes it whole (no zero fill). DETERMINISTIC;
//           one hot index does not serialise the kernel (its chunks run in parallel).
#include "segsum.cuh"

SEG_KERNELS(index_add)
