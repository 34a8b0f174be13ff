#include "delivered_weights.hpp"

#include "sp/kernels/bf16.h"

namespace sp::train {

void widen_delivered_weights(const sp::adapters::TensorView& view, float* dst) {
  sp::kernels::bf16_to_fp32(view.bf16, dst, view.rows * view.cols);
}

}  // namespace sp::train
