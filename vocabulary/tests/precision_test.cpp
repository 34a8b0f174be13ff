#include "sp/precision.h"

#include <string>

#include <gtest/gtest.h>

#include "sp/precision_abi.h"

namespace sp {
namespace {

TEST(Precision, EveryPrecisionHasOneNameThatReadsBack) {
  for (Precision precision : kPrecisions) {
    const std::optional<Precision> read = precision_named(precision_name(precision));
    ASSERT_TRUE(read.has_value()) << precision_name(precision);
    EXPECT_EQ(*read, precision);
  }
  EXPECT_STREQ(precision_name(Precision::nf4), "nf4");
  EXPECT_EQ(precision_named("fp8"), std::nullopt);
  EXPECT_EQ(precision_named("BF16"), std::nullopt);  // names are lower case, as configs write them
}

TEST(Precision, TheAbiTranslationIsABijectionOnTheDefinedValues) {
  for (Precision precision : kPrecisions) {
    EXPECT_EQ(from_abi(to_abi(precision)), precision) << precision_name(precision);
  }
  EXPECT_EQ(to_abi(Precision::bf16), SP_PRECISION_BF16);
  EXPECT_EQ(to_abi(Precision::int8), SP_PRECISION_INT8);
  EXPECT_EQ(to_abi(Precision::nf4), SP_PRECISION_NF4);
  EXPECT_EQ(from_abi(static_cast<sp_precision>(3)), std::nullopt);
  EXPECT_EQ(from_abi(static_cast<sp_precision>(-1)), std::nullopt);
}

TEST(Precision, OnlyBf16IsNotQuantized) {
  EXPECT_FALSE(is_quantized(Precision::bf16));
  EXPECT_TRUE(is_quantized(Precision::int8));
  EXPECT_TRUE(is_quantized(Precision::nf4));
}

TEST(PerPrecision, HoldsOneValuePerPrecisionStartingAtZero) {
  PerPrecision<std::uint64_t> bytes;
  for (Precision precision : kPrecisions) EXPECT_EQ(bytes[precision], 0u);
  bytes[Precision::int8] = 5;
  bytes[Precision::nf4] += 7;
  EXPECT_EQ(bytes[Precision::bf16], 0u);
  EXPECT_EQ(bytes.total(), 12u);
  PerPrecision<std::uint64_t> more;
  more[Precision::bf16] = 1;
  more[Precision::nf4] = 1;
  more += bytes;
  EXPECT_EQ(more[Precision::bf16], 1u);
  EXPECT_EQ(more[Precision::int8], 5u);
  EXPECT_EQ(more[Precision::nf4], 8u);
  EXPECT_NE(more, bytes);
  more[Precision::bf16] = 0;
  more[Precision::nf4] = 7;
  EXPECT_EQ(more, bytes);
}

}  // namespace
}  // namespace sp
