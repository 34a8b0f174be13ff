#include "sp/kernels/relative_error.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "test_support.h"

namespace sp::kernels {
namespace {

const std::vector<CpuExec> kAllExecs = {CpuExec{CpuImpl::kReference, 1}, CpuExec{CpuImpl::kVectorized, 1},
                                        CpuExec{CpuImpl::kVectorized, 2}, CpuExec{CpuImpl::kVectorized, 3}};

TEST(RelativeError, KnownValues) {
  const std::vector<float> a(1001, 2.0f);
  std::vector<float> b(a.size(), 2.02f);
  for (const CpuExec &exec : kAllExecs) {
    EXPECT_NEAR(relative_error(a.data(), DType::kFloat32, b.data(), DType::kFloat32, a.size(), exec), 0.01, 1e-6);
    EXPECT_EQ(relative_error(a.data(), DType::kFloat32, a.data(), DType::kFloat32, a.size(), exec), 0.0);
    EXPECT_EQ(relative_error(nullptr, DType::kFloat32, nullptr, DType::kFloat32, 0, exec), 0.0);
  }
}

TEST(RelativeError, SpecialCases) {
  const std::vector<float> zeros(7, 0.0f);
  const std::vector<float> ones(7, 1.0f);
  std::vector<float> with_nan(7, 1.0f);
  with_nan[6] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> with_inf(7, 1.0f);
  with_inf[0] = std::numeric_limits<float>::infinity();
  for (const CpuExec &exec : kAllExecs) {
    EXPECT_TRUE(std::isinf(relative_error(zeros.data(), DType::kFloat32, ones.data(), DType::kFloat32, 7, exec)));
    EXPECT_EQ(relative_error(zeros.data(), DType::kFloat32, zeros.data(), DType::kFloat32, 7, exec), 0.0);
    EXPECT_TRUE(std::isnan(relative_error(ones.data(), DType::kFloat32, with_nan.data(), DType::kFloat32, 7, exec)));
    EXPECT_TRUE(std::isnan(relative_error(with_inf.data(), DType::kFloat32, ones.data(), DType::kFloat32, 7, exec)));
  }
}

TEST(RelativeError, VectorizedMatchesReferenceAcrossDtypesAndMagnitudes) {
  for (const float magnitude : {1.0f, 1e30f, 1e-30f}) {
    for (const std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{257 * 259}, std::size_t{200001}}) {
      std::vector<float> a = testing::gaussian(n, 1, magnitude);
      std::vector<uint16_t> b(n);
      for (std::size_t i = 0; i < n; ++i) b[i] = testing::bf16_truncate(a[i] * 1.001f);
      const double expected =
          relative_error(a.data(), DType::kFloat32, b.data(), DType::kBFloat16, n, CpuExec{CpuImpl::kReference, 1});
      EXPECT_GT(expected, 0.0);
      EXPECT_LT(expected, 0.01);
      for (const CpuExec &exec : testing::fast_execs()) {
        EXPECT_NEAR(relative_error(a.data(), DType::kFloat32, b.data(), DType::kBFloat16, n, exec), expected,
                    1e-9 * expected)
            << magnitude << " " << n << " " << testing::exec_name(exec);
      }
    }
  }
}

}  // namespace
}  // namespace sp::kernels
