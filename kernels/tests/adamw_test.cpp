#include "sp/kernels/adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "reference.h"
#include "test_support.h"

namespace sp::kernels {
namespace {

using Image = testing::AlignedBuffer;
constexpr auto allocate = testing::aligned_buffer;

// One parameter's four buffers, seeded; copyable, so each path under test gets its own copy.
struct Param {
  TensorShape shape;
  bool decay = true;
  std::vector<float> master, grad, exp_avg, exp_avg_sq;

  AdamWTensor tensor() {
    return AdamWTensor{master.data(), grad.data(), exp_avg.data(), exp_avg_sq.data(), shape, decay};
  }
};

// Masters with the special rows (zero, NaN, Inf, huge, tiny, subnormal), Gaussian gradients
// with one NaN, and moments from a few earlier steps' worth of gradients.
Param make_param(TensorShape shape, uint64_t seed, bool decay = true) {
  Param p;
  p.shape = shape;
  p.decay = decay;
  const std::size_t n = shape.rows * shape.cols;
  p.master = testing::special_matrix(shape.rows, shape.cols, seed);
  p.grad = testing::gaussian(n, seed + 1, 0.01f);
  if (n > 3) p.grad[n / 3] = std::numeric_limits<float>::quiet_NaN();
  p.exp_avg = testing::gaussian(n, seed + 2, 0.001f);
  p.exp_avg_sq = testing::gaussian(n, seed + 3, 1e-4f);
  for (float &v : p.exp_avg_sq) v *= v;
  return p;
}

AdamWStep some_step(int64_t t = 3, double grad_scale = 0.5) {
  return make_adamw_step(AdamWHyperparameters{0.9, 0.95, 1e-8, 0.1}, 3e-3, t, grad_scale);
}

void expect_same_param(const Param &a, const Param &b, const std::string &what) {
  EXPECT_TRUE(testing::same_bits(a.master, b.master)) << what << ": masters differ";
  EXPECT_TRUE(testing::same_bits(a.exp_avg, b.exp_avg)) << what << ": exp_avg differs";
  EXPECT_TRUE(testing::same_bits(a.exp_avg_sq, b.exp_avg_sq)) << what << ": exp_avg_sq differs";
}

TEST(AdamWStep, ConstantsAreTheDoubleFormulasRoundedOnce) {
  const AdamWHyperparameters hyper{0.9, 0.95, 1e-8, 0.1};
  const AdamWStep step = make_adamw_step(hyper, 3e-3, 7, 0.25);
  EXPECT_EQ(step.beta1, 0.9f);
  EXPECT_EQ(step.beta2, 0.95f);
  EXPECT_EQ(step.eps, 1e-8f);
  EXPECT_EQ(step.step_size, static_cast<float>(3e-3 / (1.0 - std::pow(0.9, 7.0))));
  EXPECT_EQ(step.inv_bias2, static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(0.95, 7.0))));
  EXPECT_EQ(step.decay, static_cast<float>(1.0 - 3e-3 * 0.1));
  EXPECT_EQ(step.grad_scale, 0.25f);
  EXPECT_THROW(make_adamw_step(hyper, 3e-3, 0, 1.0), std::invalid_argument);
}

TEST(AdamWUpdate, OneElementByHand) {
  Param p;
  p.shape = {1, 1};
  p.master = {1.0f};
  p.grad = {0.5f};
  p.exp_avg = {0.0f};
  p.exp_avg_sq = {0.0f};
  const AdamWStep step = make_adamw_step(AdamWHyperparameters{0.9, 0.95, 1e-8, 0.1}, 1e-2, 1, 1.0);
  adamw_update(step, p.tensor());
  // First step: m = 0.1 g, v = 0.05 g^2, so the bias-corrected update is lr * g / |g| = lr.
  EXPECT_NEAR(p.exp_avg[0], 0.05f, 1e-7f);
  EXPECT_NEAR(p.exp_avg_sq[0], 0.0125f, 1e-8f);
  EXPECT_NEAR(p.master[0], 1.0f * (1.0f - 1e-3f) - 1e-2f, 1e-6f);
}

TEST(AdamWUpdate, VectorizedMatchesReferenceBitForBit) {
  for (const testing::Shape &s : testing::odd_shapes()) {
    for (bool decay : {true, false}) {
      const Param original = make_param({s.rows, s.cols}, 11 + s.rows, decay);
      Param expected = original;
      adamw_update(some_step(), expected.tensor(), CpuExec{CpuImpl::kReference, 1});
      for (const CpuExec &exec : testing::fast_execs()) {
        Param actual = original;
        adamw_update(some_step(), actual.tensor(), exec);
        expect_same_param(actual, expected,
                          std::to_string(s.rows) + "x" + std::to_string(s.cols) + " " + testing::exec_name(exec));
      }
    }
  }
}

TEST(AdamWUpdate, RejectsNullBuffersByName) {
  Param p = make_param({4, 4}, 5);
  AdamWTensor t = p.tensor();
  t.exp_avg_sq = nullptr;
  try {
    adamw_update(some_step(), t);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument &e) {
    EXPECT_NE(std::string(e.what()).find("exp_avg_sq"), std::string::npos) << e.what();
  }
  Param empty;
  empty.shape = {0, 7};
  EXPECT_NO_THROW(adamw_update(some_step(), empty.tensor()));
}

// bf16 moments: a Param's fp32 moments narrowed, with their own storage.
struct Bf16Moments {
  std::vector<uint16_t> exp_avg, exp_avg_sq;
  Rounding rounding;
  explicit Bf16Moments(const Param &p, Rounding r) : rounding(r) {
    for (float x : p.exp_avg) exp_avg.push_back(testing::bf16_truncate(x));
    for (float x : p.exp_avg_sq) exp_avg_sq.push_back(testing::bf16_truncate(x));
  }
  AdamWTensor tensor(Param &p) {
    AdamWTensor t = p.tensor();
    t.exp_avg = exp_avg.data();
    t.exp_avg_sq = exp_avg_sq.data();
    t.moment_dtype = DType::kBFloat16;
    t.moment_rounding = rounding;
    t.moment_seed = 77;
    return t;
  }
};

TEST(AdamWUpdate, Bf16MomentsMatchTheReferenceOnEveryThreadCount) {
  for (Rounding rounding : {Rounding::kNearestEven, Rounding::kStochastic}) {
    for (const testing::Shape &s : testing::odd_shapes()) {
      const Param original = make_param({s.rows, s.cols}, 31 + s.cols);
      Param expected = original;
      Bf16Moments expected_moments(original, rounding);
      adamw_update(some_step(), expected_moments.tensor(expected), CpuExec{CpuImpl::kReference, 1});
      for (const CpuExec &exec : testing::fast_execs()) {
        Param actual = original;
        Bf16Moments moments(original, rounding);
        adamw_update(some_step(), moments.tensor(actual), exec);
        const std::string what = std::to_string(s.rows) + "x" + std::to_string(s.cols) + " " + testing::exec_name(exec);
        EXPECT_TRUE(testing::same_bits(actual.master, expected.master)) << what;
        EXPECT_EQ(moments.exp_avg, expected_moments.exp_avg) << what;
        EXPECT_EQ(moments.exp_avg_sq, expected_moments.exp_avg_sq) << what;
      }
    }
  }
}

// Why bf16 moments need stochastic rounding: with beta2 = 0.999 and a steady gradient, v's
// per-step change falls below half a bf16 ulp long before v reaches g^2, and rounding to
// nearest then stops it; stochastic rounding keeps the expected value on the fp32 course.
TEST(AdamWUpdate, StochasticRoundingKeepsSmallMomentUpdatesThatNearestEvenErases) {
  const std::size_t n = 4096;
  Param fp32;
  fp32.shape = {1, n};
  fp32.master.assign(n, 0.0f);
  fp32.grad.assign(n, 1.0f);
  fp32.exp_avg.assign(n, 0.0f);
  fp32.exp_avg_sq.assign(n, 0.0f);
  Param nearest = fp32, stochastic = fp32;
  Bf16Moments nearest_moments(nearest, Rounding::kNearestEven), stochastic_moments(stochastic, Rounding::kStochastic);
  const AdamWHyperparameters hyper{0.9, 0.999, 1e-8, 0.0};
  for (int64_t t = 1; t <= 3000; ++t) {
    const AdamWStep step = make_adamw_step(hyper, 1e-6, t, 1.0);
    adamw_update(step, fp32.tensor());
    adamw_update(step, nearest_moments.tensor(nearest));
    adamw_update(step, stochastic_moments.tensor(stochastic));
  }
  const auto mean = [](const std::vector<uint16_t> &bits) {
    double sum = 0;
    for (uint16_t b : bits) {
      const uint32_t u = static_cast<uint32_t>(b) << 16;
      float x;
      std::memcpy(&x, &u, sizeof x);
      sum += x;
    }
    return sum / static_cast<double>(bits.size());
  };
  const double exact = fp32.exp_avg_sq[0];  // 1 - 0.999^3000 = 0.950
  EXPECT_NEAR(exact, 1.0 - std::pow(0.999, 3000.0), 1e-3);
  EXPECT_LT(mean(nearest_moments.exp_avg_sq), 0.75 * exact) << "round to nearest stalls";
  EXPECT_NEAR(mean(stochastic_moments.exp_avg_sq), exact, 0.01 * exact) << "stochastic rounding follows fp32";
}

TEST(AdamWUpdateSlab, Bf16MomentsFusedEqualsUpdateThenBuild) {
  const SlabEncoding encoding{SlabPrecision::kInt8, 64, Rounding::kNearestEven, 0};
  const std::vector<TensorShape> shapes = {{257, 259}, {64, 1100}, {1, 7}};
  std::vector<Param> fused, unfused_params;
  for (std::size_t i = 0; i < shapes.size(); ++i) fused.push_back(make_param(shapes[i], 90 + i));
  unfused_params = fused;
  std::vector<Bf16Moments> fused_moments, unfused_moments;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    fused_moments.emplace_back(fused[i], Rounding::kStochastic);
    unfused_moments.emplace_back(fused[i], Rounding::kStochastic);
  }
  const uint64_t bytes = slab_image_bytes(encoding, shapes.data(), shapes.size());
  Image a = allocate(bytes, 1), b = allocate(bytes, 2);
  std::vector<AdamWTensor> fused_tensors, unfused_tensors;
  std::vector<SlabTensorSource> sources;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    fused_tensors.push_back(fused_moments[i].tensor(fused[i]));
    unfused_tensors.push_back(unfused_moments[i].tensor(unfused_params[i]));
    sources.push_back({unfused_params[i].master.data(), shapes[i]});
  }
  adamw_update_slab(encoding, some_step(), fused_tensors.data(), fused_tensors.size(), a.get(), bytes,
                    CpuExec{CpuImpl::kVectorized, 2});
  for (const AdamWTensor &t : unfused_tensors) adamw_update(some_step(), t, CpuExec{CpuImpl::kReference, 1});
  build_slab(encoding, sources.data(), sources.size(), b.get(), bytes);
  EXPECT_EQ(std::memcmp(a.get(), b.get(), bytes), 0);
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    EXPECT_TRUE(testing::same_bits(fused[i].master, unfused_params[i].master)) << i;
    EXPECT_EQ(fused_moments[i].exp_avg_sq, unfused_moments[i].exp_avg_sq) << i;
  }
}

std::vector<SlabEncoding> fused_encodings() {
  std::vector<SlabEncoding> encodings;
  encodings.push_back(SlabEncoding{SlabPrecision::kBf16, 0, Rounding::kNearestEven, 0});
  encodings.push_back(SlabEncoding{SlabPrecision::kBf16, 0, Rounding::kStochastic, 9});
  for (uint32_t g : {0u, 32u, 64u, 256u}) {
    encodings.push_back(SlabEncoding{SlabPrecision::kInt8, g, Rounding::kNearestEven, 0});
  }
  encodings.push_back(SlabEncoding{SlabPrecision::kInt8, 64, Rounding::kStochastic, 17});
  for (uint32_t g : {32u, 64u, 256u}) {
    encodings.push_back(SlabEncoding{SlabPrecision::kNf4, g, Rounding::kNearestEven, 0});
  }
  return encodings;
}

std::string encoding_name(const SlabEncoding &e) {
  return std::string(slab_precision_name(e.precision)) + "/g" + std::to_string(e.group_size) +
         (e.rounding == Rounding::kStochastic ? "/stochastic" : "");
}

// A block: a GPT block's shapes plus the odd ones, a 1-D bias without decay among them. Wide
// enough (64 x 1100 > 2^15 elements per thread) that every thread count splits the rows.
std::vector<Param> make_block() {
  const std::vector<TensorShape> shapes = {{257, 259}, {1, 7}, {0, 5}, {128, 129}, {1, 1},
                                           {9, 1000},  {1, 300}, {64, 1100}, {5, 0}};
  std::vector<Param> params;
  for (std::size_t i = 0; i < shapes.size(); ++i) params.push_back(make_param(shapes[i], 40 + 7 * i, i != 6));
  return params;
}

std::vector<AdamWTensor> tensors_of(std::vector<Param> &params) {
  std::vector<AdamWTensor> tensors;
  for (Param &p : params) tensors.push_back(p.tensor());
  return tensors;
}

std::vector<TensorShape> shapes_of(const std::vector<Param> &params) {
  std::vector<TensorShape> shapes;
  for (const Param &p : params) shapes.push_back(p.shape);
  return shapes;
}

// The unfused path, as the trainer ran it before the fused pass: update each tensor, then
// build the image from the updated masters.
uint64_t unfused(const SlabEncoding &encoding, const AdamWStep &step, std::vector<Param> &params, uint8_t *image,
                 uint64_t capacity, const CpuExec &exec) {
  std::vector<SlabTensorSource> sources;
  for (Param &p : params) {
    adamw_update(step, p.tensor(), exec);
    sources.push_back(SlabTensorSource{p.master.data(), p.shape});
  }
  return build_slab(encoding, sources.data(), sources.size(), image, capacity, exec);
}

TEST(AdamWUpdateSlab, FusedEqualsUpdateThenBuildOnEveryEncodingAndThreadCount) {
  const std::vector<Param> original = make_block();
  const std::vector<TensorShape> shapes = shapes_of(original);
  for (const SlabEncoding &encoding : fused_encodings()) {
    const uint64_t bytes = slab_image_bytes(encoding, shapes.data(), shapes.size());
    std::vector<Param> expected = original;
    Image expected_image = allocate(bytes, 0xA5);
    ASSERT_EQ(unfused(encoding, some_step(), expected, expected_image.get(), bytes, CpuExec{CpuImpl::kReference, 1}),
              bytes);
    std::vector<CpuExec> execs = testing::fast_execs();
    execs.push_back(CpuExec{CpuImpl::kReference, 1});
    for (const CpuExec &exec : execs) {
      const std::string what = encoding_name(encoding) + " " + testing::exec_name(exec);
      std::vector<Param> actual = original;
      std::vector<AdamWTensor> tensors = tensors_of(actual);
      // A dirty buffer: every byte of the image must be written.
      Image image = allocate(bytes, 0x5A);
      ASSERT_EQ(adamw_update_slab(encoding, some_step(), tensors.data(), tensors.size(), image.get(), bytes, exec),
                bytes)
          << what;
      EXPECT_EQ(std::memcmp(image.get(), expected_image.get(), bytes), 0) << what << ": images differ";
      for (std::size_t i = 0; i < actual.size(); ++i) expect_same_param(actual[i], expected[i], what);
      EXPECT_TRUE(read_slab(image.get(), bytes).ok) << what;
    }
  }
}

TEST(AdamWUpdateSlab, StaysEqualOverSeveralSteps) {
  const SlabEncoding encoding{SlabPrecision::kNf4, 64, Rounding::kNearestEven, 0};
  std::vector<Param> fused = make_block();
  std::vector<Param> reference = fused;
  const std::vector<TensorShape> shapes = shapes_of(fused);
  const uint64_t bytes = slab_image_bytes(encoding, shapes.data(), shapes.size());
  Image a = allocate(bytes, 0), b = allocate(bytes, 0);
  for (int64_t t = 1; t <= 4; ++t) {
    std::vector<AdamWTensor> tensors = tensors_of(fused);
    adamw_update_slab(encoding, some_step(t, 1.0 / t), tensors.data(), tensors.size(), a.get(), bytes,
                      CpuExec{CpuImpl::kVectorized, 2});
    unfused(encoding, some_step(t, 1.0 / t), reference, b.get(), bytes, CpuExec{CpuImpl::kVectorized, 1});
    EXPECT_EQ(std::memcmp(a.get(), b.get(), bytes), 0) << "step " << t;
  }
  for (std::size_t i = 0; i < fused.size(); ++i) expect_same_param(fused[i], reference[i], "after 4 steps");
}

TEST(AdamWUpdateSlab, ValidatesEverythingBeforeTouchingTheWeights) {
  const SlabEncoding encoding{SlabPrecision::kInt8, 64, Rounding::kNearestEven, 0};
  const std::vector<Param> original = make_block();
  const std::vector<TensorShape> shapes = shapes_of(original);
  const uint64_t bytes = slab_image_bytes(encoding, shapes.data(), shapes.size());
  Image image = allocate(bytes, 0);
  const auto expect_rejected = [&](const char *what, auto mutate, const std::string &needle) {
    std::vector<Param> params = original;
    std::vector<AdamWTensor> tensors = tensors_of(params);
    SlabEncoding e = encoding;
    uint64_t capacity = bytes;
    mutate(tensors, e, capacity);
    try {
      adamw_update_slab(e, some_step(), tensors.data(), tensors.size(), image.get(), capacity);
      ADD_FAILURE() << what << ": expected std::invalid_argument";
    } catch (const std::invalid_argument &error) {
      EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << what << ": " << error.what();
    }
    for (std::size_t i = 0; i < params.size(); ++i) expect_same_param(params[i], original[i], what);
  };
  expect_rejected(
      "small buffer", [](auto &, auto &, uint64_t &capacity) { capacity -= 1; }, "bytes");
  expect_rejected(
      "bad group size", [](auto &, SlabEncoding &e, uint64_t &) { e.group_size = 48; }, "group_size 48");
  expect_rejected(
      "null gradient", [](std::vector<AdamWTensor> &t, auto &, uint64_t &) { t[7].grad = nullptr; }, "tensor 7");
}

}  // namespace
}  // namespace sp::kernels
