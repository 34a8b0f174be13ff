// The Taylor terms of moving a weight tensor from its fp32 master to a transfer image: what
// the torch layer sends the policy as each unit's predicted loss cost (docs/signals.md).
#pragma once

#include <cstddef>

#include "sp/kernels/dtype.h"
#include "sp/kernels/slab.h"

namespace sp::kernels {

// With d = image - master, element by element, where image is what build_slab(encoding) would
// make of the master, decoded to bf16 (exactly the weights a block computes with):
//   first  = sum of g * d      (the first-order term of the loss change)
//   second = sum of g^2 * d^2  (times B/2 it is the second-order term with the per-batch
//                               Fisher times the batch size B standing in for the per-example one)
// both summed in double. A stochastic encoding is taken at round-to-nearest-even: the terms
// describe the image's expected error, not one draw of it.
struct TaylorSums {
  double first = 0.0;
  double second = 0.0;
};

// master and grad hold shape.rows * shape.cols fp32 elements, row-major. Non-finite values
// propagate (NaN sums). Rows are processed in fixed chunks whose partial sums are added in
// chunk order, so the result does not depend on the thread count. Throws std::invalid_argument
// for a bad encoding (as slab_image_bytes) or a null pointer with a non-empty shape.
TaylorSums image_taylor_sums(const SlabEncoding &encoding, const float *master, const float *grad, TensorShape shape,
                             const CpuExec &exec = {});

}  // namespace sp::kernels
