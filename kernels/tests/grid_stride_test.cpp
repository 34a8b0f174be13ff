// The 32-bit index choice of the CUDA launches (kernels/cuda/nf4.cu, quantize_kernels.cuh),
// checked on the CPU: the grid-stride loop is simulated with a 16-bit index, where wrapping
// can be reached, and the real launch shapes are checked at 32 bits.
#include "grid_stride.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace sp::kernels::detail {
namespace {

// Runs `for (Index i = t; i < items; i += stride)` for every lane t as the kernels do (Index
// arithmetic, so it wraps) and counts visits per element; false when any element is visited
// other than once. Gives up on a lane after items + 1 steps (a wrapped loop may cycle).
template <typename Index>
bool visits_each_once(uint64_t items, unsigned grid, unsigned threads) {
  std::vector<uint32_t> visits(items, 0);
  const auto stride = static_cast<Index>(static_cast<uint64_t>(grid) * threads);
  for (uint64_t lane = 0; lane < static_cast<uint64_t>(grid) * threads; ++lane) {
    uint64_t steps = 0;
    for (auto i = static_cast<Index>(lane); i < items; i = static_cast<Index>(i + stride)) {
      if (++visits[i] > 1 || ++steps > items) return false;
    }
  }
  for (const uint32_t v : visits) {
    if (v != 1) return false;
  }
  return true;
}

TEST(GridStride, FitsExactlyWhenTheSixteenBitLoopVisitsEachElementOnce) {
  // The scalar dequantize shape (256 threads, 4 items per thread per block) scaled to 16 bits:
  // 64 threads, 4 items each, stride about items / 4.
  constexpr unsigned kThreads = 64;
  bool some_wrapped_below_max = false;
  for (uint64_t items = 1; items <= 0xFFFF; items += items < 1024 ? 1 : 97) {
    const unsigned grid = grid_for(items, kThreads * 4);
    const bool fits = grid_stride_fits<uint16_t>(items, grid, kThreads);
    if (fits) {
      ASSERT_TRUE(visits_each_once<uint16_t>(items, grid, kThreads)) << items;
    } else {
      // The old rule (items <= 0xFFFF) took these to the narrow index: they wrap.
      ASSERT_FALSE(visits_each_once<uint16_t>(items, grid, kThreads)) << items;
      some_wrapped_below_max = true;
    }
  }
  EXPECT_TRUE(some_wrapped_below_max);
  EXPECT_TRUE(grid_stride_fits<uint16_t>(0, 1, kThreads));
  EXPECT_FALSE(grid_stride_fits<uint16_t>(1, 0x400, kThreads));  // the stride itself overflows
}

TEST(GridStride, ScalarDequantizeAboveThreePointFourBillionElementsTakesSixtyFourBits) {
  constexpr unsigned kThreads = 256;
  // NF4 and INT8 scalar dequantize: grid_for(n, 1024) blocks of 256 threads, stride ~ n / 4.
  const auto scalar_fits = [](uint64_t n) { return uint32_indices_fit(n, 1, n, grid_for(n, kThreads * 4), kThreads); };
  EXPECT_TRUE(scalar_fits(1ull << 31));
  EXPECT_TRUE(scalar_fits(3'400'000'000ull));
  EXPECT_FALSE(scalar_fits(3'500'000'000ull));  // n < 2^32, yet n + stride wraps
  EXPECT_FALSE(scalar_fits((1ull << 32) - 1));
  EXPECT_FALSE(scalar_fits(1ull << 32));
  // The largest n the scalar path keeps at 32 bits: n + stride <= 2^32.
  uint64_t lo = 1ull << 31, hi = 1ull << 32;
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    (scalar_fits(mid) ? lo : hi) = mid;
  }
  EXPECT_LE(lo + static_cast<uint64_t>(grid_for(lo, kThreads * 4)) * kThreads, 1ull << 32);
  EXPECT_GT(lo, 3'400'000'000ull);

  // Vector paths (32 or 16 elements per step, stride ~ vectors) keep 32 bits up to n < 2^32.
  const uint64_t n = (1ull << 32) - 32;
  EXPECT_TRUE(uint32_indices_fit(n, n / 64, n / 32, grid_for(n / 32, kThreads), kThreads));
  EXPECT_TRUE(uint32_indices_fit(n, n / 64, n / 16, grid_for(n / 16, kThreads), kThreads));
  // NF4 codes kernel: one thread per byte, 4 bytes per thread per block.
  EXPECT_TRUE(uint32_indices_fit(n, n / 64, n / 2, grid_for(n / 2, kThreads * 4), kThreads));
  // Scale indices past 32 bits take 64 either way.
  EXPECT_FALSE(uint32_indices_fit(1024, 1ull << 32, 1024, grid_for(1024, kThreads), kThreads));
}

}  // namespace
}  // namespace sp::kernels::detail
