// The explicit thread partition of the vectorized CPU kernels. Work is a sequence of items
// (rows, groups, chunks) whose results do not depend on which thread computes them, so the
// thread count changes only the speed.
#pragma once

#include <algorithm>
#include <cstddef>
#include <thread>
#include <vector>

#include "sp/kernels/dtype.h"

namespace sp::kernels::detail {

inline unsigned resolve_threads(const CpuExec &exec) {
  if (exec.threads != 0) return exec.threads;
  if (exec.pool != nullptr) return std::max(1u, exec.pool->size());
  return std::max(1u, std::thread::hardware_concurrency());
}

// Calls body(begin, end) on contiguous ranges covering [0, n_items). Each thread gets at
// least min_items (so small inputs stay on the calling thread and pay no thread start-up).
// Without a pool the calling thread runs the first range. body must not throw.
template <typename Body>
void parallel_ranges(std::size_t n_items, const CpuExec &exec, std::size_t min_items, const Body &body) {
  if (n_items == 0) return;
  const std::size_t by_size = std::max<std::size_t>(1, n_items / std::max<std::size_t>(1, min_items));
  const std::size_t n_ranges = std::min<std::size_t>(resolve_threads(exec), by_size);
  if (n_ranges <= 1) {
    body(std::size_t{0}, n_items);
    return;
  }
  const std::size_t per_range = (n_items + n_ranges - 1) / n_ranges;
  if (exec.pool != nullptr) {
    exec.pool->run(n_ranges, [&](std::size_t r) {
      const std::size_t begin = std::min(n_items, r * per_range);
      const std::size_t end = std::min(n_items, begin + per_range);
      if (begin < end) body(begin, end);
    });
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(n_ranges - 1);
  for (std::size_t r = 1; r < n_ranges; ++r) {
    const std::size_t begin = std::min(n_items, r * per_range);
    const std::size_t end = std::min(n_items, begin + per_range);
    if (begin < end) workers.emplace_back([&body, begin, end] { body(begin, end); });
  }
  body(std::size_t{0}, std::min(n_items, per_range));
  for (auto &worker : workers) worker.join();
}

}  // namespace sp::kernels::detail
