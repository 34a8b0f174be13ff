#include "sp/kernels/quantize.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "sp/kernels/relative_error.h"
#include "test_support.h"

namespace sp::kernels {
namespace {

using testing::Shape;

struct Quantized {
  std::vector<int8_t> codes;
  std::vector<float> scales;
  std::vector<uint16_t> bf16;
  std::vector<float> fp32;
};

// Quantizes and dequantizes (to bf16 and fp32) with one implementation.
Quantized round_trip(const void *src, DType dtype, Shape shape, const QuantizeOptions &options, const CpuExec &exec) {
  Quantized out;
  const std::size_t n = shape.rows * shape.cols;
  out.codes.assign(n, int8_t{99});
  out.scales.assign(scale_count(shape.rows, shape.cols, options.group_size), -1.0f);
  out.bf16.assign(n, 0xDEAD);
  out.fp32.assign(n, -1.0f);
  quantize_int8(src, dtype, shape.rows, shape.cols, options, out.codes.data(), out.scales.data(), exec);
  dequantize_int8_to_bf16(out.codes.data(), out.scales.data(), shape.rows, shape.cols, options.group_size,
                          out.bf16.data(), exec);
  dequantize_int8_to_fp32(out.codes.data(), out.scales.data(), shape.rows, shape.cols, options.group_size,
                          out.fp32.data(), exec);
  return out;
}

void expect_identical(const Quantized &expected, const Quantized &actual, const std::string &what) {
  ASSERT_EQ(expected.codes, actual.codes) << what;
  ASSERT_TRUE(testing::same_bits(expected.scales, actual.scales)) << what;
  ASSERT_EQ(expected.bf16, actual.bf16) << what;
  ASSERT_TRUE(testing::same_bits(expected.fp32, actual.fp32)) << what;
}

std::vector<uint32_t> all_group_sizes() { return {0, 32, 64, 128, 256}; }

TEST(QuantizeInt8, VectorizedMatchesReferenceBitForBit) {
  std::vector<Shape> shapes = testing::odd_shapes();
  shapes.push_back({300, 301});  // large enough to be split across threads
  for (const Shape shape : shapes) {
    const std::vector<float> fp32 = testing::special_matrix(shape.rows, shape.cols, 11);
    std::vector<uint16_t> bf16(fp32.size());
    for (std::size_t i = 0; i < fp32.size(); ++i) bf16[i] = testing::bf16_truncate(fp32[i]);
    for (const uint32_t group : all_group_sizes()) {
      for (const Rounding rounding : {Rounding::kNearestEven, Rounding::kStochastic}) {
        for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
          const void *src = dtype == DType::kFloat32 ? static_cast<const void *>(fp32.data())
                                                     : static_cast<const void *>(bf16.data());
          const QuantizeOptions options{group, rounding, 1234};
          const Quantized expected = round_trip(src, dtype, shape, options, CpuExec{CpuImpl::kReference, 1});
          for (const CpuExec &exec : testing::fast_execs()) {
            expect_identical(expected, round_trip(src, dtype, shape, options, exec),
                             std::to_string(shape.rows) + "x" + std::to_string(shape.cols) + " group " +
                                 std::to_string(group) + " " + dtype_name(dtype) +
                                 (rounding == Rounding::kStochastic ? " stochastic " : " rne ") +
                                 testing::exec_name(exec));
          }
        }
      }
    }
  }
}

TEST(QuantizeInt8, SpecialRowsFollowTheDocumentedRules) {
  const Shape shape{8, 67};
  const std::vector<float> x = testing::special_matrix(shape.rows, shape.cols, 5);
  for (const CpuExec exec : {CpuExec{CpuImpl::kReference, 1}, CpuExec{CpuImpl::kVectorized, 2}}) {
    const Quantized q = round_trip(x.data(), DType::kFloat32, shape, QuantizeOptions{}, exec);
    // Row 0 is all zero: scale 1, zero codes, exact zeros back.
    EXPECT_EQ(q.scales[0], 1.0f);
    for (std::size_t c = 0; c < shape.cols; ++c) EXPECT_EQ(q.fp32[c], 0.0f);
    // Rows 1-3 hold NaN / +Inf / -Inf: the whole row is poisoned.
    for (std::size_t r = 1; r <= 3; ++r) {
      EXPECT_TRUE(std::isnan(q.scales[r])) << "row " << r;
      for (std::size_t c = 0; c < shape.cols; ++c) {
        EXPECT_EQ(q.codes[r * shape.cols + c], 0);
        EXPECT_TRUE(std::isnan(q.fp32[r * shape.cols + c]));
      }
    }
    // Finite rows: the largest |x| maps to +-127 and every error is at most half a step.
    for (std::size_t r = 4; r < shape.rows; ++r) {
      float absmax = 0.0f;
      for (std::size_t c = 0; c < shape.cols; ++c) absmax = std::max(absmax, std::fabs(x[r * shape.cols + c]));
      const float scale = q.scales[r];
      EXPECT_EQ(scale, std::max(absmax / 127.0f, FLT_MIN)) << "row " << r;
      int max_code = 0;
      for (std::size_t c = 0; c < shape.cols; ++c) {
        const std::size_t i = r * shape.cols + c;
        max_code = std::max(max_code, std::abs(static_cast<int>(q.codes[i])));
        EXPECT_LE(std::fabs(q.fp32[i] - x[i]), 0.5f * scale * (1.0f + 1e-6f)) << "row " << r;
      }
      if (absmax / 127.0f >= FLT_MIN) {
        EXPECT_EQ(max_code, 127) << "row " << r;
      }
    }
  }
}

TEST(QuantizeInt8, GroupsHaveTheirOwnScale) {
  // Two groups of 32 in one row with very different magnitudes: per-group scales differ and
  // the small group keeps its resolution.
  std::vector<float> x(64);
  for (std::size_t i = 0; i < 32; ++i) x[i] = 100.0f * std::sin(static_cast<float>(i));
  for (std::size_t i = 32; i < 64; ++i) x[i] = 0.01f * std::sin(static_cast<float>(i));
  const Quantized q =
      round_trip(x.data(), DType::kFloat32, Shape{1, 64}, QuantizeOptions{32, Rounding::kNearestEven, 0}, CpuExec{});
  ASSERT_EQ(q.scales.size(), 2u);
  EXPECT_GT(q.scales[0] / q.scales[1], 1000.0f);
  for (std::size_t i = 32; i < 64; ++i) EXPECT_LE(std::fabs(q.fp32[i] - x[i]), 0.5f * q.scales[1] * 1.000001f);
}

TEST(QuantizeInt8, StochasticRoundingIsUnbiasedAndReproducible) {
  // absmax 127 gives scale 1; every other element is 0.3 steps, which rounds to nearest 0.
  const std::size_t n = 1 << 16;
  std::vector<float> x(n, 0.3f);
  x[0] = 127.0f;
  const QuantizeOptions stochastic{0, Rounding::kStochastic, 42};
  const Quantized a = round_trip(x.data(), DType::kFloat32, Shape{1, n}, stochastic, CpuExec{});
  const Quantized b = round_trip(x.data(), DType::kFloat32, Shape{1, n}, stochastic, CpuExec{CpuImpl::kVectorized, 1});
  EXPECT_EQ(a.codes, b.codes);
  double mean = 0.0;
  for (std::size_t i = 1; i < n; ++i) {
    ASSERT_TRUE(a.codes[i] == 0 || a.codes[i] == 1);
    mean += a.codes[i];
  }
  mean /= static_cast<double>(n - 1);
  EXPECT_NEAR(mean, 0.3, 0.01);  // 65535 draws: the standard deviation of the mean is 0.0018
  const Quantized other_seed =
      round_trip(x.data(), DType::kFloat32, Shape{1, n}, QuantizeOptions{0, Rounding::kStochastic, 43}, CpuExec{});
  EXPECT_NE(a.codes, other_seed.codes);
  const Quantized nearest = round_trip(x.data(), DType::kFloat32, Shape{1, n}, QuantizeOptions{}, CpuExec{});
  for (std::size_t i = 1; i < n; ++i) ASSERT_EQ(nearest.codes[i], 0);
}

TEST(QuantizeInt8, RoundsHalfToEven) {
  // absmax 127 -> scale 1: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2.
  const std::vector<float> x = {127.0f, 2.5f, 3.5f, -2.5f, 0.5f, -126.5f};
  for (const CpuExec exec : {CpuExec{CpuImpl::kReference, 1}, CpuExec{}}) {
    const Quantized q = round_trip(x.data(), DType::kFloat32, Shape{1, x.size()}, QuantizeOptions{}, exec);
    EXPECT_EQ(q.codes, (std::vector<int8_t>{127, 2, 4, -2, 0, -126}));
  }
}

double relative_rms_error(const std::vector<float> &x, uint32_t group) {
  const std::size_t rows = 256;
  const std::size_t cols = x.size() / rows;
  const Quantized q = round_trip(x.data(), DType::kFloat32, Shape{rows, cols},
                                 QuantizeOptions{group, Rounding::kNearestEven, 0}, CpuExec{});
  return relative_error(x.data(), DType::kFloat32, q.fp32.data(), DType::kFloat32, x.size());
}

TEST(QuantizeInt8, QualityBoundsOnSeededWeights) {
  const std::vector<float> gaussian = testing::gaussian(256 * 4096, 2024, 0.02f);
  const std::vector<float> heavy = testing::student_t3(256 * 4096, 2025);
  EXPECT_LE(relative_rms_error(gaussian, 0), 0.011);
  EXPECT_LE(relative_rms_error(gaussian, 128), 0.007);
  EXPECT_LE(relative_rms_error(heavy, 128), 0.015);
  // Smaller groups never lose accuracy on the same data.
  EXPECT_LT(relative_rms_error(gaussian, 32), relative_rms_error(gaussian, 256));
}

TEST(QuantizeInt8, ScaleCountFollowsTheLayout) {
  EXPECT_EQ(scale_count(3, 100, 0), 3u);
  EXPECT_EQ(scale_count(3, 100, 32), 12u);
  EXPECT_EQ(scale_count(3, 128, 128), 3u);
  EXPECT_EQ(scale_count(3, 129, 128), 6u);
  EXPECT_EQ(scale_count(0, 129, 128), 0u);
  EXPECT_THROW(scale_count(3, 100, 48), std::invalid_argument);
}

TEST(QuantizeInt8, RejectsBadArguments) {
  std::vector<float> x(64, 1.0f);
  std::vector<int8_t> codes(64);
  std::vector<float> scales(64);
  EXPECT_THROW(quantize_int8(x.data(), DType::kFloat32, 1, 64, QuantizeOptions{48}, codes.data(), scales.data()),
               std::invalid_argument);
  EXPECT_THROW(quantize_int8(x.data(), DType::kFloat16, 1, 32, QuantizeOptions{}, codes.data(), scales.data()),
               std::invalid_argument);
  EXPECT_THROW(quantize_int8(nullptr, DType::kFloat32, 1, 64, QuantizeOptions{}, codes.data(), scales.data()),
               std::invalid_argument);
  EXPECT_THROW(dequantize_int8_to_fp32(codes.data(), nullptr, 1, 64, 0, x.data()), std::invalid_argument);
  // Empty tensors need no buffers.
  EXPECT_NO_THROW(quantize_int8(nullptr, DType::kFloat32, 0, 64, QuantizeOptions{}, nullptr, nullptr));
}

TEST(QuantizeInt8, EmptyRowsGetUnitScalesPerRow) {
  std::vector<float> scales(4, -1.0f);
  quantize_int8(nullptr, DType::kFloat32, 4, 0, QuantizeOptions{}, nullptr, scales.data());
  EXPECT_EQ(scales, std::vector<float>(4, 1.0f));
}

}  // namespace
}  // namespace sp::kernels
