// Relative error ||a - b||_2 / ||a||_2, the calibration metric (a = reference, b = approximation).
#pragma once

#include <cstddef>

#include "sp/kernels/dtype.h"

namespace sp::kernels {

// a and b hold n elements each, of their own dtype (fp32, bf16 or fp16). Sums run in double.
// Returns 0 when both norms are zero, +Inf when ||a|| == 0 < ||a - b||, and NaN when any
// element of a or b is NaN or Inf. n == 0 gives 0.
// kVectorized sums fixed chunks in order, so its result does not depend on thread count.
double relative_error(const void *a, DType a_dtype, const void *b, DType b_dtype, std::size_t n,
                      const CpuExec &exec = {});

}  // namespace sp::kernels
