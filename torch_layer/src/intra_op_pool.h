// How the layer runs the kernels' host passes (image builds, gradient moments, calibration
// errors): on LibTorch's intra-op threads, as torch's own ops do, where the build allows it
// (intra_op_pool.cpp), instead of threads of the kernels' own beside torch's spinning team.
#pragma once

#include "sp/kernels/dtype.h"

namespace sp::torch_layer {

// The pool it names lives as long as the process.
sp::kernels::CpuExec host_exec();

}  // namespace sp::torch_layer
