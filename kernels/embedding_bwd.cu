// embedding_bwd.cu: grad_weight (num_weights, D) of an embedding lookup: grad_weight[indices[t], :] +=
// grad_output[t, :] over the flattened tokens t, rows equal to padding_idx left at zero, and with
// scale_grad_by_freq each term divided by the count of its index in the batch (aten's
// embedding_dense_backward). Launchers and CPU order models: kernels/embedding_bwd.py; kernels:
// segsum.cuh (row form, with its skip row and count division).
//
// Variants:
//   atomic  one thread per element of grad_output, atomicAdd. NONDETERMINISTIC.
//   sorted  stable sort of the indices; each row sums its tokens in token order in chunks of 32 * 2^e,
//           partials combined by a fixed 32-ary tree. DETERMINISTIC (PyTorch's CUDA backward is also
//           sort based and deterministic; this one splits hot rows across warps).
#include "segsum.cuh"

SEG_KERNELS(embedding_bwd)
