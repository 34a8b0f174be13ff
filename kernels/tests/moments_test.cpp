#include "sp/kernels/moments.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "test_support.h"

namespace sp::kernels {
namespace {

uint16_t to_fp16(float x) {
  // Finite, normal-range values only (what the tests feed it), round to nearest even.
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t sign = (u >> 16) & 0x8000u;
  if (std::isnan(x)) return 0x7E00;
  if (std::isinf(x)) return static_cast<uint16_t>(sign | 0x7C00u);
  const float a = std::fabs(x);
  if (a < 6.103515625e-05f) return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  const uint32_t abs_bits = u & 0x7FFFFFFFu;
  const uint32_t rounded = abs_bits + 0xFFFu + ((abs_bits >> 13) & 1u);
  const uint32_t half = ((rounded >> 13) - (112u << 10));
  return static_cast<uint16_t>(sign | std::min(half, 0x7C00u));
}

struct Tensors {
  std::vector<std::vector<float>> fp32;
  std::vector<std::vector<uint16_t>> half;  // bf16 or fp16 bits
  std::vector<GradTensor> list;
};

// Block 0: three tensors (fp32, bf16, fp16) of odd sizes, with NaN/Inf. Block 1: no tensors.
// Block 2: one huge-magnitude and one tiny-magnitude tensor, listed out of order around block 0.
Tensors make_tensors(std::size_t scale) {
  Tensors t;
  t.fp32.push_back(testing::gaussian(257 * 259 * scale, 1));
  t.fp32[0][3] = std::numeric_limits<float>::quiet_NaN();
  t.fp32[0][100] = -std::numeric_limits<float>::infinity();
  t.fp32.push_back(testing::gaussian(7, 2));
  for (float &v : t.fp32[1]) v *= 1e15f;
  t.fp32.push_back(testing::gaussian(16384 * 3 + 1, 3));
  t.fp32.push_back(testing::gaussian(1000 * scale + 1, 4));
  for (float &v : t.fp32[3]) v *= 1e-15f;
  std::vector<uint16_t> bf16(t.fp32[2].size());
  for (std::size_t i = 0; i < bf16.size(); ++i) bf16[i] = testing::bf16_truncate(t.fp32[2][i]);
  bf16[5] = 0x7F80;  // +Inf
  const std::vector<float> fp16_source = testing::gaussian(129 * 128, 5);
  std::vector<uint16_t> fp16(fp16_source.size());
  for (std::size_t i = 0; i < fp16.size(); ++i) fp16[i] = to_fp16(fp16_source[i]);
  fp16[0] = 0x7E00;  // NaN
  t.half = {bf16, fp16};
  t.list = {
      GradTensor{t.fp32[1].data(), t.fp32[1].size(), DType::kFloat32, 2},
      GradTensor{t.fp32[0].data(), t.fp32[0].size(), DType::kFloat32, 0},
      GradTensor{t.half[0].data(), t.half[0].size(), DType::kBFloat16, 0},
      GradTensor{nullptr, 0, DType::kFloat32, 0},  // empty
      GradTensor{t.half[1].data(), t.half[1].size(), DType::kFloat16, 0},
      GradTensor{t.fp32[3].data(), t.fp32[3].size(), DType::kFloat32, 2},
  };
  return t;
}

std::vector<sp_grad_moments_v1> run(const Tensors &t, uint32_t n_blocks, const CpuExec &exec) {
  std::vector<sp_grad_moments_v1> out(n_blocks);
  grad_moments(t.list.data(), t.list.size(), n_blocks, out.data(), exec);
  return out;
}

TEST(GradMoments, VectorizedMatchesReference) {
  const Tensors t = make_tensors(1);
  const auto expected = run(t, 3, CpuExec{CpuImpl::kReference, 1});
  EXPECT_EQ(expected[0].nonfinite, 4u);
  EXPECT_EQ(expected[1].count, 0u);
  for (const CpuExec &exec : testing::fast_execs()) {
    const auto actual = run(t, 3, exec);
    for (uint32_t b = 0; b < 3; ++b) {
      SCOPED_TRACE("block " + std::to_string(b) + " " + testing::exec_name(exec));
      EXPECT_EQ(actual[b].block_id, b);
      EXPECT_EQ(actual[b].reserved0, 0u);
      EXPECT_EQ(actual[b].count, expected[b].count);
      EXPECT_EQ(actual[b].nonfinite, expected[b].nonfinite);
      EXPECT_EQ(actual[b].max_abs, expected[b].max_abs);
      // fp32 lanes against double: relative error of the sums stays near fp32 epsilon * sqrt(n).
      EXPECT_NEAR(actual[b].sum_sq, expected[b].sum_sq, 2e-5 * expected[b].sum_sq);
      const double sum_scale = std::sqrt(expected[b].sum_sq * static_cast<double>(expected[b].count));
      EXPECT_NEAR(actual[b].sum, expected[b].sum, 2e-5 * sum_scale);
    }
  }
}

TEST(GradMoments, BitIdenticalForAnyThreadCountAndRun) {
  const Tensors t = make_tensors(4);
  const auto first = run(t, 3, CpuExec{CpuImpl::kVectorized, 1});
  for (const unsigned threads : {1u, 2u, 3u, 5u}) {
    const auto again = run(t, 3, CpuExec{CpuImpl::kVectorized, threads});
    ASSERT_EQ(0, std::memcmp(first.data(), again.data(), first.size() * sizeof(first[0]))) << threads;
  }
}

// A caller's pool that runs the tasks last to first on this thread: the kernels must hand it
// every piece, once, and combine the pieces in chunk order whatever order they ran in.
class BackwardsPool : public ThreadPool {
 public:
  explicit BackwardsPool(unsigned size) : size_(size) {}
  unsigned size() const override { return size_; }
  void run(std::size_t n, const std::function<void(std::size_t)> &task) const override {
    ++runs;
    tasks += n;
    for (std::size_t i = n; i-- > 0;) task(i);
  }
  mutable unsigned runs = 0;
  mutable std::size_t tasks = 0;

 private:
  unsigned size_;
};

TEST(GradMoments, RunOnACallersPoolTheyAreBitIdentical) {
  const Tensors t = make_tensors(4);
  const auto own_threads = run(t, 3, CpuExec{CpuImpl::kVectorized, 1});
  for (const unsigned size : {1u, 2u, 5u}) {
    const BackwardsPool pool(size);
    const auto pooled = run(t, 3, CpuExec{CpuImpl::kVectorized, 0, &pool});
    ASSERT_EQ(0, std::memcmp(own_threads.data(), pooled.data(), own_threads.size() * sizeof(own_threads[0]))) << size;
    if (size > 1) {
      EXPECT_EQ(pool.runs, 1u) << "one call, one run on the pool";
      EXPECT_GT(pool.tasks, 1u) << "the work was split over the pool's size";
    }
  }
}

TEST(GradMoments, NonFiniteElementsAreCountedAndExcluded) {
  const std::vector<float> g = {1.0f, -2.0f, std::numeric_limits<float>::quiet_NaN(),
                                std::numeric_limits<float>::infinity(), 3.0f};
  const GradTensor tensor{g.data(), g.size(), DType::kFloat32, 0};
  for (const CpuExec exec : {CpuExec{CpuImpl::kReference, 1}, CpuExec{}}) {
    sp_grad_moments_v1 m{};
    grad_moments(&tensor, 1, 1, &m, exec);
    EXPECT_EQ(m.count, 5u);
    EXPECT_EQ(m.nonfinite, 2u);
    EXPECT_EQ(m.sum, 2.0);
    EXPECT_EQ(m.sum_sq, 14.0);
    EXPECT_EQ(m.max_abs, 3.0);
  }
}

TEST(GradMoments, EmptyInputGivesZeroedBlocks) {
  std::vector<sp_grad_moments_v1> out(2, sp_grad_moments_v1{9, 9, 9, 9, 9, 9, 9});
  grad_moments(nullptr, 0, 2, out.data());
  for (uint32_t b = 0; b < 2; ++b) {
    EXPECT_EQ(out[b].block_id, b);
    EXPECT_EQ(out[b].count, 0u);
    EXPECT_EQ(out[b].sum_sq, 0.0);
  }
  EXPECT_NO_THROW(grad_moments(nullptr, 0, 0, nullptr));
}

TEST(GradMoments, RejectsBadInput) {
  const std::vector<float> g(4, 1.0f);
  sp_grad_moments_v1 m{};
  const GradTensor bad_block{g.data(), g.size(), DType::kFloat32, 1};
  EXPECT_THROW(grad_moments(&bad_block, 1, 1, &m), std::invalid_argument);
  const GradTensor null_data{nullptr, 4, DType::kFloat32, 0};
  EXPECT_THROW(grad_moments(&null_data, 1, 1, &m), std::invalid_argument);
  const GradTensor bad_dtype{g.data(), g.size(), static_cast<DType>(7), 0};
  EXPECT_THROW(grad_moments(&bad_dtype, 1, 1, &m), std::invalid_argument);
}

}  // namespace
}  // namespace sp::kernels
