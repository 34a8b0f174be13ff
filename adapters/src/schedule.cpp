#include "sp/adapters/schedule.h"

#include <stdexcept>

#include <fmt/format.h>

namespace sp::adapters {

const char *phase_name(Phase phase) {
  switch (phase) {
    case Phase::forward:
      return "forward";
    case Phase::recompute:
      return "recompute";
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
  if (options.recompute_segment != 0 && !options.backward) {
    throw std::invalid_argument("ScheduleOptions.recompute_segment needs a backward pass (backward is false)");
  }
  if (options.recompute_segment > n) {
    throw std::invalid_argument(fmt::format("ScheduleOptions.recompute_segment is {} but there are only {} blocks",
                                            options.recompute_segment, n));
  }

  for (std::uint32_t b = 0; b < n; ++b) {
    append_use(b, Phase::forward);
  }
  if (!options.backward) {
    return;
  }
  const std::uint32_t segment = options.recompute_segment == 0 ? n : options.recompute_segment;
  const std::uint32_t last_segment_start = (n - 1) / segment * segment;
  for (std::uint32_t start = last_segment_start;; start -= segment) {
    const std::uint32_t end = std::min(start + segment, n);
    // The last segment's activations are still live after the forward pass.
    if (options.recompute_segment != 0 && start != last_segment_start) {
      for (std::uint32_t b = start; b < end; ++b) {
        append_use(b, Phase::recompute);
      }
    }
    for (std::uint32_t b = end; b-- > start;) {
      append_use(b, Phase::backward);
    }
    if (start == 0) {
      break;
    }
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
