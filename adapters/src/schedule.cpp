#include "sp/adapters/schedule.h"

#include <stdexcept>

#include <fmt/format.h>

namespace sp::adapters {

const char *phase_name(Phase phase) {
  switch (phase) {
    case Phase::forward:
      return "forward";
    case Phase::backward:
      return "backward";
  }
  return "unknown";
}

StepSchedule::StepSchedule(const ScheduleOptions &options) : options_(options) {
  const std::uint32_t n = options.num_blocks;
  if (n == 0) {
    throw std::invalid_argument("ScheduleOptions.num_blocks must be at least 1");
  }
  std::vector<std::uint32_t> &order = options_.order;
  if (order.empty()) {
    for (std::uint32_t b = 0; b < n; ++b) order.push_back(b);
  }
  if (order.size() != n) {
    throw std::invalid_argument(fmt::format("ScheduleOptions.order lists {} blocks where there are {}: it lists each "
                                            "block once",
                                            order.size(), n));
  }
  constexpr std::uint32_t kUnlisted = ~std::uint32_t{0};
  forward_use_.assign(n, kUnlisted);
  for (std::uint32_t use = 0; use < n; ++use) {
    const std::uint32_t b = order[use];
    if (b >= n || forward_use_[b] != kUnlisted) {
      throw std::invalid_argument(fmt::format("ScheduleOptions.order: block {} at position {} is {}", b, use,
                                              b >= n ? fmt::format("out of range (there are {} blocks)", n)
                                                     : fmt::format("listed twice (also at {})", forward_use_[b])));
    }
    forward_use_[b] = use;
  }

  for (const std::uint32_t b : order) {
    append_use(b, Phase::forward);
  }
  if (!options.backward) {
    return;
  }
  for (auto b = order.rbegin(); b != order.rend(); ++b) {
    append_use(*b, Phase::backward);
  }
}

std::uint32_t StepSchedule::backward_use(std::uint32_t block) const {
  if (!options_.backward) {
    throw std::logic_error("StepSchedule::backward_use: the schedule is forward-only");
  }
  return 2 * options_.num_blocks - 1 - forward_use(block);
}

void StepSchedule::append_use(std::uint32_t block, Phase phase) {
  const auto use = static_cast<std::uint32_t>(uses_.size());
  if (fetches_.empty() || fetches_.back().block != block) {
    fetches_.push_back(BlockFetch{block, phase, use, use});
  } else {
    fetches_.back().last_use = use;
  }
  uses_.push_back(BlockUse{block, phase, static_cast<std::uint32_t>(fetches_.size() - 1)});
}

std::string StepSchedule::describe_use(std::uint32_t use) const {
  const BlockUse &u = uses_.at(use);
  return fmt::format("block {} ({}) at use {}", u.block, phase_name(u.phase), use);
}

}  // namespace sp::adapters
