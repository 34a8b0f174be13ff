#include "cuda_compute.h"

#include <cstdint>

#include "sp/kernels/cuda/check.h"

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
  sp::kernels::cuda::check_launch("sp::bench::spin_kernel");
}

}  // namespace sp::bench
