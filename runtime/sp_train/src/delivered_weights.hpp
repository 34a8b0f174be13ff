// The compute weights of a streamed block are exactly what its transfer delivered into the
// device slot: bf16 bit patterns, dequantized on the device when the block took the INT8
// route. On the CPU the trainer computes in fp32, and widening bf16 to fp32 is exact, so the
// arithmetic sees the delivered values and nothing else (no fresh copy of the fp32 master).
#pragma once

#include "sp/adapters/streaming_engine.h"

namespace sp::train {

// view.rows * view.cols floats into dst. The view must be host-addressable (HostBackend).
void widen_delivered_weights(const sp::adapters::TensorView& view, float* dst);

}  // namespace sp::train
