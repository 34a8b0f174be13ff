#include "policy_test_support.h"

#include "sp/policy/config.h"
#include "sp/policy/errors.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace sp::policy::testing {
namespace {

constexpr std::uint32_t kBlocks = 48;

TEST(PolicySettings, EmptySectionTakesTheSeedDefaults) {
  const ParsedConfig parsed = parse_policy_config("selective_precision: {}\n", kBlocks);
  const PolicySettings &config = parsed.config;
  EXPECT_EQ(parsed.section_path, "selective_precision");
  EXPECT_TRUE(config.enabled);
  EXPECT_EQ(config.mode, Mode::dynamic);
  EXPECT_EQ(config.bf16_threshold, 0.6);
  EXPECT_EQ(config.int8_threshold, 0.3);
  EXPECT_EQ(config.ambiguous_default, SP_PRECISION_BF16);
  EXPECT_EQ(config.hysteresis_margin, 0.1);
  EXPECT_EQ(config.grad_weight, 0.7);
  EXPECT_EQ(config.error_weight, 0.3);
  EXPECT_EQ(config.grad_sensitivity_threshold, 2.0);
  EXPECT_TRUE(config.run_calibration);
  EXPECT_EQ(config.calibration_samples, 4);
  EXPECT_EQ(config.quant_error_threshold, 0.05);
  EXPECT_EQ(config.warmup_steps, 10);
  EXPECT_EQ(config.history_window, 5);
  EXPECT_EQ(config.update_interval_steps, 10);
  EXPECT_EQ(config.min_steps_between_switches, 20);
  EXPECT_TRUE(config.force_blocks[SP_PRECISION_BF16].empty());
  EXPECT_TRUE(config.force_blocks[SP_PRECISION_INT8].empty());
  EXPECT_TRUE(config.log_decisions);
  EXPECT_TRUE(config.telemetry_enabled);
  EXPECT_EQ(config.telemetry_file, "selective_precision_telemetry.jsonl");
  EXPECT_TRUE(config.nonfinite_to_bf16);
  EXPECT_TRUE(parsed.warnings.empty());
}

TEST(PolicySettings, V2KeysHaveTheirProvisionalDefaults) {
  const PolicySettings config = parse_policy_config("selective_precision: {}\n", kBlocks).config;
  EXPECT_EQ(config.tiers, SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8));
  EXPECT_TRUE(config.force_blocks[SP_PRECISION_NF4].empty());
  EXPECT_EQ(config.nf4_threshold, 0.15);
  EXPECT_EQ(config.nf4_quant_error_threshold, 0.15);
  EXPECT_EQ(config.nf4_group_size, 64);
  EXPECT_FALSE(config.loss_guard.enabled);
  EXPECT_EQ(config.loss_guard.window, 20);
  EXPECT_EQ(config.loss_guard.sigmas, 3.0);
  EXPECT_EQ(config.loss_guard.min_rise, 0.05);
  EXPECT_EQ(config.loss_guard.blame_steps, 10);
  EXPECT_EQ(config.loss_guard.penalty_steps, 100);
}

TEST(PolicySettings, V2KeysAreRead) {
  const PolicySettings config = parse_policy_config(
                                  "selective_precision:\n  tiers: [nf4, bf16]\n  nf4_threshold: 0.12\n"
                                  "  force_nf4_blocks: [3]\n  loss_guard: {enabled: true, window: 8, sigmas: 2.5, "
                                  "min_rise: 0.02, blame_steps: 4, penalty_steps: 0}\n",
                                  kBlocks)
                                  .config;
  EXPECT_EQ(config.tiers, SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_NF4));
  EXPECT_EQ(config.nf4_threshold, 0.12);
  EXPECT_EQ(config.force_blocks[SP_PRECISION_NF4], std::vector<std::uint32_t>{3});
  EXPECT_TRUE(config.loss_guard.enabled);
  EXPECT_EQ(config.loss_guard.window, 8);
  EXPECT_EQ(config.loss_guard.sigmas, 2.5);
  EXPECT_EQ(config.loss_guard.min_rise, 0.02);
  EXPECT_EQ(config.loss_guard.blame_steps, 4);
  EXPECT_EQ(config.loss_guard.penalty_steps, 0);
}

TEST(PolicySettings, Nf4ThresholdRelationsOnlyApplyWhenNf4IsATier) {
  EXPECT_NO_THROW(parse_policy_config("selective_precision:\n  nf4_threshold: 0.5\n", kBlocks));
}

TEST(PolicySettings, ASectionWithAllKeysCommentedOutTakesTheDefaults) {
  EXPECT_EQ(parse_policy_config("selective_precision:\n  # mode: static\n", kBlocks).config.mode, Mode::dynamic);
}

TEST(PolicySettings, ReadsTheSectionOfATrainingConfig) {
  const std::string yaml = R"(
model: {name: tiny}
memory:
  stagehand:
    block_swap: true
    selective_precision:
      enabled: true
      mode: static
      warmup_steps: 3
      bf16_threshold: 0.7
      int8_threshold: 0.2
      ambiguous_default: int8
      force_int8_blocks: [0, 1, 47]
      telemetry_file: out/sp.jsonl
      nonfinite_to_bf16: false
)";
  const ParsedConfig parsed = parse_policy_config(yaml, kBlocks);
  EXPECT_EQ(parsed.section_path, "memory.stagehand.selective_precision");
  EXPECT_EQ(parsed.config.mode, Mode::static_lists);
  EXPECT_EQ(parsed.config.warmup_steps, 3);
  EXPECT_EQ(parsed.config.bf16_threshold, 0.7);
  EXPECT_EQ(parsed.config.ambiguous_default, SP_PRECISION_INT8);
  EXPECT_EQ(parsed.config.force_blocks[SP_PRECISION_INT8], (std::vector<std::uint32_t>{0, 1, 47}));
  EXPECT_EQ(parsed.config.telemetry_file, "out/sp.jsonl");
  EXPECT_FALSE(parsed.config.nonfinite_to_bf16);
}

TEST(PolicySettings, TheSeedsJsonExampleIsValidYaml) {
  const std::string json = R"({"memory": {"stagehand": {"selective_precision": {
      "enabled": true, "mode": "dynamic", "warmup_steps": 10, "update_interval_steps": 10,
      "bf16_threshold": 0.6, "int8_threshold": 0.3}}}})";
  EXPECT_EQ(parse_policy_config(json, kBlocks).config.update_interval_steps, 10);
}

struct BadConfig {
  const char *name;
  std::string yaml;
  std::vector<std::string> message_parts;
};

std::string in_section(const std::string &settings) { return "selective_precision:\n" + settings; }

std::string in_training_config(const std::string &settings) {
  return "memory:\n  stagehand:\n    selective_precision:\n" + settings;
}

const std::string kPath = "selective_precision.";

std::vector<BadConfig> bad_configs() {
  return {
      {"EmptyText", "", {"the configuration is empty", "selective_precision"}},
      {"OnlyComments", "# nothing here\n", {"the configuration is empty"}},
      {"NoSection",
       "memory:\n  stagehand:\n    other: 1\n",
       {"no policy section", "memory.stagehand.selective_precision"}},
      {"BothSections", "selective_precision: {}\n" + in_training_config("      mode: off\n"), {"both", "exactly one"}},
      {"RootIsAList", "- 1\n- 2\n", {"must be a YAML mapping", "a list"}},
      {"SyntaxError", "selective_precision:\n  mode: [dynamic\n", {"YAML syntax error at line"}},
      {"SectionIsAScalar", "selective_precision: 5\n", {"selective_precision: expected a mapping", "'5'"}},
      {"UnknownKeyWithSuggestion",
       in_section("  bf16_treshold: 0.6\n"),
       {kPath + "bf16_treshold: unknown key", "did you mean 'bf16_threshold'?"}},
      {"UnknownKeyWithoutSuggestion", in_section("  learning_rate: 0.1\n"), {kPath + "learning_rate: unknown key"}},
      {"DuplicateKey", in_section("  mode: off\n  mode: static\n"), {kPath + "mode: the key is given twice"}},
      {"UnknownKeyInTrainingConfigNamesFullPath",
       in_training_config("      histroy_window: 5\n"),
       {"memory.stagehand.selective_precision.histroy_window: unknown key", "did you mean 'history_window'?"}},
      {"ThresholdIsAString",
       in_section("  bf16_threshold: \"0.6\"\n"),
       {kPath + "bf16_threshold: expected a number in [0, 1]", "the string \"0.6\""}},
      {"ThresholdIsAList", in_section("  int8_threshold: [0.3]\n"), {kPath + "int8_threshold", "a list"}},
      {"ThresholdAboveOne",
       in_training_config("      bf16_threshold: 1.5\n"),
       {"memory.stagehand.selective_precision.bf16_threshold: expected a number in [0, 1], found 1.5"}},
      {"ThresholdBelowZero",
       in_section("  int8_threshold: -0.1\n"),
       {kPath + "int8_threshold: expected a number in [0, 1], found -0.1"}},
      {"ThresholdNaN", in_section("  bf16_threshold: .nan\n"), {kPath + "bf16_threshold: expected a number in [0, 1]"}},
      {"Int8NotBelowBf16",
       in_section("  int8_threshold: 0.6\n"),
       {kPath + "int8_threshold: expected a value below bf16_threshold (0.6), found 0.6"}},
      {"NegativeHysteresis",
       in_section("  hysteresis_margin: -0.01\n"),
       {kPath + "hysteresis_margin: expected a number in [0, int8_threshold = 0.3], found -0.01"}},
      {"HysteresisAboveInt8Threshold",
       in_section("  hysteresis_margin: 0.31\n"),
       {kPath + "hysteresis_margin", "int8_threshold = 0.3", "found 0.31"}},
      {"NegativeGradWeight",
       in_section("  grad_weight: -1\n"),
       {kPath + "grad_weight: expected a finite number >= 0, found -1"}},
      {"NegativeErrorWeight",
       in_section("  error_weight: -0.3\n"),
       {kPath + "error_weight: expected a finite number >= 0"}},
      {"BothWeightsZero", in_section("  grad_weight: 0\n  error_weight: 0\n"), {kPath + "grad_weight", "both 0"}},
      {"GradSensitivityThresholdZero",
       in_section("  grad_sensitivity_threshold: 0\n"),
       {kPath + "grad_sensitivity_threshold: expected a finite number > 0, found 0"}},
      {"QuantErrorThresholdInfinite",
       in_section("  quant_error_threshold: .inf\n"),
       {kPath + "quant_error_threshold: expected a finite number > 0, found inf"}},
      {"HistoryWindowZero",
       in_section("  history_window: 0\n"),
       {kPath + "history_window: expected an integer in [1, 65536], found 0"}},
      {"HistoryWindowHuge", in_section("  history_window: 100000\n"), {kPath + "history_window", "found 100000"}},
      {"HistoryWindowNotAnInteger",
       in_section("  history_window: 2.5\n"),
       {kPath + "history_window: expected an integer in [1, 65536], found '2.5'"}},
      {"UpdateIntervalZero",
       in_section("  update_interval_steps: 0\n"),
       {kPath + "update_interval_steps: expected an integer >= 1, found 0"}},
      {"NegativeWarmup",
       in_section("  warmup_steps: -5\n"),
       {kPath + "warmup_steps: expected an integer >= 0, found -5"}},
      {"NegativeCooldown",
       in_section("  min_steps_between_switches: -1\n"),
       {kPath + "min_steps_between_switches: expected an integer >= 0, found -1"}},
      {"CalibrationSamplesZero",
       in_section("  calibration_samples: 0\n"),
       {kPath + "calibration_samples: expected an integer >= 1, found 0"}},
      {"UnknownMode",
       in_section("  mode: adaptive\n"),
       {kPath + "mode: expected one of off, static, dynamic, budget, measured, found 'adaptive'"}},
      {"ModeIsAMapping", in_section("  mode: {kind: dynamic}\n"), {kPath + "mode", "a mapping"}},
      {"BadAmbiguousDefault",
       in_section("  ambiguous_default: fp8\n"),
       {kPath + "ambiguous_default: expected bf16 or int8, found 'fp8'"}},
      {"EnabledIsNotABool", in_section("  enabled: 1\n"), {kPath + "enabled: expected true or false, found '1'"}},
      {"LogDecisionsIsAString",
       in_section("  log_decisions: \"true\"\n"),
       {kPath + "log_decisions: expected true or false"}},
      {"ForceListIsAScalar",
       in_section("  force_bf16_blocks: 3\n"),
       {kPath + "force_bf16_blocks: expected a list of block ids in [0, 47], found '3'"}},
      {"ForceIdOutOfRange",
       in_section("  force_int8_blocks: [1, 48]\n"),
       {kPath + "force_int8_blocks[1]: expected a block id in [0, 47] (the model has 48 blocks), found 48"}},
      {"ForceIdNegative", in_section("  force_bf16_blocks: [-1]\n"), {kPath + "force_bf16_blocks[0]", "found -1"}},
      {"ForceIdNotAnInteger", in_section("  force_bf16_blocks: [a]\n"), {kPath + "force_bf16_blocks[0]", "found 'a'"}},
      {"ForceIdListedTwice",
       in_section("  force_bf16_blocks: [4, 4]\n"),
       {kPath + "force_bf16_blocks[1]: block 4 is listed twice"}},
      {"BlockInBothForceLists",
       in_section("  force_bf16_blocks: [2, 3]\n  force_int8_blocks: [3]\n"),
       {kPath + "force_int8_blocks[0]: block 3 is also in force_bf16_blocks"}},
      {"EmptyTelemetryFile",
       in_section("  telemetry_file: \"\"\n"),
       {kPath + "telemetry_file: expected a file name when telemetry_enabled is true"}},
      {"TelemetryFileIsAList",
       in_section("  telemetry_file: [a]\n"),
       {kPath + "telemetry_file: expected a file name", "a list"}},
      {"TelemetryFileIsANumber",
       in_section("  telemetry_file: 5\n"),
       {kPath + "telemetry_file: expected a file name", "found '5'"}},
      // ---- v2 keys ----
      {"V2TiersNotAList",
       in_section("  tiers: nf4\n"),
       {kPath + "tiers: expected a list of precisions from [bf16, int8, nf4] that contains bf16, found 'nf4'"}},
      {"V2TiersUnknownPrecision",
       in_section("  tiers: [bf16, fp8]\n"),
       {kPath + "tiers[1]: expected one of bf16, int8, nf4, found 'fp8'"}},
      {"V2TiersRepeat", in_section("  tiers: [bf16, nf4, nf4]\n"), {kPath + "tiers[2]: nf4 is listed twice"}},
      {"V2TiersWithoutBf16",
       in_section("  tiers: [int8, nf4]\n"),
       {kPath + "tiers: expected a list that contains bf16", "found [int8, nf4]"}},
      {"V2Nf4ThresholdOutOfRange",
       in_section("  nf4_threshold: 1.5\n"),
       {kPath + "nf4_threshold: expected a number in [0, 1], found 1.5"}},
      {"V2Nf4ThresholdNotBelowInt8",
       in_section("  tiers: [bf16, int8, nf4]\n  nf4_threshold: 0.3\n"),
       {kPath + "nf4_threshold: expected a value below int8_threshold (0.3) when nf4 is a tier, found 0.3"}},
      {"V2HysteresisAboveNf4Threshold",
       in_section("  tiers: [bf16, nf4]\n  nf4_threshold: 0.05\n  hysteresis_margin: 0.1\n"),
       {kPath + "hysteresis_margin: expected a number in [0, nf4_threshold = 0.05] when nf4 is a tier, found 0.1"}},
      {"V2Nf4QuantErrorThresholdZero",
       in_section("  nf4_quant_error_threshold: 0\n"),
       {kPath + "nf4_quant_error_threshold: expected a finite number > 0, found 0"}},
      {"V2Nf4GroupSizeOdd",
       in_section("  nf4_group_size: 63\n"),
       {kPath + "nf4_group_size: expected 32, 64, 128 or 256, found 63"}},
      {"V2Nf4GroupSizeNotAKernelSize",
       in_section("  nf4_group_size: 48\n"),
       {kPath + "nf4_group_size: expected 32, 64, 128 or 256, found 48"}},
      {"V2ForceNf4OutOfRange",
       in_section("  force_nf4_blocks: [48]\n"),
       {kPath + "force_nf4_blocks[0]: expected a block id in [0, 47]", "found 48"}},
      {"V2ForceNf4AlsoBf16",
       in_section("  force_bf16_blocks: [2]\n  force_nf4_blocks: [2]\n"),
       {kPath + "force_nf4_blocks[0]: block 2 is also in force_bf16_blocks"}},
      {"V2ForceNf4AlsoInt8",
       in_section("  force_int8_blocks: [1, 2]\n  force_nf4_blocks: [2]\n"),
       {kPath + "force_nf4_blocks[0]: block 2 is also in force_int8_blocks"}},
      {"V2LossGuardNotAMapping",
       in_section("  loss_guard: true\n"),
       {kPath + "loss_guard: expected a mapping with enabled, window", "found 'true'"}},
      {"V2LossGuardUnknownKey",
       in_section("  loss_guard: {windw: 5}\n"),
       {kPath + "loss_guard.windw: unknown key; did you mean 'window'?"}},
      {"V2LossGuardDuplicateKey",
       in_section("  loss_guard:\n    window: 5\n    window: 6\n"),
       {kPath + "loss_guard.window: the key is given twice"}},
      {"V2LossGuardEnabledNotABool",
       in_section("  loss_guard: {enabled: yes please}\n"),
       {kPath + "loss_guard.enabled: expected true or false"}},
      {"V2LossGuardWindowOne",
       in_section("  loss_guard: {window: 1}\n"),
       {kPath + "loss_guard.window: expected an integer in [2, 65536], found 1"}},
      {"V2LossGuardSigmasZero",
       in_section("  loss_guard: {sigmas: 0}\n"),
       {kPath + "loss_guard.sigmas: expected a finite number > 0, found 0"}},
      {"V2LossGuardMinRiseNegative",
       in_section("  loss_guard: {min_rise: -0.1}\n"),
       {kPath + "loss_guard.min_rise: expected a finite number >= 0, found -0.1"}},
      {"V2LossGuardBlameStepsZero",
       in_section("  loss_guard: {blame_steps: 0}\n"),
       {kPath + "loss_guard.blame_steps: expected an integer >= 1, found 0"}},
      {"V2LossGuardPenaltyNegative",
       in_section("  loss_guard: {penalty_steps: -1}\n"),
       {kPath + "loss_guard.penalty_steps: expected an integer >= 0, found -1"}},
      {"V2LossGuardInTrainingConfigNamesFullPath",
       in_training_config("      loss_guard: {sigmas: -2}\n"),
       {"memory.stagehand.selective_precision.loss_guard.sigmas: expected a finite number > 0, found -2"}},
      {"NullValue",
       in_section("  bf16_threshold:\n"),
       {kPath + "bf16_threshold: expected a number in [0, 1], found nothing (null)"}},
  };
}

class PolicyConfigRejects : public ::testing::TestWithParam<BadConfig> {};

TEST_P(PolicyConfigRejects, WithAMessageNamingKeyExpectationAndFinding) {
  const BadConfig &bad = GetParam();
  try {
    parse_policy_config(bad.yaml, kBlocks);
    FAIL() << "accepted:\n" << bad.yaml;
  } catch (const PolicyConfigError &error) {
    EXPECT_EQ(error.status(), SP_ERR_CONFIG);
    for (const std::string &part : bad.message_parts) {
      EXPECT_NE(std::string(error.what()).find(part), std::string::npos)
          << "message: " << error.what() << "\nmissing: " << part;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Table, PolicyConfigRejects, ::testing::ValuesIn(bad_configs()),
                         [](const ::testing::TestParamInfo<BadConfig> &info) { return info.param.name; });

}  // namespace
}  // namespace sp::policy::testing
