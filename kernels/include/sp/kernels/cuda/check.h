// The one CUDA error check of the kernels, the adapters and the benchmarks. A failed CUDA
// runtime call or kernel launch becomes a CudaError (an sp::Error of kind device, and a
// std::runtime_error) whose message names
// what failed, the error's description and its enum name:
//   "CUDA error in cudaMemcpyAsync (GradMomentsPlan::upload): invalid argument (cudaErrorInvalidValue)"
//   "CUDA error in the launch of cuda::quantize_int8: no kernel image is available for
//    execution on the device (cudaErrorNoKernelImageForDevice)"
// Host code only; usable from .cu files and from C++ files that include the CUDA runtime.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#include "sp/error.h"

namespace sp::kernels::cuda {

class CudaError : public ErrorAs<std::runtime_error> {
 public:
  // `what` names the failed call, and where useful its caller: "cudaEventRecord",
  // "cudaMemcpyAsync (GradMomentsPlan::upload)".
  CudaError(cudaError_t status, const std::string &what)
      : ErrorAs(ErrorKind::device, "CUDA error in " + what + ": " + cudaGetErrorString(status) + " (" +
                                       cudaGetErrorName(status) + ")"),
        status_(status) {}

  cudaError_t status() const noexcept { return status_; }

 private:
  cudaError_t status_;
};

// Throws CudaError unless `status` is cudaSuccess.
inline void check(cudaError_t status, const char *what) {
  if (status != cudaSuccess) throw CudaError(status, what);
}

// Right after a kernel launch (`kernel` names it): a launch that failed leaves its error for
// cudaGetLastError(), which this reads, and thereby clears, and throws as a CudaError. Errors
// the kernel meets while it runs surface at the next synchronizing call's check.
inline void check_launch(const char *kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) throw CudaError(status, std::string("the launch of ") + kernel);
}

}  // namespace sp::kernels::cuda
