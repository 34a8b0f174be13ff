// Seeded inputs and the special cases every kernel test walks through.
#pragma once

#include <cmath>
#include <cstdlib>
#include <memory>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "sp/kernels/dtype.h"

namespace sp::kernels::testing {

struct AlignedFree {
  void operator()(uint8_t *p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<uint8_t[], AlignedFree>;

// `bytes` (rounded up to 256, plus 256 of slack) at a 256-byte boundary, every byte `fill`: an
// image buffer whose old contents a builder must overwrite.
inline AlignedBuffer aligned_buffer(uint64_t bytes, uint8_t fill) {
  const uint64_t rounded = (bytes + 255) / 256 * 256 + 256;
  AlignedBuffer buffer(static_cast<uint8_t *>(std::aligned_alloc(256, rounded)));
  std::memset(buffer.get(), fill, rounded);
  return buffer;
}

inline uint16_t bf16_truncate(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return static_cast<uint16_t>(u >> 16);
}

inline std::vector<float> gaussian(std::size_t n, uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> values(n);
  for (float &v : values) v = dist(rng);
  return values;
}

inline std::vector<float> student_t3(std::size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::student_t_distribution<float> dist(3.0f);
  std::vector<float> values(n);
  for (float &v : values) v = dist(rng);
  return values;
}

// A rows x cols matrix exercising the special cases: row 0 all zero, row 1 with a NaN,
// row 2 with +Inf, row 3 with -Inf, row 4 huge (1e30), row 5 tiny (1e-30), row 6 subnormal
// (1e-40), the rest Gaussian. Rows that do not exist are skipped.
inline std::vector<float> special_matrix(std::size_t rows, std::size_t cols, uint64_t seed) {
  std::vector<float> values = gaussian(rows * cols, seed);
  const auto row = [&](std::size_t r) { return values.data() + r * cols; };
  if (cols == 0) return values;
  if (rows > 0) std::fill(row(0), row(0) + cols, 0.0f);
  if (rows > 1) row(1)[cols / 2] = std::numeric_limits<float>::quiet_NaN();
  if (rows > 2) row(2)[cols - 1] = std::numeric_limits<float>::infinity();
  if (rows > 3) row(3)[0] = -std::numeric_limits<float>::infinity();
  if (rows > 4)
    for (std::size_t c = 0; c < cols; ++c) row(4)[c] *= 1e30f;
  if (rows > 5)
    for (std::size_t c = 0; c < cols; ++c) row(5)[c] *= 1e-30f;
  if (rows > 6)
    for (std::size_t c = 0; c < cols; ++c) row(6)[c] *= 1e-40f;
  return values;
}

struct Shape {
  std::size_t rows;
  std::size_t cols;
};

// The odd sizes of the issue (1, 7, 257 x 259, 128 x 128 + 1), a wide row and empty tensors.
inline std::vector<Shape> odd_shapes() {
  return {{1, 1}, {1, 7}, {7, 1}, {257, 259}, {128, 129}, {129, 128}, {9, 1000}, {0, 5}, {5, 0}, {0, 0}};
}

inline std::vector<CpuExec> fast_execs() {
  return {CpuExec{CpuImpl::kVectorized, 1}, CpuExec{CpuImpl::kVectorized, 2}, CpuExec{CpuImpl::kVectorized, 3}};
}

inline std::string exec_name(const CpuExec &exec) {
  return std::string(exec.impl == CpuImpl::kReference ? "reference" : "vectorized") + "/" +
         std::to_string(exec.threads) + "t";
}

// Compares float bit patterns (NaN == NaN when the bits agree).
inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

inline bool same_bits(const std::vector<float> &a, const std::vector<float> &b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!same_bits(a[i], b[i])) return false;
  }
  return true;
}

}  // namespace sp::kernels::testing
