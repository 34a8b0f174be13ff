#include "sp/torch_layer/paired_interval.h"

#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

namespace {

using sp::torch_layer::paired_interval;
using sp::torch_layer::student_t_quantile;

TEST(PairedInterval, StudentQuantilesMatchThePublishedTable) {
  // Two-sided 95% and 99% critical values, and one-sided 95%, as the standard t tables give them.
  EXPECT_NEAR(student_t_quantile(0.975, 1), 12.706205, 1e-5);
  EXPECT_NEAR(student_t_quantile(0.975, 2), 4.302653, 1e-5);
  EXPECT_NEAR(student_t_quantile(0.975, 9), 2.262157, 1e-5);
  EXPECT_NEAR(student_t_quantile(0.975, 29), 2.045230, 1e-5);
  EXPECT_NEAR(student_t_quantile(0.995, 4), 4.604095, 1e-5);
  EXPECT_NEAR(student_t_quantile(0.95, 1000), 1.646379, 1e-5);
  EXPECT_NEAR(student_t_quantile(0.025, 5), -2.570582, 1e-5);
  EXPECT_EQ(student_t_quantile(0.5, 3), 0.0);
  EXPECT_THROW(student_t_quantile(1.0, 3), std::invalid_argument);
  EXPECT_THROW(student_t_quantile(0.9, 0.5), std::invalid_argument);
}

TEST(PairedInterval, MeanStandardErrorAndBoundsOfKnownDifferences) {
  // Mean 2, sample standard deviation sqrt(2.5), n = 5: se = sqrt(0.5), t(0.975, 4) = 2.776445.
  const auto i = paired_interval({0.0, 1.0, 2.0, 3.0, 4.0}, 0.95);
  EXPECT_EQ(i.n, 5u);
  EXPECT_DOUBLE_EQ(i.mean, 2.0);
  EXPECT_NEAR(i.std_error, std::sqrt(0.5), 1e-12);
  EXPECT_NEAR(i.low, 2.0 - 2.776445 * std::sqrt(0.5), 1e-5);
  EXPECT_NEAR(i.high, 2.0 + 2.776445 * std::sqrt(0.5), 1e-5);
  const auto same = paired_interval({0.25, 0.25, 0.25}, 0.95);
  EXPECT_EQ(same.low, 0.25);
  EXPECT_EQ(same.high, 0.25);
}

TEST(PairedInterval, OneDrawHasNoSpreadAndBadInputIsRefused) {
  const auto one = paired_interval({1.5}, 0.95);
  EXPECT_EQ(one.mean, 1.5);
  EXPECT_TRUE(std::isinf(one.low) && one.low < 0 && std::isinf(one.high));
  EXPECT_THROW(paired_interval({}, 0.95), std::invalid_argument);
  EXPECT_THROW(paired_interval({1.0, NAN}, 0.95), std::invalid_argument);
  EXPECT_THROW(paired_interval({1.0, 2.0}, 1.0), std::invalid_argument);
}

}  // namespace
