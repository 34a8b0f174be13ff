#include "cuda_compute.h"

#include <cstdint>
#include <stdexcept>
#include <string>

namespace sp::bench {
namespace {

__device__ std::uint64_t global_nanoseconds() {
  std::uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

__global__ void spin_kernel(std::uint64_t nanoseconds) {
  const std::uint64_t start = global_nanoseconds();
  while (global_nanoseconds() - start < nanoseconds) {
  }
}

}  // namespace

void spin_on_stream(cudaStream_t stream, double seconds) {
  spin_kernel<<<1, 1, 0, stream>>>(static_cast<std::uint64_t>(seconds * 1e9));
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("spin kernel launch: ") + cudaGetErrorString(status));
  }
}

}  // namespace sp::bench
