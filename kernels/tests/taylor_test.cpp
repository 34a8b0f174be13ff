// image_taylor_sums against the image build_slab() writes, decoded to bf16 as the engines decode it.
#include "sp/kernels/taylor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "sp/kernels/bf16.h"
#include "test_support.h"

namespace sp::kernels {
namespace {

// The sums over the decoded slab image of the whole tensor, element by element.
TaylorSums through_the_slab(const SlabEncoding &encoding, const std::vector<float> &master,
                            const std::vector<float> &grad, TensorShape shape) {
  const SlabTensorSource source{master.data(), shape};
  const uint64_t bytes = slab_image_bytes(encoding, &shape, 1);
  testing::AlignedBuffer image = testing::aligned_buffer(bytes, 0xAB);
  build_slab(encoding, &source, 1, image.get(), bytes);
  const SlabReadResult read = read_slab(image.get(), bytes);
  EXPECT_TRUE(read.ok) << read.error;
  // The engines decode to bf16, and blocks compute with that.
  std::vector<uint16_t> bits(master.size());
  decode_slab_tensor_to_bf16(image.get(), read.view, 0, bits.data());
  std::vector<float> decoded(master.size());
  bf16_to_fp32(bits.data(), decoded.data(), bits.size());
  TaylorSums sums;
  for (std::size_t i = 0; i < master.size(); ++i) {
    const double d = static_cast<double>(decoded[i]) - master[i];
    sums.first += grad[i] * d;
    sums.second += static_cast<double>(grad[i]) * grad[i] * d * d;
  }
  return sums;
}

const SlabEncoding kEncodings[] = {
    {SlabPrecision::kBf16, 0},  {SlabPrecision::kInt8, 0},  {SlabPrecision::kInt8, 64},
    {SlabPrecision::kNf4, 64},  {SlabPrecision::kNf4, 128}, {SlabPrecision::kNf4, 32},
};

TEST(ImageTaylorSums, EqualTheSumsOverTheDecodedSlabImage) {
  // Shapes with several chunks, a short last group, a single row and a single column.
  const TensorShape shapes[] = {{384, 384}, {1536, 100}, {1, 5000}, {700, 1}, {3, 70}};
  for (const TensorShape shape : shapes) {
    const std::size_t n = shape.rows * shape.cols;
    const std::vector<float> master = testing::student_t3(n, 7 + n);
    const std::vector<float> grad = testing::gaussian(n, 11 + n, 1e-3f);
    for (const SlabEncoding &encoding : kEncodings) {
      if (encoding.precision == SlabPrecision::kNf4 && shape.cols == 1) continue;
      SCOPED_TRACE(::testing::Message() << slab_precision_name(encoding.precision) << " group " << encoding.group_size
                                      << ", " << shape.rows << " x " << shape.cols);
      const TaylorSums expected = through_the_slab(encoding, master, grad, shape);
      const TaylorSums got = image_taylor_sums(encoding, master.data(), grad.data(), shape);
      EXPECT_NEAR(got.first, expected.first, 1e-12 * (std::abs(expected.first) + expected.second + 1e-30));
      EXPECT_NEAR(got.second, expected.second, 1e-12 * expected.second);
      EXPECT_GT(got.second, 0.0);
    }
  }
}

TEST(ImageTaylorSums, DoNotDependOnTheThreadCount) {
  const TensorShape shape{2048, 96};
  const std::vector<float> master = testing::gaussian(shape.rows * shape.cols, 3);
  const std::vector<float> grad = testing::gaussian(shape.rows * shape.cols, 4);
  for (const SlabEncoding &encoding : kEncodings) {
    const TaylorSums one = image_taylor_sums(encoding, master.data(), grad.data(), shape, {CpuImpl::kVectorized, 1});
    for (unsigned threads : {2u, 3u, 8u}) {
      const TaylorSums many =
          image_taylor_sums(encoding, master.data(), grad.data(), shape, {CpuImpl::kVectorized, threads});
      EXPECT_EQ(one.first, many.first);
      EXPECT_EQ(one.second, many.second);
    }
  }
}

TEST(ImageTaylorSums, BadInputIsRefusedAndNonFiniteValuesPropagate) {
  const std::vector<float> values(64, 1.0f);
  EXPECT_THROW(image_taylor_sums({SlabPrecision::kBf16, 64}, values.data(), values.data(), {1, 64}),
               std::invalid_argument);
  EXPECT_THROW(image_taylor_sums({SlabPrecision::kNf4, 0}, values.data(), values.data(), {1, 64}),
               std::invalid_argument);
  EXPECT_THROW(image_taylor_sums({SlabPrecision::kInt8, 0}, nullptr, values.data(), {1, 64}), std::invalid_argument);
  const TaylorSums empty = image_taylor_sums({SlabPrecision::kInt8, 0}, nullptr, nullptr, {0, 64});
  EXPECT_EQ(empty.first, 0.0);
  EXPECT_EQ(empty.second, 0.0);
  std::vector<float> grad(64, 1.0f);
  grad[5] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> master(64, 0.3f);
  const TaylorSums sums = image_taylor_sums({SlabPrecision::kNf4, 64}, master.data(), grad.data(), {1, 64});
  EXPECT_TRUE(std::isnan(sums.first));
  EXPECT_TRUE(std::isnan(sums.second));
}

}  // namespace
}  // namespace sp::kernels
