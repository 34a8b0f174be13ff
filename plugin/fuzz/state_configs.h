// The two policy configs whose states the plugin-state harness imports, shared by the harness and
// its seed writer so that the seeds are states of the configs the harness creates.
#pragma once

#include <cstdint>

namespace sp::fuzz {

constexpr std::uint32_t kStateBlocks = 6;  // the blocks of plugin/selective_precision/tests/data/*.state

// The config of the committed 1.0.0 state fixtures (state_fixture_writer.cpp).
constexpr const char *kStateFixtureConfig =
    "selective_precision:\n  warmup_steps: 3\n  update_interval_steps: 2\n  min_steps_between_switches: 4\n"
    "  history_window: 3\n  telemetry_enabled: false\n  log_decisions: false\n  force_bf16_blocks: [5]\n";
// Policy v2 with NF4 as a tier and the loss guard on.
constexpr const char *kStateGuardConfig =
    "selective_precision:\n  mode: dynamic\n  tiers: [bf16, int8, nf4]\n  bf16_threshold: 0.6\n  int8_threshold: 0.45\n"
    "  nf4_threshold: 0.3\n  warmup_steps: 1\n"
    "  update_interval_steps: 1\n  min_steps_between_switches: 1\n  history_window: 4\n"
    "  telemetry_enabled: false\n  log_decisions: false\n  force_int8_blocks: [0]\n"
    "  loss_guard:\n    enabled: true\n    window: 4\n    blame_steps: 2\n    penalty_steps: 3\n";

}  // namespace sp::fuzz
