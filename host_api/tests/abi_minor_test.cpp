// ABI 1.1 and 1.2 on the host side: a plugin is treated by the minor its table reports. The
// scripted fixture is built three times, as a real 1.0 binary (SP_FIXTURE_SCRIPTED), a 1.1 one
// (SP_FIXTURE_SCRIPTED_V1_1) and a 1.2 one (SP_FIXTURE_SCRIPTED_V1_2), and records what it
// receives through the host's log callback ("fixture: ..." lines, see fixtures/scripted_plugin.c).
#include <sp/host/plugin_library.h>
#include <sp/host/policy_host.h>

#include "test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace sp::host {
namespace {

using ::testing::AllOf;
using testing::CapturedLog;
using testing::Decision;
using testing::decisions_of;
using ::testing::HasSubstr;
using testing::make_blocks;
using ::testing::Not;
using testing::run_step;

constexpr std::uint32_t kBlocks = 6;
const std::string kPolicy = "int8_max_l2: 1.5\nmin_samples: 2\n";
constexpr sp_precision_mask kBf16Int8 = SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8);
constexpr sp_precision_mask kAll = kBf16Int8 | SP_PRECISION_BIT(SP_PRECISION_NF4);

PolicyHostOptions options(const CapturedLog& log, sp_precision_mask supported) {
  PolicyHostOptions result;
  result.logger = log.logger();
  result.supported_precisions = supported;
  return result;
}

PolicyConfig config(const std::string& fixture_lines = "") { return {kPolicy + fixture_lines, "scripted.yaml"}; }

// What set_transfer_bytes should carry for make_blocks(kBlocks).
std::string expected_nf4_bytes_record() {
  std::string record = "fixture: set_transfer_bytes precision=2";
  for (const BlockDescription& block : make_blocks(kBlocks))
    record += " " + std::to_string(block.bytes[Precision::nf4]);
  return record;
}

std::size_t count_of(const std::string& text, const std::string& needle) {
  std::size_t count = 0;
  for (std::size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + needle.size())) {
    ++count;
  }
  return count;
}

std::string load_error(const char* file) {
  try {
    PluginLibrary::load(file);
  } catch (const PluginError& error) {
    return error.what();
  }
  return "(loaded without error)";
}

TEST(AbiMinor, TheHeaderDescribes1_4AndTheEarlierSizesItNames) {
  EXPECT_EQ(SP_PLUGIN_ABI_MINOR, 4);
  EXPECT_EQ(offsetof(sp_policy_plugin_v1_table, initial_hints), SP_PLUGIN_TABLE_V1_2_SIZE);
  EXPECT_EQ(offsetof(sp_policy_plugin_v1_table, set_unit_signals), SP_PLUGIN_TABLE_V1_1_SIZE);
  EXPECT_EQ(sizeof(sp_unit_signals_v1), SP_UNIT_SIGNALS_V1_2_SIZE);
  EXPECT_EQ(offsetof(sp_budget_status_v1, reads_step_signals), SP_BUDGET_STATUS_V1_2_SIZE);
  EXPECT_EQ(sizeof(sp_budget_status_v1), SP_BUDGET_STATUS_V1_4_SIZE);
  EXPECT_EQ(sizeof(sp_block_desc_v1), 40u);
  EXPECT_EQ(offsetof(sp_host_api_v1, supported_precisions), SP_HOST_API_V1_0_SIZE);
  EXPECT_EQ(offsetof(sp_step_feedback_v1, h2d_bytes_nf4), SP_STEP_FEEDBACK_V1_0_SIZE);
  EXPECT_EQ(offsetof(sp_policy_plugin_v1_table, set_transfer_bytes), SP_PLUGIN_TABLE_V1_0_SIZE);
}

TEST(AbiMinor, ALibraryReportsTheMinorOfItsTable) {
  EXPECT_EQ(PluginLibrary::load(SP_FIXTURE_SCRIPTED).abi_minor(), 0u);
  EXPECT_EQ(PluginLibrary::load(SP_EXAMPLE_MINIMAL_C).abi_minor(), 0u);
  EXPECT_EQ(PluginLibrary::load(SP_FIXTURE_SCRIPTED_V1_1).abi_minor(), 1u);
  EXPECT_EQ(PluginLibrary::load(SP_FIXTURE_SCRIPTED_V1_2).abi_minor(), 2u);
}

TEST(AbiMinor, A1_1TableThatEndsWhere1_0EndsIsANamedLoadError) {
  EXPECT_THAT(load_error(SP_FIXTURE_V1_1_SMALL_TABLE),
              AllOf(HasSubstr(SP_FIXTURE_V1_1_SMALL_TABLE), HasSubstr("struct_size = 112"),
                    HasSubstr("ABI 1.1 needs at least 128 bytes"),
                    HasSubstr("set_transfer_bytes and set_precision_calibration_errors")));
}

TEST(AbiMinor, A1_1TableWithANullFunctionIsANamedLoadError) {
  EXPECT_THAT(load_error(SP_FIXTURE_V1_1_NULL_TRANSFER_BYTES),
              AllOf(HasSubstr(SP_FIXTURE_V1_1_NULL_TRANSFER_BYTES),
                    HasSubstr("field set_transfer_bytes of its function table is NULL"),
                    HasSubstr("SP_PLUGIN_ABI_TARGET_MINOR 0")));
}

TEST(AbiMinor, SupportedPrecisionsMustHoldBf16AndKnownPrecisionsOnly) {
  CapturedLog log;
  EXPECT_THROW(PolicyHost(SP_FIXTURE_SCRIPTED_V1_1, config(), make_blocks(kBlocks),
                          options(log, SP_PRECISION_BIT(SP_PRECISION_INT8))),
               std::invalid_argument);
  EXPECT_THROW(PolicyHost(SP_FIXTURE_SCRIPTED_V1_1, config(), make_blocks(kBlocks), options(log, kAll | (1u << 7))),
               std::invalid_argument);
  EXPECT_NO_THROW(PolicyHost(SP_FIXTURE_SCRIPTED_V1_1, config(), make_blocks(kBlocks),
                             options(log, SP_PRECISION_BIT(SP_PRECISION_BF16))));
}

TEST(AbiMinor, A1_0PluginGets1_0StructSizesAndNo1_1Call) {
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED, config(), make_blocks(kBlocks), options(log, kAll));
  EXPECT_EQ(host.plugin_abi_minor(), 0u);
  for (std::int64_t step = 0; step < 3; ++step) run_step(host, step);
  EXPECT_TRUE(host.set_calibration_errors(SP_PRECISION_INT8, {0, 5}, {0.01, 0.02}));
  EXPECT_TRUE(host.set_calibration_errors(SP_PRECISION_NF4, {1}, {0.25}));

  const std::string text = log.text();
  // host.abi_minor is the host's own minor; the struct is the 1.0 layout.
  EXPECT_THAT(text, HasSubstr("fixture: create host.struct_size=64 host.abi_minor=4\n"));
  EXPECT_THAT(text, HasSubstr("fixture: end_step 2 feedback.struct_size=48\n"));
  EXPECT_THAT(text, HasSubstr("fixture: set_calibration_errors 0:0.01 5:0.02"));
  EXPECT_THAT(text, AllOf(Not(HasSubstr("supported_precisions")), Not(HasSubstr("h2d_bytes_nf4")),
                          Not(HasSubstr("fixture: set_transfer_bytes")),
                          Not(HasSubstr("fixture: set_precision_calibration_errors"))));
  EXPECT_THAT(text, HasSubstr("implements ABI 1.0, which has no NF4: its NF4 calibration errors of 1 blocks"));
  EXPECT_EQ(host.hook_failures().total(), 0u);
}

TEST(AbiMinor, A1_1PluginGets1_1StructSizesAndTheSupportedPrecisions) {
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED_V1_1, config(), make_blocks(kBlocks), options(log, kBf16Int8));
  EXPECT_EQ(host.plugin_abi_minor(), 1u);
  run_step(host, 0);
  const std::string text = log.text();
  EXPECT_THAT(text, HasSubstr("fixture: create host.struct_size=" + std::to_string(sizeof(sp_host_api_v1)) +
                              " host.abi_minor=4 supported_precisions=0x3\n"));
  EXPECT_THAT(text, HasSubstr("fixture: end_step 0 feedback.struct_size=" +
                              std::to_string(sizeof(sp_step_feedback_v1)) + " h2d_bytes_nf4=250\n"));
  // Without NF4 on the host there are no NF4 bytes to describe.
  EXPECT_THAT(text, Not(HasSubstr("fixture: set_transfer_bytes")));
}

TEST(AbiMinor, NullFeedbackStaysNull) {
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED_V1_1, config(), make_blocks(kBlocks), options(log, kAll));
  host.begin_step(0);
  host.compute_hints(0);
  host.end_step(0);
  EXPECT_THAT(log.text(), HasSubstr("fixture: end_step 0 feedback=NULL"));
}

TEST(AbiMinor, Nf4TransferBytesFollowCreateBeforeTheFirstStep) {
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED_V1_1, config(), make_blocks(kBlocks), options(log, kAll));
  run_step(host, 0);
  const std::string text = log.text();
  EXPECT_THAT(text, HasSubstr("supported_precisions=0x7"));
  const std::size_t created = text.find("fixture: create");
  const std::size_t bytes = text.find(expected_nf4_bytes_record() + "\n");
  const std::size_t first_step = text.find("fixture: end_step 0");
  ASSERT_NE(bytes, std::string::npos) << text;
  EXPECT_LT(created, bytes);
  EXPECT_LT(bytes, first_step);
  EXPECT_EQ(count_of(text, "fixture: set_transfer_bytes"), 1u);
}

TEST(AbiMinor, RejectedTransferBytesAreALoadErrorNamingFileAndReason) {
  CapturedLog log;
  try {
    PolicyHost host(SP_FIXTURE_SCRIPTED_V1_1, config("fixture_reject_transfer_bytes: 1\n"), make_blocks(kBlocks),
                    options(log, kAll));
    FAIL() << "the host accepted a plugin that rejected its transfer bytes";
  } catch (const PluginError& error) {
    EXPECT_THAT(error.what(), AllOf(HasSubstr("scripted.yaml"), HasSubstr(SP_FIXTURE_SCRIPTED_V1_1),
                                    HasSubstr("rejected the NF4 transfer bytes of its 6 blocks"),
                                    HasSubstr("scripted rejection of the transfer bytes")));
  }
}

// Steps 0..4 with an NF4 hint for block 0 at step 3.
struct Nf4HintRun {
  std::vector<sp_hint_v1> step3;
  HintSource source3 = HintSource::plugin;
  HookFailureCounts failures;
  std::string log;
};

Nf4HintRun run_with_nf4_hint(const char* plugin, sp_precision_mask supported) {
  CapturedLog log;
  PolicyHost host(plugin, config("fixture_nf4_hint_at_step: 3\n"), make_blocks(kBlocks), options(log, supported));
  Nf4HintRun run;
  for (std::int64_t step = 0; step < 5; ++step) {
    std::vector<sp_hint_v1> hints = run_step(host, step);
    if (step == 3) {
      run.step3 = hints;
      run.source3 = host.last_hint_source();
    }
  }
  run.failures = host.hook_failures();
  run.log = log.text();
  return run;
}

TEST(AbiMinor, Nf4HintFromA1_0PluginIsRefusedWithFallback) {
  const Nf4HintRun run = run_with_nf4_hint(SP_FIXTURE_SCRIPTED, kAll);
  EXPECT_EQ(run.source3, HintSource::fallback);
  EXPECT_EQ(run.failures.invalid_hints, 1u);
  for (const sp_hint_v1& hint : run.step3) {
    EXPECT_EQ(hint.precision, SP_PRECISION_BF16);
    EXPECT_EQ(hint.reason, SP_REASON_HOST_FALLBACK);
  }
  EXPECT_THAT(run.log, HasSubstr("returned invalid hints at step 3: hints[0].precision is 2 (SP_PRECISION_NF4), "
                                 "which plugin ABI 1.0 does not define; expected one of SP_PRECISION_BF16, "
                                 "SP_PRECISION_INT8"));
}

TEST(AbiMinor, Nf4HintIsRefusedWhenTheHostDoesNotSupportNf4) {
  const Nf4HintRun run = run_with_nf4_hint(SP_FIXTURE_SCRIPTED_V1_1, kBf16Int8);
  EXPECT_EQ(run.source3, HintSource::fallback);
  EXPECT_EQ(run.failures.invalid_hints, 1u);
  EXPECT_THAT(run.log, HasSubstr("hints[0].precision is 2 (SP_PRECISION_NF4), which this host does not support"));
}

TEST(AbiMinor, Int8HintIsRefusedWhenTheHostTransfersOnlyBf16) {
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED_V1_1, config(), make_blocks(kBlocks),
                  options(log, SP_PRECISION_BIT(SP_PRECISION_BF16)));
  for (std::int64_t step = 0; step < 20; ++step) {
    for (const sp_hint_v1& hint : run_step(host, step)) EXPECT_EQ(hint.precision, SP_PRECISION_BF16);
  }
  EXPECT_GT(host.hook_failures().invalid_hints, 0u);
  EXPECT_THAT(log.text(), HasSubstr("(SP_PRECISION_INT8), which this host does not support"));
}

TEST(AbiMinor, Nf4HintFromA1_1PluginIsAcceptedWhenTheHostSupportsNf4) {
  const Nf4HintRun run = run_with_nf4_hint(SP_FIXTURE_SCRIPTED_V1_1, kAll);
  EXPECT_EQ(run.source3, HintSource::plugin);
  EXPECT_EQ(run.failures.total(), 0u);
  ASSERT_EQ(run.step3.size(), kBlocks);
  EXPECT_EQ(run.step3[0].precision, SP_PRECISION_NF4);
}

TEST(AbiMinor, CalibrationErrorsReachA1_1PluginPerPrecision) {
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED_V1_1, config(), make_blocks(kBlocks), options(log, kAll));
  EXPECT_TRUE(host.set_calibration_errors({0, 5}, {0.01, 0.02}));
  EXPECT_TRUE(host.set_calibration_errors(SP_PRECISION_INT8, {3}, {0.03}));
  EXPECT_TRUE(host.set_calibration_errors(SP_PRECISION_NF4, {1, 2}, {0.25, 0.5}));
  const std::string text = log.text();
  EXPECT_THAT(text, HasSubstr("fixture: set_calibration_errors 0:0.01 5:0.02\n"));
  EXPECT_THAT(text, HasSubstr("fixture: set_calibration_errors 3:0.03\n"));
  EXPECT_THAT(text, HasSubstr("fixture: set_precision_calibration_errors precision=2 1:0.25 2:0.5\n"));
  EXPECT_EQ(count_of(text, "fixture: set_precision_calibration_errors"), 1u) << "INT8 goes through the 1.0 function";

  EXPECT_FALSE(host.set_calibration_errors(SP_PRECISION_NF4, {6}, {0.1}));
  EXPECT_EQ(host.hook_failures().set_calibration_errors, 1u);
  EXPECT_THAT(log.text(), HasSubstr("failed in set_precision_calibration_errors (NF4) before the first step with "
                                    "status 1 (SP_ERR_INVALID_ARGUMENT): block_ids[0] is 6, but there are 6 blocks"));
  EXPECT_THROW(host.set_calibration_errors(SP_PRECISION_BF16, {0}, {0.1}), std::invalid_argument);
  EXPECT_THROW(host.set_calibration_errors(7, {0}, {0.1}), std::invalid_argument);
  EXPECT_THROW(host.set_calibration_errors(SP_PRECISION_NF4, {0, 1}, {0.1}), std::invalid_argument);
}

TEST(AbiMinor, Nf4CalibrationErrorsForA1_0PluginAreSkippedButIdsStillChecked) {
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED, config(), make_blocks(kBlocks), options(log, kAll));
  EXPECT_TRUE(host.set_calibration_errors(SP_PRECISION_NF4, {1, 2}, {0.25, 0.5}));
  EXPECT_EQ(host.hook_failures().set_calibration_errors, 0u);
  EXPECT_FALSE(host.set_calibration_errors(SP_PRECISION_NF4, {9}, {0.25}));
  EXPECT_EQ(host.hook_failures().set_calibration_errors, 1u);
  EXPECT_THAT(log.text(), HasSubstr("NF4 calibration errors before the first step: block_ids[0] is 9, but there are "
                                    "6 blocks"));
}

// The scripted fixture runs the example's policy whatever its minor, so a swap that carries
// the state over must not change a single decision.
std::vector<Decision> uninterrupted_decisions(std::int64_t steps) {
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED, config(), make_blocks(kBlocks), options(log, kAll));
  std::vector<Decision> decisions;
  for (std::int64_t step = 0; step < steps; ++step) {
    const auto step_decisions = decisions_of(step, run_step(host, step));
    decisions.insert(decisions.end(), step_decisions.begin(), step_decisions.end());
  }
  return decisions;
}

TEST(AbiMinor, HotSwapFrom1_0To1_1AndBack) {
  constexpr std::int64_t kSteps = 30;
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED, config(), make_blocks(kBlocks), options(log, kAll));
  // Kept by the host: the 1.0 plugin cannot hold them.
  ASSERT_TRUE(host.set_calibration_errors(SP_PRECISION_NF4, {1, 4}, {0.25, 0.125}));
  ASSERT_TRUE(host.set_calibration_errors(SP_PRECISION_NF4, {4}, {0.0625}));
  std::vector<Decision> decisions;
  auto step_through = [&](std::int64_t first, std::int64_t end) {
    for (std::int64_t step = first; step < end; ++step) {
      const auto step_decisions = decisions_of(step, run_step(host, step));
      decisions.insert(decisions.end(), step_decisions.begin(), step_decisions.end());
    }
  };
  step_through(0, 10);

  // 1.0 -> 1.1 between steps.
  std::size_t mark = log.text().size();
  const SwapResult up = host.swap_now(SP_FIXTURE_SCRIPTED_V1_1);
  ASSERT_EQ(up.outcome, SwapResult::Outcome::swapped) << up.message;
  EXPECT_EQ(host.plugin_abi_minor(), 1u);
  EXPECT_EQ(host.plugin_version(), "1.1.0");
  step_through(10, 20);
  std::string after = log.text().substr(mark);
  EXPECT_THAT(after, HasSubstr("fixture: create host.struct_size=" + std::to_string(sizeof(sp_host_api_v1))));
  EXPECT_THAT(after, HasSubstr(expected_nf4_bytes_record() + "\n"));
  EXPECT_THAT(after, HasSubstr("fixture: set_precision_calibration_errors precision=2 1:0.25 4:0.0625\n"));
  EXPECT_THAT(after, HasSubstr("fixture: end_step 10 feedback.struct_size=" +
                               std::to_string(sizeof(sp_step_feedback_v1)) + " h2d_bytes_nf4=250"));

  // 1.1 -> 1.1: the state blob carries what the plugin holds; nothing is re-sent.
  mark = log.text().size();
  ASSERT_EQ(host.swap_now(SP_FIXTURE_SCRIPTED_V1_1).outcome, SwapResult::Outcome::swapped);
  after = log.text().substr(mark);
  EXPECT_THAT(after, HasSubstr(expected_nf4_bytes_record()));
  EXPECT_THAT(after, Not(HasSubstr("fixture: set_precision_calibration_errors")));

  // 1.1 -> 1.0 at a step boundary.
  mark = log.text().size();
  ASSERT_EQ(host.request_swap(SP_FIXTURE_SCRIPTED).outcome, SwapResult::Outcome::pending);
  step_through(20, kSteps);
  ASSERT_TRUE(host.last_swap_result().has_value());
  EXPECT_EQ(host.last_swap_result()->outcome, SwapResult::Outcome::swapped);
  EXPECT_EQ(host.last_swap_result()->first_step, 20);
  EXPECT_EQ(host.plugin_abi_minor(), 0u);
  after = log.text().substr(mark);
  EXPECT_THAT(after, HasSubstr("fixture: create host.struct_size=64 host.abi_minor=4\n"));
  EXPECT_THAT(after, HasSubstr("fixture: end_step 20 feedback.struct_size=48\n"));
  EXPECT_THAT(after,
              AllOf(Not(HasSubstr("fixture: set_transfer_bytes")),
                    Not(HasSubstr("fixture: set_precision_calibration_errors")), Not(HasSubstr("h2d_bytes_nf4"))));

  EXPECT_EQ(host.hook_failures().total(), 0u);
  EXPECT_EQ(decisions, uninterrupted_decisions(kSteps)) << "the state crossed both minors unchanged";
}

TEST(AbiMinor, A1_1PluginThatRejectsTheKeptNf4ErrorsStillTakesOver) {
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED, config(), make_blocks(kBlocks), options(log, kAll));
  ASSERT_TRUE(host.set_calibration_errors(SP_PRECISION_NF4, {2}, {0.5}));
  run_step(host, 0);
  const SwapResult result =
      host.swap_now(SP_FIXTURE_SCRIPTED_V1_1, config("fixture_fail_hook: set_precision_calibration_errors\n"));
  EXPECT_EQ(result.outcome, SwapResult::Outcome::swapped);
  EXPECT_THAT(result.message, HasSubstr("the new plugin rejected the NF4 calibration errors"));
  EXPECT_EQ(host.plugin_abi_minor(), 1u);
  EXPECT_EQ(host.hook_failures().set_calibration_errors, 1u);
  EXPECT_THAT(log.text(), HasSubstr("re-sent after a hot swap from an ABI 1.0 plugin"));
}

TEST(AbiMinor, ASwapToA1_1PluginThatRejectsTheTransferBytesFails) {
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED, config(), make_blocks(kBlocks), options(log, kAll));
  run_step(host, 0);
  const SwapResult result = host.swap_now(SP_FIXTURE_SCRIPTED_V1_1, config("fixture_reject_transfer_bytes: 1\n"));
  EXPECT_EQ(result.outcome, SwapResult::Outcome::failed);
  EXPECT_THAT(result.message,
              AllOf(HasSubstr("scripted_fixture 1.0.0 stays active"), HasSubstr("rejected the NF4 transfer bytes")));
  EXPECT_EQ(host.plugin_abi_minor(), 0u);
  run_step(host, 1);
}

// ---- ABI 1.2: the signal table and the policy's report ----

UnitSignalTable signal_table() {
  UnitSignalTable table;
  table.names = {"loss_cost.int8", "loss_cost.nf4"};
  for (std::uint32_t b = 0; b < kBlocks; ++b) table.values.insert(table.values.end(), {0.001 * b, 0.01 * b});
  table.loss = 2.5;
  table.samples = 64;
  return table;
}

const std::string kSignalRecord =
    "fixture: set_unit_signals step=-1 n_units=6 columns=loss_cost.int8,loss_cost.nf4 loss=2.5 samples=64\n";

TEST(AbiMinor, A1_2TableThatEndsWhere1_1EndsIsANamedLoadError) {
  EXPECT_THAT(load_error(SP_FIXTURE_V1_2_SMALL_TABLE),
              AllOf(HasSubstr("struct_size = 128"), HasSubstr("ABI 1.2 needs at least 152 bytes"),
                    HasSubstr("set_unit_signals, get_unit_costs and get_budget_status")));
}

TEST(AbiMinor, A1_2TableWithANullFunctionIsANamedLoadError) {
  EXPECT_THAT(load_error(SP_FIXTURE_V1_2_NULL_UNIT_SIGNALS),
              AllOf(HasSubstr("field set_unit_signals of its function table is NULL"),
                    HasSubstr("every field of ABI 1.2"), HasSubstr("SP_PLUGIN_ABI_TARGET_MINOR 1")));
}

TEST(AbiMinor, PluginsOlderThan1_2NeverGetA1_2Call) {
  for (const char* plugin : {SP_FIXTURE_SCRIPTED, SP_FIXTURE_SCRIPTED_V1_1, SP_EXAMPLE_MINIMAL_C}) {
    CapturedLog log;
    PolicyHost host(plugin, config(), make_blocks(kBlocks), options(log, kAll));
    EXPECT_TRUE(host.set_unit_signals(-1, signal_table())) << plugin;
    for (std::int64_t step = 0; step < 3; ++step) run_step(host, step);
    EXPECT_FALSE(host.unit_costs(SP_PRECISION_NF4).has_value()) << plugin;
    EXPECT_FALSE(host.budget_status().has_value()) << plugin;
    const std::string text = log.text();
    EXPECT_THAT(text, AllOf(Not(HasSubstr("fixture: set_unit_signals")), Not(HasSubstr("fixture: get_unit_costs")),
                            Not(HasSubstr("fixture: get_budget_status"))));
    EXPECT_THAT(text, HasSubstr("which has no signal table: the table of step -1 is kept for a later 1.2 plugin"));
    EXPECT_EQ(host.hook_failures().total(), 0u) << plugin;
  }
}

// ---- ABI 1.3: the hints before the first step ----

TEST(AbiMinor, PluginsOlderThan1_3GiveNoInitialHintsAndAreNotAsked) {
  for (const char* plugin : {SP_FIXTURE_SCRIPTED, SP_FIXTURE_SCRIPTED_V1_1, SP_FIXTURE_SCRIPTED_V1_2}) {
    CapturedLog log;
    PolicyHost host(plugin, config(), make_blocks(kBlocks), options(log, kAll));
    EXPECT_FALSE(host.initial_hints().has_value()) << plugin;
    run_step(host, 0);
    EXPECT_THROW(host.initial_hints(), std::logic_error) << plugin;
    EXPECT_EQ(host.hook_failures().total(), 0u) << plugin;
  }
}

TEST(AbiMinor, A1_2PluginGetsTheSignalTableAndReportsItsDecision) {
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED_V1_2, config(), make_blocks(kBlocks), options(log, kAll));
  EXPECT_EQ(host.plugin_abi_minor(), 2u);
  EXPECT_EQ(host.plugin_version(), "1.2.0");
  ASSERT_TRUE(host.set_unit_signals(-1, signal_table()));
  run_step(host, 0);
  const std::optional<std::vector<double>> costs = host.unit_costs(SP_PRECISION_NF4);
  ASSERT_TRUE(costs.has_value());
  EXPECT_EQ(*costs, (std::vector<double>{0.0, 0.5, 1.0, 1.5, 2.0, 2.5}));
  const std::optional<sp_budget_status_v1> status = host.budget_status();
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(status->kind, SP_BUDGET_BYTES);
  EXPECT_EQ(status->met, 1u);
  EXPECT_DOUBLE_EQ(status->limit, 0.45);
  // It was handed the 1.2 layout, and the field 1.4 appended reads as before 1.4.
  EXPECT_EQ(status->struct_size, SP_BUDGET_STATUS_V1_2_SIZE);
  EXPECT_EQ(status->reads_step_signals, 1u);
  // 1.4's functions are not called on it.
  EXPECT_FALSE(host.propose_allocations().has_value());
  AllocationMeasurements measured;
  measured.allocations.push_back({std::vector<sp_precision>(kBlocks, SP_PRECISION_BF16), 0.0, 0.0, 0.0, 0.0});
  EXPECT_FALSE(host.set_allocation_measurements(-1, measured));
  measured.allocations[0].routes.pop_back();
  EXPECT_THROW(host.set_allocation_measurements(-1, measured), std::invalid_argument);
  const std::string text = log.text();
  EXPECT_THAT(text, HasSubstr(kSignalRecord));
  EXPECT_THAT(text, AllOf(HasSubstr("fixture: get_unit_costs precision=2"),
                          HasSubstr("fixture: get_budget_status struct_size=64")));
  EXPECT_EQ(host.hook_failures().total(), 0u);

  UnitSignalTable ragged = signal_table();
  ragged.values.pop_back();
  EXPECT_THROW(host.set_unit_signals(1, ragged), std::invalid_argument);
}

TEST(AbiMinor, ARejectedSignalTableIsCountedAndNotKept) {
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED_V1_2, config("fixture_reject_unit_signals: 1\n"), make_blocks(kBlocks),
                  options(log, kAll));
  EXPECT_FALSE(host.set_unit_signals(-1, signal_table()));
  EXPECT_EQ(host.hook_failures().set_unit_signals, 1u);
  EXPECT_THAT(log.text(), HasSubstr("failed in set_unit_signals (step -1) before the first step with status 1 "
                                    "(SP_ERR_INVALID_ARGUMENT): scripted rejection of the signal table"));
  // Nothing kept: a swap to another 1.2 plugin after a 1.1 one would have nothing to re-send.
  ASSERT_EQ(host.swap_now(SP_FIXTURE_SCRIPTED_V1_1).outcome, SwapResult::Outcome::swapped);
  const std::size_t mark = log.text().size();
  ASSERT_EQ(host.swap_now(SP_FIXTURE_SCRIPTED_V1_2).outcome, SwapResult::Outcome::swapped);
  EXPECT_THAT(log.text().substr(mark), Not(HasSubstr("fixture: set_unit_signals")));
}

TEST(AbiMinor, ASwapTo1_2ResendsTheKeptSignalTableOnlyAfterAnOlderMinor) {
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED_V1_1, config(), make_blocks(kBlocks), options(log, kAll));
  ASSERT_TRUE(host.set_unit_signals(-1, signal_table()));
  run_step(host, 0);
  // 1.1 -> 1.2 at a step boundary: the new plugin gets the table after import_state.
  ASSERT_EQ(host.request_swap(SP_FIXTURE_SCRIPTED_V1_2).outcome, SwapResult::Outcome::pending);
  run_step(host, 1);
  ASSERT_EQ(host.plugin_abi_minor(), 2u);
  EXPECT_EQ(count_of(log.text(), kSignalRecord), 1u);
  EXPECT_TRUE(host.budget_status().has_value());
  // 1.2 -> 1.2: the state blob carries what the plugin holds; nothing is re-sent.
  ASSERT_EQ(host.swap_now(SP_FIXTURE_SCRIPTED_V1_2).outcome, SwapResult::Outcome::swapped);
  EXPECT_EQ(count_of(log.text(), kSignalRecord), 1u);
  // 1.2 -> 1.0: no 1.2 call at all.
  const std::size_t mark = log.text().size();
  ASSERT_EQ(host.swap_now(SP_FIXTURE_SCRIPTED).outcome, SwapResult::Outcome::swapped);
  run_step(host, 2);
  EXPECT_FALSE(host.budget_status().has_value());
  EXPECT_THAT(log.text().substr(mark), Not(HasSubstr("fixture: set_unit_signals")));
  EXPECT_EQ(host.hook_failures().total(), 0u);
}

TEST(AbiMinor, A1_2PluginThatRejectsTheKeptSignalTableStillTakesOver) {
  CapturedLog log;
  PolicyHost host(SP_FIXTURE_SCRIPTED, config(), make_blocks(kBlocks), options(log, kAll));
  ASSERT_TRUE(host.set_unit_signals(-1, signal_table()));
  const SwapResult result = host.swap_now(SP_FIXTURE_SCRIPTED_V1_2, config("fixture_reject_unit_signals: 1\n"));
  EXPECT_EQ(result.outcome, SwapResult::Outcome::swapped);
  EXPECT_THAT(result.message, HasSubstr("the new plugin rejected the kept signal table"));
  EXPECT_EQ(host.hook_failures().set_unit_signals, 1u);
  EXPECT_THAT(log.text(), HasSubstr("re-sent after a hot swap from an ABI 1.0 plugin"));
}

}  // namespace
}  // namespace sp::host
