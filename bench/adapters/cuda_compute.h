// Synthetic compute on the GPU for the exposed-transfer loop.
#pragma once

#include <cuda_runtime_api.h>

namespace sp::bench {

// Occupies `stream` for about `seconds` (one block spinning on the global timer).
void spin_on_stream(cudaStream_t stream, double seconds);

}  // namespace sp::bench
