// Every example policy file that users copy must load.
#include "sp/policy/config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace sp::policy {
namespace {

TEST(PolicyExampleConfigs, EveryFileInConfigsPolicyLoadsFor48Blocks) {
  std::size_t files = 0;
  for (const auto &entry : std::filesystem::directory_iterator(SP_POLICY_CONFIG_DIR)) {
    if (entry.path().extension() != ".yaml") continue;
    std::ifstream in(entry.path());
    std::stringstream text;
    text << in.rdbuf();
    EXPECT_NO_THROW(parse_policy_config(text.str(), 48)) << entry.path();
    ++files;
  }
  EXPECT_GE(files, 3u);
}

TEST(PolicyExampleConfigs, TheDynamicExampleSpellsOutTheDefaults) {
  std::ifstream in(SP_POLICY_CONFIG_DIR "/dynamic.yaml");
  std::stringstream text;
  text << in.rdbuf();
  const PolicySettings example = parse_policy_config(text.str(), 48).config;
  const PolicySettings defaults;
  EXPECT_EQ(example.bf16_threshold, defaults.bf16_threshold);
  EXPECT_EQ(example.int8_threshold, defaults.int8_threshold);
  EXPECT_EQ(example.hysteresis_margin, defaults.hysteresis_margin);
  EXPECT_EQ(example.grad_weight, defaults.grad_weight);
  EXPECT_EQ(example.error_weight, defaults.error_weight);
  EXPECT_EQ(example.grad_sensitivity_threshold, defaults.grad_sensitivity_threshold);
  EXPECT_EQ(example.quant_error_threshold, defaults.quant_error_threshold);
  EXPECT_EQ(example.warmup_steps, defaults.warmup_steps);
  EXPECT_EQ(example.history_window, defaults.history_window);
  EXPECT_EQ(example.update_interval_steps, defaults.update_interval_steps);
  EXPECT_EQ(example.min_steps_between_switches, defaults.min_steps_between_switches);
  EXPECT_EQ(example.telemetry_file, defaults.telemetry_file);
}

}  // namespace
}  // namespace sp::policy
