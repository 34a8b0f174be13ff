// ||a - b|| / ||a|| with a fixed grid: every thread sums a fixed strided subset in double, each
// block writes one partial, and a single final block reduces the partials in a fixed tree.
#include "sp/kernels/cuda/relative_error.h"

#include <limits>
#include <string>

#include "common.cuh"

namespace sp::kernels::cuda {
namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kBlocks = 1024;  // the fixed grid: partials, and so results, never depend on the GPU

struct Partial {
  double norm_a;
  double norm_diff;
  unsigned long long nonfinite;
};

__device__ void reduce_block(double &norm_a, double &norm_diff, unsigned long long &nonfinite) {
  __shared__ double shared_a[kThreads / 32];
  __shared__ double shared_diff[kThreads / 32];
  __shared__ unsigned long long shared_bad[kThreads / 32];
  norm_a = detail::warp_sum(norm_a);
  norm_diff = detail::warp_sum(norm_diff);
  nonfinite = detail::warp_sum(nonfinite);
  const unsigned warp = threadIdx.x / 32;
  const unsigned lane = threadIdx.x % 32;
  if (lane == 0) {
    shared_a[warp] = norm_a;
    shared_diff[warp] = norm_diff;
    shared_bad[warp] = nonfinite;
  }
  __syncthreads();
  if (warp == 0) {
    const bool present = lane < kThreads / 32;
    norm_a = detail::warp_sum(present ? shared_a[lane] : 0.0);
    norm_diff = detail::warp_sum(present ? shared_diff[lane] : 0.0);
    nonfinite = detail::warp_sum(present ? shared_bad[lane] : 0ull);
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads)
    partial_kernel(const void *a, uint32_t a_dtype, const void *b, uint32_t b_dtype, uint64_t n, Partial *partials) {
  double norm_a = 0.0;
  double norm_diff = 0.0;
  unsigned long long nonfinite = 0;
  const uint64_t stride = static_cast<uint64_t>(kBlocks) * kThreads;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const float x = detail::load_element(a, a_dtype, i);
    const float y = detail::load_element(b, b_dtype, i);
    const bool bad = (kernels::detail::float_bits(x) & kernels::detail::kInfBits) == kernels::detail::kInfBits ||
                     (kernels::detail::float_bits(y) & kernels::detail::kInfBits) == kernels::detail::kInfBits;
    nonfinite += bad ? 1ull : 0ull;
    const double d = static_cast<double>(x) - static_cast<double>(y);
    norm_a += bad ? 0.0 : static_cast<double>(x) * x;
    norm_diff += bad ? 0.0 : d * d;
  }
  reduce_block(norm_a, norm_diff, nonfinite);
  if (threadIdx.x == 0) partials[blockIdx.x] = Partial{norm_a, norm_diff, nonfinite};
}

__global__ void __launch_bounds__(kThreads) final_kernel(const Partial *partials, double *result) {
  double norm_a = 0.0;
  double norm_diff = 0.0;
  unsigned long long nonfinite = 0;
  for (unsigned p = threadIdx.x; p < kBlocks; p += kThreads) {
    norm_a += partials[p].norm_a;
    norm_diff += partials[p].norm_diff;
    nonfinite += partials[p].nonfinite;
  }
  reduce_block(norm_a, norm_diff, nonfinite);
  if (threadIdx.x != 0) return;
  if (nonfinite != 0) {
    *result = __longlong_as_double(0x7FF8000000000000ll);
  } else if (norm_a == 0.0) {
    *result = norm_diff == 0.0 ? 0.0 : __longlong_as_double(0x7FF0000000000000ll);
  } else {
    *result = sqrt(norm_diff / norm_a);
  }
}

}  // namespace

void relative_error(const void *a, DType a_dtype, const void *b, DType b_dtype, std::size_t n, void *workspace,
                    std::size_t *workspace_bytes, double *result_device, cudaStream_t stream) {
  detail::require(workspace_bytes != nullptr, "cuda::relative_error: null workspace_bytes");
  const std::size_t needed = kBlocks * sizeof(Partial);
  if (workspace == nullptr) {
    *workspace_bytes = needed;
    return;
  }
  detail::require(*workspace_bytes >= needed, "cuda::relative_error: workspace of " + std::to_string(*workspace_bytes) +
                                                  " bytes, expected at least " + std::to_string(needed));
  detail::require(result_device != nullptr, "cuda::relative_error: null result pointer");
  detail::require(n == 0 || (a != nullptr && b != nullptr),
                  "cuda::relative_error: null input with n = " + std::to_string(n));
  for (const DType dtype : {a_dtype, b_dtype}) {
    detail::require(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16,
                    "cuda::relative_error: unknown dtype value " + std::to_string(static_cast<int>(dtype)));
  }
  auto *partials = static_cast<Partial *>(workspace);
  partial_kernel<<<kBlocks, kThreads, 0, stream>>>(a, static_cast<uint32_t>(a_dtype), b, static_cast<uint32_t>(b_dtype),
                                                   n, partials);
  check_launch("cuda::relative_error (partials)");
  final_kernel<<<1, kThreads, 0, stream>>>(partials, result_device);
  check_launch("cuda::relative_error (final)");
}

}  // namespace sp::kernels::cuda
