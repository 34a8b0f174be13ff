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

  for (std::uint32_t b = 0; b < n; ++b) {
    append_use(b, Phase::forward);
  }
  if (!options.backward) {
    return;
  }
  for (std::uint32_t b = n; b-- > 0;) {
    append_use(b, Phase::backward);
  }
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
