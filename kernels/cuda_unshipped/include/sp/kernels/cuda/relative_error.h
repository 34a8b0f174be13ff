// CUDA twin of sp/kernels/relative_error.h: ||a - b|| / ||a|| with a deterministic two-pass
// reduction (fixed grid, per-block partials in double, one final block). Device pointers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "sp/kernels/relative_error.h"

namespace sp::kernels::cuda {

// Transformer-Engine-style workspace query: with workspace == nullptr, sets *workspace_bytes
// and returns without launching. Otherwise *workspace_bytes must be at least that size, and
// the result (same special cases as the CPU version) is written to *result_device, on
// `stream`, without a host sync.
void relative_error(const void *a, DType a_dtype, const void *b, DType b_dtype, std::size_t n, void *workspace,
                    std::size_t *workspace_bytes, double *result_device, cudaStream_t stream);

}  // namespace sp::kernels::cuda
