#include "sp/kernels/bf16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "test_support.h"

namespace sp::kernels {
namespace {

float from_bits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// Random bit patterns (every class: NaN, Inf, subnormal, huge, tiny) plus the edge values.
std::vector<float> probe_values(std::size_t n) {
  std::mt19937 rng(99);
  std::vector<float> values;
  for (std::size_t i = 0; i < n; ++i) values.push_back(from_bits(rng()));
  for (const uint32_t bits :
       {0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFC00001u, 0x7F7FFFFFu, 0xFF7FFFFFu,
        0x7F7F8000u, 0x7F7F7FFFu, 0x00000001u, 0x00008000u, 0x00018000u, 0x3F808000u, 0x3F818000u}) {
    values.push_back(from_bits(bits));
  }
  return values;
}

TEST(Bf16, VectorizedMatchesReferenceForBothRoundings) {
  for (const std::size_t n :
       {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{257 * 259}, std::size_t{300000}}) {
    const std::vector<float> x = probe_values(n);
    for (const Rounding rounding : {Rounding::kNearestEven, Rounding::kStochastic}) {
      const Bf16Options options{rounding, 5};
      std::vector<uint16_t> expected(x.size());
      fp32_to_bf16(x.data(), expected.data(), x.size(), options, CpuExec{CpuImpl::kReference, 1});
      for (const CpuExec &exec : testing::fast_execs()) {
        std::vector<uint16_t> actual(x.size(), 0xDEAD);
        fp32_to_bf16(x.data(), actual.data(), x.size(), options, exec);
        ASSERT_EQ(expected, actual) << n << " " << testing::exec_name(exec);
      }
    }
  }
}

TEST(Bf16, NearestEvenRulesAndSpecialValues) {
  const std::vector<float> x = {1.0f,
                                from_bits(0x3F808000u),  // 1 + 2^-8: tie -> 1 (even)
                                from_bits(0x3F818000u),  // tie -> round up to even 0x3F82
                                from_bits(0x3F808001u),  // just above the tie -> up
                                from_bits(0x7F7FFFFFu),  // FLT_MAX rounds to +Inf
                                std::numeric_limits<float>::infinity(),
                                -std::numeric_limits<float>::quiet_NaN(),
                                from_bits(0x00000001u)};  // smallest subnormal -> +0
  std::vector<uint16_t> out(x.size());
  fp32_to_bf16(x.data(), out.data(), x.size());
  EXPECT_EQ(out, (std::vector<uint16_t>{0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x7F80, 0x7FFF, 0x0000}));
  std::vector<float> back(out.size());
  bf16_to_fp32(out.data(), back.data(), out.size());
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_TRUE(std::isinf(back[4]));
  EXPECT_TRUE(std::isnan(back[6]));
}

TEST(Bf16, StochasticRoundingIsUnbiasedAndSeeded) {
  // 1 + 2^-9 is a quarter of the way from 1 to the next bf16 (1 + 2^-7).
  const std::size_t n = 1 << 16;
  const std::vector<float> x(n, from_bits(0x3F804000u));
  std::vector<uint16_t> a(n), b(n), c(n);
  fp32_to_bf16(x.data(), a.data(), n, Bf16Options{Rounding::kStochastic, 1});
  fp32_to_bf16(x.data(), b.data(), n, Bf16Options{Rounding::kStochastic, 1}, CpuExec{CpuImpl::kVectorized, 3});
  fp32_to_bf16(x.data(), c.data(), n, Bf16Options{Rounding::kStochastic, 2});
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  std::size_t up = 0;
  for (const uint16_t v : a) {
    ASSERT_TRUE(v == 0x3F80 || v == 0x3F81);
    up += v == 0x3F81;
  }
  EXPECT_NEAR(static_cast<double>(up) / n, 0.25, 0.01);
  // Values already representable never move.
  const std::vector<float> exact = {1.0f, -2.0f, 0.0f, 0.5f};
  std::vector<uint16_t> exact_out(exact.size());
  fp32_to_bf16(exact.data(), exact_out.data(), exact.size(), Bf16Options{Rounding::kStochastic, 3});
  EXPECT_EQ(exact_out, (std::vector<uint16_t>{0x3F80, 0xC000, 0x0000, 0x3F00}));
}

TEST(Bf16, RejectsNullPointersAndAcceptsEmptyInput) {
  std::vector<uint16_t> out(4);
  EXPECT_THROW(fp32_to_bf16(nullptr, out.data(), 4), std::invalid_argument);
  EXPECT_NO_THROW(fp32_to_bf16(nullptr, nullptr, 0));
}

}  // namespace
}  // namespace sp::kernels
