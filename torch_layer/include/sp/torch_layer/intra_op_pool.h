// The CPU kernels' executor on LibTorch's intra-op threads: the layer runs its host passes
// (image builds, gradient moments, calibration errors) with it, and so can a host that calls
// the kernels itself (the Python module does). It joins the OpenMP team torch's own ops use
// where the build allows it (GCC, LibTorch's libgomp: src/intra_op_pool.cpp), instead of
// starting threads beside torch's workers, which spin between ops and take the cores.
#pragma once

#include "sp/kernels/dtype.h"

namespace sp::torch_layer {

// A CpuExec whose pool runs at::get_num_threads() tasks at once (read at each call); with a
// build that cannot join torch's team, the default CpuExec (the kernels' own threads). The pool
// lives as long as the process.
sp::kernels::CpuExec intra_op_exec();

}  // namespace sp::torch_layer
