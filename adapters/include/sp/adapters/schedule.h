// The order in which one training step needs its blocks, and the fetches that serve it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sp::adapters {

// A block's backward use covers the re-run of its forward that rebuilds its activations.
enum class Phase : std::uint8_t { forward, backward };

const char *phase_name(Phase phase);

struct ScheduleOptions {
  std::uint32_t num_blocks = 0;
  bool backward = true;  // false: a forward-only step (evaluation)
  // The blocks in the order the forward uses them, each once; the backward uses them in
  // reverse. Empty: 0, 1, ..., num_blocks - 1.
  std::vector<std::uint32_t> order;
};

// One use of a block's weights by the trainer, and the fetch that brings them.
struct BlockUse {
  std::uint32_t block = 0;
  Phase phase = Phase::forward;
  std::uint32_t fetch = 0;
};

// Consecutive uses of the same block share one fetch: the block stays in its slot (the
// last forward block is also the first backward block).
struct BlockFetch {
  std::uint32_t block = 0;
  Phase phase = Phase::forward;  // phase of its first use
  std::uint32_t first_use = 0;
  std::uint32_t last_use = 0;
};

class StepSchedule {
 public:
  // Throws std::invalid_argument naming the option when the options are inconsistent.
  explicit StepSchedule(const ScheduleOptions &options);

  const ScheduleOptions &options() const { return options_; }
  const std::vector<BlockUse> &uses() const { return uses_; }
  const std::vector<BlockFetch> &fetches() const { return fetches_; }
  // The block's forward use, which is its position in the order, and its backward use (the
  // backward needs the block at use 2 * num_blocks - 1 - forward_use(block)). Throws
  // std::out_of_range for a block out of range, std::logic_error for a forward-only schedule's
  // backward use.
  std::uint32_t forward_use(std::uint32_t block) const { return forward_use_.at(block); }
  std::uint32_t backward_use(std::uint32_t block) const;
  // "block 3 (backward) at use 12"
  std::string describe_use(std::uint32_t use) const;

 private:
  void append_use(std::uint32_t block, Phase phase);

  ScheduleOptions options_;
  std::vector<BlockUse> uses_;
  std::vector<BlockFetch> fetches_;
  std::vector<std::uint32_t> forward_use_;  // per block
};

}  // namespace sp::adapters
