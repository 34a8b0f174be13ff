#include "sp/kernels/fp8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "reference.h"
#include "sp/kernels/quantize.h"
#include "sp/kernels/relative_error.h"
#include "test_support.h"

namespace sp::kernels {
namespace {

// E4M3 value of a code from its definition: bias 7, 3 mantissa bits, subnormals at exponent
// field 0, S.1111.111 is NaN, no infinities.
double e4m3_value(unsigned code) {
  const double sign = (code & 0x80u) ? -1.0 : 1.0;
  const int exponent_field = static_cast<int>((code >> 3) & 0xFu);
  const int mantissa = static_cast<int>(code & 7u);
  if (exponent_field == 0) return sign * mantissa * std::ldexp(1.0, -9);
  return sign * (1.0 + mantissa / 8.0) * std::ldexp(1.0, exponent_field - 7);
}

TEST(Fp8E4M3, DecodesAll256Codes) {
  for (unsigned code = 0; code < 256; ++code) {
    const float decoded = fp8_e4m3_to_float(static_cast<uint8_t>(code));
    if ((code & 0x7Fu) == 0x7Fu) {
      EXPECT_TRUE(std::isnan(decoded)) << code;
      continue;
    }
    EXPECT_EQ(static_cast<double>(decoded), e4m3_value(code)) << code;
    EXPECT_EQ(std::signbit(decoded), (code & 0x80u) != 0) << code;
  }
  // A few landmarks written out.
  EXPECT_EQ(fp8_e4m3_to_float(0x01), 0.001953125f);
  EXPECT_EQ(fp8_e4m3_to_float(0x08), 0.015625f);
  EXPECT_EQ(fp8_e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x3F), 1.875f);
  EXPECT_EQ(fp8_e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0xFE), -448.0f);
}

TEST(Fp8E4M3, EncodeInvertsDecodeForEveryCode) {
  for (unsigned code = 0; code < 256; ++code) {
    const uint8_t c = static_cast<uint8_t>(code);
    if ((code & 0x7Fu) == 0x7Fu) {
      EXPECT_EQ(fp8_e4m3_from_float(fp8_e4m3_to_float(c)) & 0x7F, 0x7F) << code;
      continue;
    }
    EXPECT_EQ(fp8_e4m3_from_float(fp8_e4m3_to_float(c)), c) << code;
  }
}

TEST(Fp8E4M3, RoundsToNearestEvenAndSaturates) {
  std::vector<float> probes = {0.0f,
                               -0.0f,
                               448.0f,
                               449.0f,
                               463.99f,
                               464.0f,
                               465.0f,
                               1e10f,
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::denorm_min(),
                               1e-40f,
                               0.0009765625f,
                               0.00097656251f,
                               0.0029296875f,
                               -0.0029296875f};
  // Every midpoint between neighbouring codes, and one float step either side of it.
  for (unsigned code = 0; code < 0x7E; ++code) {
    const float mid = static_cast<float>((e4m3_value(code) + e4m3_value(code + 1)) / 2.0);
    for (const float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      probes.push_back(x);
      probes.push_back(-x);
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = rng();
    float x;
    std::memcpy(&x, &bits, sizeof x);
    probes.push_back(x);
    probes.push_back(std::ldexp(static_cast<float>(rng() % 10000) / 10000.0f, static_cast<int>(rng() % 30) - 15));
  }
  for (const float x : probes) {
    ASSERT_EQ(fp8_e4m3_from_float(x), reference::fp8_e4m3_from_float(x)) << x;
  }
  EXPECT_EQ(fp8_e4m3_from_float(464.0f), 0x7E);  // tie between 448 and (absent) 480 -> 448
  EXPECT_EQ(fp8_e4m3_from_float(-1e10f), 0xFE);
  EXPECT_EQ(fp8_e4m3_from_float(0.0029296875f), 0x02);  // 1.5 * 2^-9 -> 2 * 2^-9 (even)
  EXPECT_EQ(fp8_e4m3_from_float(std::numeric_limits<float>::quiet_NaN()), 0x7F);
}

TEST(QuantizeFp8, VectorizedMatchesReferenceBitForBit) {
  for (const testing::Shape shape : testing::odd_shapes()) {
    const std::vector<float> x = testing::special_matrix(shape.rows, shape.cols, 3);
    std::vector<uint16_t> x_bf16(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) x_bf16[i] = testing::bf16_truncate(x[i]);
    for (const uint32_t group : {0u, 32u, 64u, 128u, 256u}) {
      for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
        const void *src =
            dtype == DType::kFloat32 ? static_cast<const void *>(x.data()) : static_cast<const void *>(x_bf16.data());
        const std::size_t n_scales = scale_count(shape.rows, shape.cols, group);
        const auto run = [&](const CpuExec &exec) {
          std::vector<uint8_t> codes(x.size(), 0x55);
          std::vector<float> scales(n_scales, -1.0f);
          std::vector<uint16_t> bf16(x.size(), 0xDEAD);
          std::vector<float> fp32(x.size(), -1.0f);
          quantize_fp8_e4m3(src, dtype, shape.rows, shape.cols, group, codes.data(), scales.data(), exec);
          dequantize_fp8_e4m3_to_bf16(codes.data(), scales.data(), shape.rows, shape.cols, group, bf16.data(), exec);
          dequantize_fp8_e4m3_to_fp32(codes.data(), scales.data(), shape.rows, shape.cols, group, fp32.data(), exec);
          std::vector<uint32_t> bits;  // scales then values, compared as bit patterns
          for (const std::vector<float> *values : {&scales, &fp32}) {
            for (const float v : *values) {
              uint32_t u;
              std::memcpy(&u, &v, sizeof u);
              bits.push_back(u);
            }
          }
          return std::make_tuple(codes, bits, bf16);
        };
        const auto expected = run(CpuExec{CpuImpl::kReference, 1});
        for (const CpuExec &exec : testing::fast_execs()) {
          ASSERT_EQ(expected, run(exec)) << shape.rows << "x" << shape.cols << " group " << group << " "
                                         << dtype_name(dtype) << " " << testing::exec_name(exec);
        }
      }
    }
  }
}

TEST(QuantizeFp8, PoisonsNonFiniteRowsAndKeepsZeroRowsExact) {
  const testing::Shape shape{4, 40};
  const std::vector<float> x = testing::special_matrix(shape.rows, shape.cols, 9);
  std::vector<uint8_t> codes(x.size());
  std::vector<float> scales(shape.rows);
  std::vector<float> back(x.size());
  quantize_fp8_e4m3(x.data(), DType::kFloat32, shape.rows, shape.cols, 0, codes.data(), scales.data());
  dequantize_fp8_e4m3_to_fp32(codes.data(), scales.data(), shape.rows, shape.cols, 0, back.data());
  EXPECT_EQ(scales[0], 1.0f);
  for (std::size_t c = 0; c < shape.cols; ++c) EXPECT_EQ(back[c], 0.0f);
  for (std::size_t r = 1; r < 4; ++r) {
    EXPECT_TRUE(std::isnan(scales[r]));
    for (std::size_t c = 0; c < shape.cols; ++c) EXPECT_EQ(codes[r * shape.cols + c], 0);
  }
}

TEST(QuantizeFp8, QualityBoundOnSeededGaussian) {
  const std::size_t rows = 256;
  const std::size_t cols = 4096;
  const std::vector<float> x = testing::gaussian(rows * cols, 77, 0.02f);
  std::vector<uint8_t> codes(x.size());
  std::vector<float> scales(rows);
  std::vector<float> back(x.size());
  quantize_fp8_e4m3(x.data(), DType::kFloat32, rows, cols, 0, codes.data(), scales.data());
  dequantize_fp8_e4m3_to_fp32(codes.data(), scales.data(), rows, cols, 0, back.data());
  EXPECT_LE(relative_error(x.data(), DType::kFloat32, back.data(), DType::kFloat32, x.size()), 0.028);
}

TEST(QuantizeFp8, RejectsUnsupportedGroupSize) {
  std::vector<float> x(32, 1.0f);
  std::vector<uint8_t> codes(32);
  std::vector<float> scales(1);
  EXPECT_THROW(quantize_fp8_e4m3(x.data(), DType::kFloat32, 1, 32, 16, codes.data(), scales.data()),
               std::invalid_argument);
}

}  // namespace
}  // namespace sp::kernels
