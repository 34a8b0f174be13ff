#include "sp/precision.h"

#include <algorithm>
#include <cctype>
#include <set>
#include <string>
#include <vector>

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
  int past_the_last = 0;  // 3 in the three-route build
  for (Precision precision : kPrecisions)
    past_the_last = std::max(past_the_last, static_cast<int>(to_abi(precision)) + 1);
  EXPECT_EQ(from_abi(static_cast<sp_precision>(past_the_last)), std::nullopt);
  EXPECT_EQ(from_abi(static_cast<sp_precision>(-1)), std::nullopt);
}

TEST(RouteTraits, EachRowDescribesItsOwnRouteConsistently) {
  std::set<std::string> names, labels;
  for (Precision precision : kPrecisions) {
    const RouteTraits& route = route_traits(precision);
    EXPECT_EQ(route.precision, precision);
    EXPECT_STREQ(precision_name(precision), route.name);
    std::string upper = route.name;
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    EXPECT_EQ(upper, route.label);
    EXPECT_EQ(std::string("SP_PRECISION_") + route.label, route.abi_name);
    EXPECT_EQ(to_abi(precision), route.abi_code);
    EXPECT_EQ(route.group_size_option == nullptr, !is_quantized(precision)) << route.name;
    if (route.group_size_option != nullptr) {
      EXPECT_EQ(std::string(route.name) + "_group_size", route.group_size_option);
    }
    EXPECT_TRUE(is_supported_group_size(precision, route.default_group_size)) << route.name;
    names.insert(route.name);
    labels.insert(route.label);
  }
  EXPECT_EQ(names.size(), kPrecisionCount);
  EXPECT_EQ(labels.size(), kPrecisionCount);
  // From the most to the least precise: each route's codes are no wider than the one before.
  for (std::size_t i = 1; i < kPrecisionCount; ++i) {
    EXPECT_LE(kRouteTraits[i].code_bits, kRouteTraits[i - 1].code_bits) << kRouteTraits[i].name;
  }
}

TEST(RouteTraits, TheQuantizedRoutesAreThoseWithScalesInOrder) {
  std::vector<Precision> quantized;
  for (Precision precision : kPrecisions) {
    if (route_traits(precision).scale_bytes != 0) quantized.push_back(precision);
  }
  EXPECT_EQ(std::vector<Precision>(kQuantizedPrecisions.begin(), kQuantizedPrecisions.end()), quantized);
  EXPECT_EQ(kQuantizedPrecisions.front(), Precision::int8);
}

TEST(RouteTraits, GroupSizesAreCheckedPerRoute) {
  EXPECT_TRUE(is_supported_group_size(Precision::bf16, 0));
  EXPECT_FALSE(is_supported_group_size(Precision::bf16, 64));
  EXPECT_TRUE(is_supported_group_size(Precision::int8, 0));  // one scale per row
  EXPECT_FALSE(is_supported_group_size(Precision::nf4, 0));  // NF4 has no per-row mode
  for (std::uint32_t group : {32u, 64u, 128u, 256u}) {
    EXPECT_TRUE(is_supported_group_size(Precision::int8, group));
    EXPECT_TRUE(is_supported_group_size(Precision::nf4, group));
  }
  for (std::uint32_t group : {1u, 16u, 48u, 512u}) EXPECT_FALSE(is_supported_group_size(Precision::nf4, group));
  EXPECT_EQ(group_size_expectation(Precision::int8), "0 (one scale per row), 32, 64, 128 or 256");
  EXPECT_EQ(group_size_expectation(Precision::nf4), "32, 64, 128 or 256");
}

TEST(RouteTraits, NominalBitsCountTheCodesAndTheScalesOfAGroup) {
  EXPECT_DOUBLE_EQ(nominal_bits_per_weight(Precision::bf16, 0), 16.0);
  EXPECT_DOUBLE_EQ(nominal_bits_per_weight(Precision::int8, 0), 8.0);
  EXPECT_DOUBLE_EQ(nominal_bits_per_weight(Precision::int8, 64), 8.5);  // a 4-byte scale per 64
  EXPECT_DOUBLE_EQ(nominal_bits_per_weight(Precision::nf4, 64), 4.25);  // a 2-byte scale per 64
}

TEST(RouteTraits, MessagesListTheRoutesFromTheTable) {
  EXPECT_EQ(quoted_route_names(), "'bf16', 'int8' or 'nf4'");
  EXPECT_EQ(quoted_route_names(true), "'int8' or 'nf4'");
  EXPECT_EQ(abi_code_expectation(), "SP_PRECISION_BF16 (0), SP_PRECISION_INT8 (1) or SP_PRECISION_NF4 (2)");
  EXPECT_EQ(abi_mask_of_all(), SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8) |
                                   SP_PRECISION_BIT(SP_PRECISION_NF4));
}

// The codes a plugin of each ABI minor may hint come from the rows' abi_minor: 1.0 had BF16 and
// INT8, 1.1 added NF4, and a later minor takes every earlier code.
TEST(RouteTraits, EachAbiMinorTakesTheCodesOfItsRoutesAndEarlierOnes) {
  const sp_precision_mask v1_0 = SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8);
  EXPECT_EQ(abi_mask_since(0), v1_0);
  EXPECT_EQ(abi_mask_since(1) & ~abi_mask_since(0), SP_PRECISION_BIT(SP_PRECISION_NF4));
  EXPECT_EQ(abi_mask_since(SP_PLUGIN_ABI_MINOR), abi_mask_of_all());
  for (const RouteTraits& route : kRouteTraits) {
    EXPECT_LE(route.abi_minor, static_cast<std::uint32_t>(SP_PLUGIN_ABI_MINOR)) << route.name;
    EXPECT_NE(abi_mask_since(route.abi_minor) & SP_PRECISION_BIT(route.abi_code), 0u) << route.name;
    if (route.abi_minor > 0) {
      EXPECT_EQ(abi_mask_since(route.abi_minor - 1) & SP_PRECISION_BIT(route.abi_code), 0u) << route.name;
    }
  }
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
