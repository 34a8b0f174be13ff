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
  // "block 3 (backward) at use 12"
  std::string describe_use(std::uint32_t use) const;

 private:
  void append_use(std::uint32_t block, Phase phase);

  ScheduleOptions options_;
  std::vector<BlockUse> uses_;
  std::vector<BlockFetch> fetches_;
};

}  // namespace sp::adapters
