// Telemetry JSONL records and decision logging.
#include "policy_test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <unistd.h>

namespace sp::policy::testing {
namespace {

namespace fs = std::filesystem;

class PolicyTelemetry : public ::testing::Test {
 protected:
  PolicyTelemetry() {
    const auto *test = ::testing::UnitTest::GetInstance()->current_test_info();
    dir = fs::path(::testing::TempDir()) / ("sp_policy_telemetry_" + std::to_string(::getpid()) + "_" + test->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~PolicyTelemetry() override { fs::remove_all(dir); }

  std::vector<nlohmann::json> records(const std::string &file = "telemetry.jsonl") const {
    std::ifstream in(dir / file);
    std::vector<nlohmann::json> parsed;
    for (std::string line; std::getline(in, line);) parsed.push_back(nlohmann::json::parse(line));
    return parsed;
  }

  static std::string settings(const std::string &extra = "") {
    return standalone(error_driven_settings() +
                      "  warmup_steps: 2\n  update_interval_steps: 3\n  min_steps_between_switches: 0\n"
                      "  telemetry_file: telemetry.jsonl\n" +
                      extra);
  }

  fs::path dir;
  CapturingLog log;
};

TEST_F(PolicyTelemetry, WritesARecordAtDecisionStepsAndAtStepsWithChanges) {
  Driver driver(settings(), 2, &log, dir.string());
  for (int step = 0; step < 9; ++step) {
    if (step == 3) {
      driver.step(step, {nonfinite_moments(0), moments_with_l2(1, 1.0)});
    } else {
      driver.step_with_sensitivity(step, {0.1, 0.9});
    }
  }
  // Decision steps 2, 5, 8; step 3 sends block 0 back to BF16 (unsafe); step 5 sends it to INT8 again.
  std::vector<std::int64_t> steps;
  for (const auto &record : records()) steps.push_back(record.at("step_id").get<std::int64_t>());
  EXPECT_EQ(steps, (std::vector<std::int64_t>{2, 3, 5, 8}));
  const auto all = records();
  EXPECT_EQ(all[0]["precision_changes"], 1);
  EXPECT_EQ(all[1]["precision_changes"], 1);
  EXPECT_EQ(all[1]["decision_step"], false);
  EXPECT_EQ(all[1]["block_details"]["0"]["reason"], "unsafe");
  EXPECT_EQ(all[2]["precision_changes"], 1);
  EXPECT_EQ(all[3]["precision_changes"], 0);
}

TEST_F(PolicyTelemetry, RecordHasTheSeedsFieldsMeasuredBytesAndBlockDetails) {
  Driver driver(settings(), 2, &log, dir.string());
  sp_step_feedback_v1 feedback{};
  feedback.struct_size = sizeof feedback;
  feedback.h2d_bytes_bf16 = 3000;
  feedback.h2d_bytes_int8 = 500;
  feedback.h2d_bytes_all_bf16 = 4000;
  for (int step = 0; step < 3; ++step) {
    driver.engine().set_calibration_errors(std::vector<std::uint32_t>{0, 1}.data(),
                                           std::vector<double>{0.1, 0.9}.data(), 2);
    driver.step(step, {moments_with_l2(0, 1.0), moments_with_l2(1, 2.0)}, &feedback);
  }
  const auto all = records();
  ASSERT_EQ(all.size(), 1u);
  const nlohmann::json &record = all[0];
  for (const char *field :
       {"step_id", "timestamp", "blocks_bf16", "blocks_int8", "mean_sensitivity", "max_sensitivity", "min_sensitivity",
        "precision_changes", "estimated_bandwidth_saving_pct", "block_details"}) {
    EXPECT_TRUE(record.contains(field)) << field;
  }
  EXPECT_EQ(record["blocks_bf16"], 1);
  EXPECT_EQ(record["blocks_int8"], 1);
  EXPECT_DOUBLE_EQ(record["mean_sensitivity"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(record["max_sensitivity"].get<double>(), 0.9);
  EXPECT_DOUBLE_EQ(record["min_sensitivity"].get<double>(), 0.1);
  // Declared block sizes 2000 (BF16) and 1000 (INT8): one INT8 block of two saves 25%.
  EXPECT_DOUBLE_EQ(record["estimated_bandwidth_saving_pct"].get<double>(), 25.0);
  // Steps 0..2 reported bytes and no record came before: all three are summed.
  const nlohmann::json &measured = record["measured_bandwidth"];
  EXPECT_EQ(measured["steps"], 3);
  EXPECT_EQ(measured["h2d_bytes_all_bf16"], 12000);
  EXPECT_DOUBLE_EQ(measured["saving_pct"].get<double>(), 12.5);
  const nlohmann::json &block = record["block_details"]["1"];
  EXPECT_EQ(block["precision"], "bf16");
  EXPECT_EQ(block["reason"], "threshold");
  EXPECT_EQ(block["window_size"], 3);
  EXPECT_DOUBLE_EQ(block["error_score"].get<double>(), 0.9);
  EXPECT_DOUBLE_EQ(block["avg_l2"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(block["relative_magnitude"].get<double>(), 2.0 / 1.5);
  EXPECT_TRUE(block["last_switch_step"].is_null());
}

// Without NF4 bytes from the host, an NF4 block counts its nominal image: half a byte of
// codes plus a 2-byte scale per group per element, over BF16's 2 bytes (0.25 + 1/group).
TEST_F(PolicyTelemetry, NominalNf4BytesFollowTheGroupSize) {
  EXPECT_DOUBLE_EQ(nominal_nf4_ratio(64), 0.265625);
  EXPECT_DOUBLE_EQ(nominal_nf4_ratio(32), 0.28125);
  for (const int group : {32, 64, 256}) {
    const std::string file = "nf4_" + std::to_string(group) + ".jsonl";
    {
      Driver driver(standalone("  mode: static\n  force_nf4_blocks: [0]\n  nf4_group_size: " + std::to_string(group) +
                               "\n  telemetry_file: " + file + "\n"),
                    2, &log, dir.string());
      driver.step_l2(0, {1.0, 1.0});  // block 0 nf4: a change, so a record
    }
    const auto all = records(file);
    ASSERT_EQ(all.size(), 1u) << group;
    // Blocks of 2000 BF16 bytes: the NF4 one moves 2000 * ratio, in whole bytes as a budget
    // counts them (tier_bytes).
    const double saved = 2000.0 - std::ceil(2000.0 * (0.25 + 1.0 / group));
    EXPECT_DOUBLE_EQ(all[0]["estimated_bandwidth_saving_pct"].get<double>(), 100.0 * saved / 4000.0) << group;
  }
}

TEST_F(PolicyTelemetry, NeverScoredValuesAreNullNotNaN) {
  Driver driver(standalone("  mode: static\n  force_int8_blocks: [0]\n  telemetry_file: telemetry.jsonl\n"), 2, &log,
                dir.string());
  driver.step_l2(0, {1.0, 1.0});
  const auto all = records();
  ASSERT_EQ(all.size(), 1u) << "step 0 has a change";
  EXPECT_TRUE(all[0]["mean_sensitivity"].is_null());
  EXPECT_TRUE(all[0]["block_details"]["0"]["sensitivity"].is_null());
  EXPECT_TRUE(all[0]["measured_bandwidth"].is_null());
  EXPECT_EQ(all[0]["mode"], "static");
}

TEST_F(PolicyTelemetry, AppendsToAnExistingFile) {
  { std::ofstream(dir / "telemetry.jsonl") << "{\"earlier\":1}\n"; }
  Driver driver(settings(), 1, &log, dir.string());
  for (int step = 0; step < 3; ++step) driver.step_with_sensitivity(step, {0.5});
  const auto all = records();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0]["earlier"], 1);
}

TEST_F(PolicyTelemetry, AnAbsolutePathIgnoresTheOutputDirectory) {
  const std::string absolute = (dir / "sub" / "abs.jsonl").string();
  Driver driver(standalone(error_driven_settings() + "  warmup_steps: 0\n  telemetry_file: " + absolute + "\n"), 1,
                &log, "/nonexistent-output-dir");
  driver.step_with_sensitivity(0, {0.5});
  EXPECT_EQ(records("sub/abs.jsonl").size(), 1u);
}

TEST_F(PolicyTelemetry, AStepWithoutEndStepIsRecordedAtTheNextBeginStep) {
  Driver driver(settings(), 1, &log, dir.string());
  for (int step = 0; step < 2; ++step) driver.step_with_sensitivity(step, {0.5});
  driver.engine().begin_step(2);
  const sp_grad_moments_v1 moments[] = {moments_with_l2(0, 1.0)};
  driver.engine().post_backward(2, moments, 1);
  driver.engine().compute_hints(2, driver.mutable_hints().data(), 1);
  EXPECT_TRUE(records().empty());
  driver.engine().begin_step(3);
  ASSERT_EQ(records().size(), 1u);
  EXPECT_EQ(records()[0]["step_id"], 2);
}

TEST_F(PolicyTelemetry, AnOpenFailureIsLoggedOnceAndThePolicyContinues) {
  { std::ofstream(dir / "not-a-directory") << "x"; }
  Driver driver(settings(), 1, &log, (dir / "not-a-directory").string());
  for (int step = 0; step < 9; ++step) EXPECT_NO_THROW(driver.step_with_sensitivity(step, {0.1}));
  EXPECT_EQ(driver.hints()[0].precision, SP_PRECISION_INT8);
  EXPECT_EQ(log.count_containing("telemetry file"), 1u);
}

TEST_F(PolicyTelemetry, AWriteFailureIsLoggedOnceAndThePolicyContinues) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "/dev/full is needed to make writes fail";
  Driver driver(standalone(error_driven_settings() + "  warmup_steps: 0\n  update_interval_steps: 1\n"
                                                     "  telemetry_file: /dev/full\n"),
                1, &log);
  for (int step = 0; step < 5; ++step) EXPECT_NO_THROW(driver.step_with_sensitivity(step, {0.1}));
  EXPECT_EQ(log.count_containing("a write failed"), 1u);
}

TEST_F(PolicyTelemetry, ModeOffWritesNothing) {
  Driver driver(settings("  mode: off\n"), 1, &log, dir.string());
  for (int step = 0; step < 6; ++step) driver.step_with_sensitivity(step, {0.1});
  EXPECT_FALSE(fs::exists(dir / "telemetry.jsonl"));
}

TEST_F(PolicyTelemetry, LogDecisionsLogsEachChangeWithBlockPrecisionsScoreAndReason) {
  Driver driver(settings("  telemetry_enabled: false\n"), 2, &log);
  for (int step = 0; step < 6; ++step) driver.step_with_sensitivity(step, {step < 5 ? 0.1 : 0.95, 0.9});
  EXPECT_EQ(log.count_containing("step 2: block 0 bf16 -> int8 (sensitivity 0.1000, reason threshold)"), 1u);
  EXPECT_EQ(log.count_containing("step 5: block 0 int8 -> bf16 (sensitivity 0.9500, reason threshold)"), 1u);
  EXPECT_EQ(log.count_containing("block 1"), 0u) << "block 1 never changed";

  CapturingLog quiet;
  Driver silent(settings("  telemetry_enabled: false\n  log_decisions: false\n"), 2, &quiet);
  for (int step = 0; step < 6; ++step) silent.step_with_sensitivity(step, {0.1, 0.9});
  EXPECT_EQ(quiet.count_containing(" -> "), 0u);
}

// The plugin's tables hold one value per tier in the route table's order and are looked up by ABI
// code, which names a route and is not taken for its place.
TEST(PolicyTiers, ATierIsLookedUpByItsCodeAndAnUnknownCodeThrows) {
  for (std::size_t i = 0; i < kTiers.size(); ++i) EXPECT_EQ(tier_position(kTiers[i]), i);
  EXPECT_FALSE(tier_position(static_cast<sp_precision>(31)).has_value());
  PerTier<int> values;
  values[SP_PRECISION_NF4] = 4;
  values[SP_PRECISION_INT8] = 1;
  EXPECT_EQ(values.values[*tier_position(SP_PRECISION_NF4)], 4);
  EXPECT_EQ(values.values[*tier_position(SP_PRECISION_INT8)], 1);
  EXPECT_EQ(values[SP_PRECISION_BF16], 0);
  EXPECT_THROW(values[static_cast<sp_precision>(31)], std::out_of_range);
}

// A route that ABI 1.0 had is as the block descs say, 0 included; a later one the host did not
// describe moves its nominal image in whole bytes.
TEST(PolicyTiers, ARouteTheHostDidNotDescribeMovesItsNominalImage) {
  BlockBytes bytes;
  bytes[SP_PRECISION_BF16] = 2000;
  EXPECT_EQ(tier_bytes(bytes, SP_PRECISION_BF16, 64), 2000u);
  EXPECT_EQ(tier_bytes(bytes, SP_PRECISION_INT8, 64), 0u);
  EXPECT_EQ(tier_bytes(bytes, SP_PRECISION_NF4, 64), 532u);  // 2000 * 0.265625 = 531.25
  EXPECT_EQ(tier_bytes(bytes, SP_PRECISION_NF4, 32), 563u);  // 2000 * 0.28125 = 562.5
  bytes[SP_PRECISION_NF4] = 600;
  EXPECT_EQ(tier_bytes(bytes, SP_PRECISION_NF4, 64), 600u);
  EXPECT_THROW(tier_bytes(bytes, static_cast<sp_precision>(31), 64), std::exception);
}

}  // namespace
}  // namespace sp::policy::testing
