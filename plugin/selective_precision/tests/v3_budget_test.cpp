// Policy v3 (mode budget): the allocation under a bytes or loss budget, decided from step 0,
// with hysteresis, cooldowns, force lists and the loss guard; its config errors, its state
// (format 3, and migration from v2) and its ABI 1.2 functions (docs/policy.md, "Policy v3").
#include "loaded_plugin.h"
#include "budget_test_support.h"
#include "policy_test_support.h"

#include "sp/policy/budget.h"
#include "sp/policy/errors.h"
#include "sp/policy/state_codec.h"

#include <sp/plugin_abi_v1.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

namespace sp::policy::testing {
namespace {

// Mode budget with every step a decision step and no cooldown; `extra` lines (indented by 2)
// replace the defaults of the keys they name.
std::string budget_config(const std::string &budget, const std::string &extra = "") {
  const std::vector<std::string> defaults = {"tiers: [bf16, int8, nf4]", "warmup_steps: 0",
                                             "update_interval_steps: 1", "min_steps_between_switches: 0",
                                             "telemetry_enabled: false", "log_decisions: false"};
  std::string text = "  mode: budget\n  budget: " + budget + "\n" + extra;
  for (const std::string &line : defaults) {
    const std::string key = "  " + line.substr(0, line.find(':') + 1);
    if (extra.find(key) == std::string::npos) text += "  " + line + "\n";
  }
  return standalone(text);
}

TEST(PolicyV3, BytesBudgetIsMetOnEveryStepWithChangingSignalsCooldownsAndForcedRoutes) {
  Driver driver(budget_config("{bytes: 0.45}",
                              "  update_interval_steps: 2\n  min_steps_between_switches: 3\n"
                              "  force_bf16_blocks: [0]\n  force_int8_blocks: [7]\n  signal_smoothing: 0.3\n"),
                kUnits);
  const std::uint64_t limit = static_cast<std::uint64_t>(0.45 * kUnits * kBf16);
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<double> cost(0.0, 0.05);
  std::size_t switches = 0;
  std::size_t cooldowns = 0;
  std::vector<sp_hint_v1> previous(kUnits);
  for (std::int64_t step = 0; step < 60; ++step) {
    std::vector<double> int8(kUnits);
    std::vector<double> nf4(kUnits);
    for (std::uint32_t u = 0; u < kUnits; ++u) {
      int8[u] = 0.1 * cost(rng);
      nf4[u] = cost(rng);
    }
    const Signals signals = Signals::costs(int8, nf4, 2.0);
    const std::vector<sp_hint_v1> &hints = step_with(driver, step, step % 3 == 0 ? &signals : nullptr);
    ASSERT_LE(bytes_of(hints), limit) << "step " << step;
    EXPECT_EQ(hints[0].precision, SP_PRECISION_BF16);
    EXPECT_EQ(hints[0].reason, SP_REASON_FORCED);
    EXPECT_EQ(hints[7].precision, SP_PRECISION_INT8);
    const sp_budget_status_v1 status = status_of(driver.engine());
    EXPECT_EQ(status.met, 1u) << "step " << step;
    EXPECT_EQ(status.reads_step_signals, 1u) << "v3 decides with the steps' Taylor table";
    EXPECT_LE(status.planned_bytes_fraction, 0.45);
    for (std::uint32_t u = 0; u < kUnits; ++u) {
      if (step > 0 && hints[u].precision != previous[u].precision) ++switches;
      if (hints[u].reason == SP_REASON_COOLDOWN) ++cooldowns;
      EXPECT_TRUE(std::isnan(hints[u].sensitivity) || (hints[u].sensitivity >= 0.0 && hints[u].sensitivity <= 1.0));
    }
    previous = hints;
  }
  // The run exercised what it claims to: the allocation moved, and cooldowns held units.
  EXPECT_GT(switches, 5u);
  EXPECT_GT(cooldowns, 0u);
}

TEST(PolicyV3, SignalsBeforeTheFirstStepDecideStepZero) {
  Driver driver(budget_config("{bytes: 0.45}", "  warmup_steps: 10\n  update_interval_steps: 10\n"), kUnits);
  // Units 3 and 5 are hurt badly by NF4, the others barely.
  std::vector<double> nf4(kUnits, 0.001);
  nf4[3] = nf4[5] = 1.0;
  send(driver.engine(), -1, Signals::costs(std::vector<double>(kUnits, 0.0001), nf4, 2.0));
  const std::vector<sp_hint_v1> &hints = step_with(driver, 0, nullptr);
  EXPECT_LE(bytes_of(hints), static_cast<std::uint64_t>(0.45 * kUnits * kBf16));
  EXPECT_NE(hints[3].precision, SP_PRECISION_NF4);
  EXPECT_NE(hints[5].precision, SP_PRECISION_NF4);
  // 0.45 of the bytes: INT8 (the cheaper damage per byte saved) everywhere falls short, so two
  // units go NF4, none of them 3 or 5.
  EXPECT_EQ(count(hints, SP_PRECISION_NF4), 2u);
  EXPECT_EQ(count(hints, SP_PRECISION_BF16), 0u);
  for (const sp_hint_v1 &hint : hints) EXPECT_EQ(hint.reason, SP_REASON_BUDGET);
  EXPECT_DOUBLE_EQ(hints[3].sensitivity, 1.0);
  EXPECT_DOUBLE_EQ(hints[0].sensitivity, 0.001);
  const sp_budget_status_v1 status = status_of(driver.engine());
  EXPECT_EQ(status.decided_at_step, 0);
  EXPECT_EQ(status.kind, SP_BUDGET_BYTES);
  EXPECT_EQ(status.met, 1u);
}

TEST(PolicyV3, WithoutSignalsABytesBudgetFollowsTheStructuralPriorFromStepZero) {
  Driver driver(budget_config("{bytes: 0.45}"), kUnits);
  const std::vector<sp_hint_v1> &hints = step_with(driver, 0, nullptr);
  EXPECT_LE(bytes_of(hints), static_cast<std::uint64_t>(0.45 * kUnits * kBf16));
  // use_more_bits of 8 units: 0 and 7 (the first and last eighth) and 3 and 6 (every third);
  // the others cost half as much per byte and go first.
  for (std::uint32_t u : {1u, 2u, 4u, 5u}) EXPECT_EQ(hints[u].precision, SP_PRECISION_NF4) << "unit " << u;
  for (const sp_hint_v1 &hint : hints) {
    EXPECT_EQ(hint.reason, SP_REASON_NO_DATA);
    EXPECT_TRUE(std::isnan(hint.sensitivity));
  }
  EXPECT_TRUE(std::isnan(status_of(driver.engine()).planned_cost));
  EXPECT_EQ(gets_more_bits(2, 6), true);
  EXPECT_EQ(gets_more_bits(5, 6), true);
  EXPECT_EQ(gets_more_bits(0, 6), false);
}

TEST(PolicyV3, WithoutSignalsALossBudgetKeepsBf16UntilMeasured) {
  Driver driver(budget_config("{loss: 0.01}", "  switch_margin: 0\n"), kUnits);
  for (const sp_hint_v1 &hint : step_with(driver, 0, nullptr)) {
    EXPECT_EQ(hint.precision, SP_PRECISION_BF16);
    EXPECT_EQ(hint.reason, SP_REASON_NO_DATA);
  }
  EXPECT_EQ(status_of(driver.engine()).met, 0u);
  EXPECT_EQ(status_of(driver.engine()).decided_at_step, -1);
}

TEST(PolicyV3, LossBudgetTakesTheFewestBytesWithinTheLimit) {
  Driver driver(budget_config("{loss: 0.0101}", "  switch_margin: 0\n  signal_smoothing: 0\n"), kUnits);
  const Signals signals = Signals::costs(std::vector<double>(kUnits, 0.001), std::vector<double>(kUnits, 0.004), 2.0);
  // Limit 0.0202: four NF4 and four INT8 (0.02) move fewer bytes than five NF4 and two INT8 (0.022
  // would not fit) or any other mix.
  const std::vector<sp_hint_v1> &hints = step_with(driver, 0, &signals);
  EXPECT_EQ(count(hints, SP_PRECISION_NF4), 4u);
  EXPECT_EQ(count(hints, SP_PRECISION_INT8), 4u);
  EXPECT_EQ(bytes_of(hints), 4 * kNf4 + 4 * kInt8);
  sp_budget_status_v1 status = status_of(driver.engine());
  EXPECT_EQ(status.kind, SP_BUDGET_LOSS);
  EXPECT_EQ(status.met, 1u);
  EXPECT_NEAR(status.planned_cost, 0.02, 1e-12);
  EXPECT_DOUBLE_EQ(status.reference_loss, 2.0);
  // The training loss halves: the same costs are now twice the share, and units move back up.
  sp_step_feedback_v1 feedback{};
  feedback.struct_size = sizeof feedback;
  feedback.loss = 1.0;
  step_with(driver, 1, nullptr, {}, &feedback);
  const std::vector<sp_hint_v1> &after = step_with(driver, 2, &signals);
  status = status_of(driver.engine());
  EXPECT_DOUBLE_EQ(status.reference_loss, 1.0);
  EXPECT_EQ(status.met, 1u);
  EXPECT_LE(status.planned_cost, 0.0101);
  EXPECT_GT(bytes_of(after), 4 * kNf4 + 4 * kInt8);
}

TEST(PolicyV3, AReallocationMovesAUnitOnlyWhenTheGainPassesTheMargin) {
  // Two units, room for one NF4 image: the cheaper one to damage takes it.
  const auto run = [](const std::string &margin) {
    Driver driver(standalone("  mode: budget\n  budget: {bytes: 0.633}\n  tiers: [bf16, nf4]\n  warmup_steps: 0\n"
                             "  update_interval_steps: 2\n  min_steps_between_switches: 0\n  signal_smoothing: 0\n"
                             "  switch_margin: " +
                             margin + "\n  telemetry_enabled: false\n  log_decisions: false\n"),
                  2);
    const auto table = [](double unit0, double unit1) {
      return Signals{{"loss_cost.nf4"}, {unit0, unit1}, 1.0};
    };
    std::vector<std::vector<sp_precision>> trace;
    const auto at = [&](std::int64_t step, const Signals &signals) {
      PolicyEngine &engine = driver.engine();
      engine.begin_step(step);
      send(engine, step, signals);
      std::vector<sp_hint_v1> hints(2);
      engine.compute_hints(step, hints.data(), 2);
      engine.end_step(step, nullptr);
      trace.push_back({hints[0].precision, hints[1].precision});
    };
    at(0, table(0.010, 0.011));
    at(2, table(0.0115, 0.011));  // unit 1 is now cheaper by 0.0005, less than the margin of 0.002
    at(4, table(0.020, 0.011));   // now by 0.009
    return trace;
  };
  using P = std::vector<sp_precision>;
  const std::vector<P> with_margin = run("0.002");
  EXPECT_EQ(with_margin[0], (P{SP_PRECISION_NF4, SP_PRECISION_BF16}));
  EXPECT_EQ(with_margin[1], (P{SP_PRECISION_NF4, SP_PRECISION_BF16})) << "held by the margin";
  EXPECT_EQ(with_margin[2], (P{SP_PRECISION_BF16, SP_PRECISION_NF4}));
  const std::vector<P> without = run("0");
  EXPECT_EQ(without[1], (P{SP_PRECISION_BF16, SP_PRECISION_NF4})) << "without a margin the small gain moves it";
}

TEST(PolicyV3, AnUnsafeGradientRaisesAUnitAndTheOthersMakeRoomAtOnce) {
  Driver driver(budget_config("{bytes: 0.45}", "  update_interval_steps: 100\n"), kUnits);
  send(driver.engine(), -1,
       Signals::costs(std::vector<double>(kUnits, 0.001), {0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08}, 1.0));
  const std::uint64_t limit = static_cast<std::uint64_t>(0.45 * kUnits * kBf16);
  const std::vector<sp_hint_v1> first = step_with(driver, 0, nullptr);
  ASSERT_NE(first[0].precision, SP_PRECISION_BF16);
  const std::vector<sp_hint_v1> &hints = step_with(driver, 1, nullptr, {nonfinite_moments(0)});
  EXPECT_EQ(hints[0].precision, SP_PRECISION_BF16);
  EXPECT_EQ(hints[0].reason, SP_REASON_UNSAFE);
  EXPECT_LE(bytes_of(hints), limit);
  EXPECT_EQ(status_of(driver.engine()).decided_at_step, 1);
}

TEST(PolicyV3, TheLossGuardRevertsAMoveDownAndItsPenaltyHoldsTheUnit) {
  Driver driver(budget_config("{bytes: 0.8}",
                              "  tiers: [bf16, nf4]\n  signal_smoothing: 0\n  switch_margin: 0\n"
                              "  loss_guard: {enabled: true, window: 2, sigmas: 1, min_rise: 0.1, blame_steps: 5, "
                              "penalty_steps: 4}\n"),
                2);
  const Signals prefer_unit1 = Signals{{"loss_cost.nf4"}, {0.05, 0.01}, 1.0};
  sp_step_feedback_v1 feedback{};
  feedback.struct_size = sizeof feedback;
  std::vector<sp_hint_v1> hints(2);
  const auto at = [&](std::int64_t step, const Signals &signals, double loss) {
    PolicyEngine &engine = driver.engine();
    engine.begin_step(step);
    send(engine, step, signals);
    engine.compute_hints(step, hints.data(), 2);
    feedback.loss = loss;
    engine.end_step(step, &feedback);
  };
  at(0, prefer_unit1, 1.0);
  EXPECT_EQ(hints[1].precision, SP_PRECISION_NF4);
  at(1, prefer_unit1, 1.0);
  at(2, prefer_unit1, 5.0);  // a spike: unit 1 moved down at step 0
  at(3, prefer_unit1, 1.0);
  EXPECT_EQ(hints[1].precision, SP_PRECISION_BF16);
  EXPECT_EQ(hints[1].reason, SP_REASON_LOSS_GUARD);
  EXPECT_EQ(hints[0].precision, SP_PRECISION_NF4) << "the others make room for the revert";
  at(4, prefer_unit1, 1.0);
  EXPECT_EQ(hints[1].precision, SP_PRECISION_BF16);
  EXPECT_EQ(hints[1].reason, SP_REASON_PENALTY);
  at(7, prefer_unit1, 1.0);  // the penalty ends at step 3 + 4
  EXPECT_EQ(hints[1].precision, SP_PRECISION_NF4);
}

TEST(PolicyV3, ASignalTableIsValidatedCompletelyBeforeAnythingChanges) {
  Driver driver(budget_config("{bytes: 0.45}"), kUnits);
  PolicyEngine &engine = driver.engine();
  const std::vector<std::uint8_t> before = engine.export_state();
  const auto rejected = [&](Signals signals, std::int64_t step, const std::string &part) {
    std::vector<const char *> names;
    sp_unit_signals_v1 table = signals.view(names);
    try {
      engine.set_unit_signals(step, &table);
      ADD_FAILURE() << "accepted a table that should say: " << part;
    } catch (const InvalidArgument &error) {
      EXPECT_NE(std::string(error.what()).find(part), std::string::npos) << error.what();
    }
    EXPECT_EQ(engine.export_state(), before);
  };
  const Signals good = Signals::costs(std::vector<double>(kUnits, 0.1), std::vector<double>(kUnits, 0.2), 1.0);
  Signals infinite = good;
  infinite.values[7] = std::numeric_limits<double>::infinity();
  rejected(infinite, -1, "unit 3 has inf in column 'loss_cost.nf4'");
  Signals repeated = good;
  repeated.names[1] = "loss_cost.int8";
  rejected(repeated, -1, "signal_names[1] repeats 'loss_cost.int8'");
  Signals short_table = good;
  short_table.values.resize(2 * (kUnits - 1));
  rejected(short_table, -1, "n_units = 7, but the policy was created for 8 blocks");
  rejected(good, 0, "step 0 is outside [-1, -1]");
  Signals infinite_loss = good;
  infinite_loss.loss = std::numeric_limits<double>::infinity();
  rejected(infinite_loss, -1, "loss is inf");
  EXPECT_THROW(engine.set_unit_signals(-1, nullptr), InvalidArgument);

  // Unknown columns are ignored, NaN is "not measured", components are recorded.
  Signals extra{{"output_error", "loss_cost.nf4", "first_order.nf4"}, {}, kNaN};
  for (std::uint32_t u = 0; u < kUnits; ++u) extra.values.insert(extra.values.end(), {9.0, u == 2 ? kNaN : 0.5, -0.25});
  send(engine, -1, extra);
  std::vector<double> costs(kUnits);
  engine.unit_costs(SP_PRECISION_NF4, costs.data(), kUnits);
  EXPECT_DOUBLE_EQ(costs[0], 0.5);
  EXPECT_TRUE(std::isnan(costs[2]));
  engine.unit_costs(SP_PRECISION_INT8, costs.data(), kUnits);
  EXPECT_TRUE(std::isnan(costs[0]));
  EXPECT_DOUBLE_EQ(engine.state().budget.units[0].first_order[SP_PRECISION_NF4], -0.25);
  // Smoothing: 0.5 * 0.5 + 0.5 * 0.1.
  send(engine, -1, Signals{{"loss_cost.nf4"}, std::vector<double>(kUnits, 0.1), kNaN});
  engine.unit_costs(SP_PRECISION_NF4, costs.data(), kUnits);
  EXPECT_DOUBLE_EQ(costs[0], 0.3);
  EXPECT_DOUBLE_EQ(costs[2], 0.1);
}

TEST(PolicyV3, StateIsFormatThreeAndRoundTripsAndBadBlobsChangeNothing) {
  Driver source(budget_config("{bytes: 0.45}", "  min_steps_between_switches: 2\n"), kUnits);
  const Signals signals = Signals::costs(std::vector<double>(kUnits, 0.001), {1, 2, 3, 4, 5, 6, 7, 8}, 1.5);
  for (std::int64_t step = 0; step < 4; ++step) step_with(source, step, &signals);
  const std::vector<std::uint8_t> blob = source.engine().export_state();
  EXPECT_EQ(blob[8], 3u);
  Driver target(budget_config("{bytes: 0.45}", "  min_steps_between_switches: 2\n"), kUnits);
  target.engine().import_state(blob.data(), blob.size());
  EXPECT_EQ(target.engine().export_state(), blob);
  // Both continue alike.
  EXPECT_EQ(bytes_of(step_with(source, 4, &signals)), bytes_of(step_with(target, 4, &signals)));

  Driver fresh(budget_config("{bytes: 0.45}"), kUnits);
  const std::vector<std::uint8_t> before = fresh.engine().export_state();
  EXPECT_EQ(before[8], 2u) << "no v3 state yet: format 2, which 2.0.0 reads";
  for (std::size_t size = 0; size < blob.size(); size += 7) {
    EXPECT_THROW(fresh.engine().import_state(blob.data(), size), StateError);
    ASSERT_EQ(fresh.engine().export_state(), before);
  }
  PolicyState decoded = decode_state(blob.data(), blob.size(), kUnits, 5);
  decoded.budget.units[3].cost[SP_PRECISION_NF4] = std::numeric_limits<double>::infinity();
  const std::vector<std::uint8_t> bad = encode_state(decoded);
  try {
    fresh.engine().import_state(bad.data(), bad.size());
    ADD_FAILURE() << "accepted an infinite cost";
  } catch (const StateError &error) {
    EXPECT_NE(std::string(error.what()).find("smoothed loss cost must be finite or NaN"), std::string::npos);
  }
  EXPECT_EQ(fresh.engine().export_state(), before);
}

TEST(PolicyV3, TelemetryStatesTheBudgetAndEveryUnitsTier) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("sp_policy_v3_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    Driver driver(standalone("  mode: budget\n  budget: {bytes: 0.5}\n  warmup_steps: 0\n  log_decisions: false\n"
                             "  telemetry_file: v3.jsonl\n"),
                  kUnits, nullptr, dir.string());
    const Signals signals = Signals::costs(std::vector<double>(kUnits, 0.01), std::vector<double>(kUnits, kNaN), 4.0);
    step_with(driver, 0, &signals);
  }
  const nlohmann::json record = first_telemetry_record(dir / "v3.jsonl");
  ASSERT_FALSE(record.is_null());
  EXPECT_EQ(record["mode"], "budget");
  EXPECT_EQ(record["budget"]["kind"], "bytes");
  EXPECT_EQ(record["budget"]["limit"], 0.5);
  EXPECT_EQ(record["budget"]["met"], true);
  EXPECT_EQ(record["budget"]["source"], "signals");
  EXPECT_EQ(record["budget"]["granularity_bytes"], 1);
  EXPECT_LE(record["budget"]["planned_bytes_fraction"].get<double>(), 0.5);
  EXPECT_NEAR(record["budget"]["planned_cost"].get<double>(), 0.08, 1e-12);
  EXPECT_EQ(record["block_details"]["0"]["precision"], "int8");
  EXPECT_EQ(record["block_details"]["0"]["reason"], "budget");
  EXPECT_EQ(record["block_details"]["0"]["predicted_cost"]["int8"], 0.01);
  EXPECT_TRUE(record["block_details"]["0"]["predicted_cost"]["nf4"].is_null());
  std::filesystem::remove_all(dir);
}

// ---- Config ----

std::string config_error(const std::string &yaml, std::uint32_t blocks = kUnits) {
  try {
    const ParsedConfig parsed = parse_policy_config(yaml, blocks);
    BlockBytes bytes;
    bytes[SP_PRECISION_BF16] = kBf16;
    bytes[SP_PRECISION_INT8] = kInt8;
    check_budget_feasible(parsed, std::vector<BlockBytes>(blocks, bytes));
  } catch (const PolicyError &error) {
    return error.what();
  }
  return "(accepted)";
}

TEST(PolicyV3Config, EveryErrorNamesTheKeyAndWhatWasExpected) {
  const std::string kPath = "selective_precision.";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {standalone("  mode: budget\n"), kPath + "budget: mode is budget, but no budget is given"},
      {standalone("  budget: {bytes: 0.5}\n"), kPath + "budget: a budget needs mode: budget or measured, found mode: dynamic"},
      {standalone("  mode: budget\n  budget: {bytes: 0.5, loss: 0.01}\n"),
       kPath + "budget.loss: bytes and loss are both given; expected exactly one budget"},
      {standalone("  mode: budget\n  budget: {bytes: 1.5}\n"),
       kPath + "budget.bytes: expected a fraction of the all-BF16 bytes in (0, 1], found 1.5"},
      {standalone("  mode: budget\n  budget: {bytes: 0}\n"), kPath + "budget.bytes: expected a fraction"},
      {standalone("  mode: budget\n  budget: {loss: -0.01}\n"),
       kPath + "budget.loss: expected a finite fraction of the current loss > 0, found -0.01"},
      {standalone("  mode: budget\n  budget: {byts: 0.5}\n"),
       kPath + "budget.byts: unknown key; did you mean 'bytes'?"},
      {standalone("  mode: budget\n  budget: 0.5\n"), kPath + "budget: expected a mapping with exactly one of bytes"},
      {standalone("  mode: budget\n  budget: {}\n"), kPath + "budget: expected a mapping with exactly one of bytes"},
      {standalone("  mode: budget\n  budget: {bytes: \"0.5\"}\n"), kPath + "budget.bytes: expected a fraction"},
      {standalone("  signal_smoothing: 1\n"), kPath + "signal_smoothing: expected a number in [0, 1), found 1"},
      {standalone("  switch_margin: -0.1\n"), kPath + "switch_margin: expected a finite number >= 0, found -0.1"},
      {standalone("  mode: adaptive\n"), kPath + "mode: expected one of off, static, dynamic, budget, measured, found 'adaptive'"},
      // Force lists and tiers bound what a bytes budget can reach: 4 x 2000 + 4 x 1000 of 16000.
      {standalone("  mode: budget\n  budget: {bytes: 0.7}\n  force_bf16_blocks: [0, 1, 2, 3]\n"),
       kPath + "budget.bytes: expected at least 0.75 (the fewest bytes the tiers without nf4 and the force lists "
               "allow: 12000 of 16000 all-BF16 bytes), found 0.7"},
  };
  for (const auto &[yaml, expected] : cases) {
    EXPECT_NE(config_error(yaml).find(expected), std::string::npos) << yaml << "\n-> " << config_error(yaml);
  }
  EXPECT_EQ(config_error(standalone("  mode: budget\n  budget: {bytes: 0.75}\n  force_bf16_blocks: [0, 1, 2, 3]\n")),
            "(accepted)");
  EXPECT_EQ(config_error(budget_config("{bytes: 0.2661}")), "(accepted)");
  EXPECT_NE(config_error(budget_config("{bytes: 0.26}")).find("budget.bytes: expected at least 0.266"), std::string::npos);
}

// ---- Through the plugins' C tables ----

std::vector<sp_block_desc_v1> descs() {
  std::vector<sp_block_desc_v1> blocks;
  for (std::uint32_t b = 0; b < kUnits; ++b) blocks.push_back({sizeof(sp_block_desc_v1), b, 1000, kBf16, kInt8, nullptr});
  return blocks;
}

TEST(PolicyV3Plugin, TheTablesDescribeTheirMinors) {
  const LoadedPlugin v3(SP_POLICY_PLUGIN_PATH);
  const LoadedPlugin v2(SP_POLICY_PLUGIN_V2_EDITION_PATH);
  ASSERT_TRUE(v3.loaded() && v2.loaded()) << dlerror();
  EXPECT_STREQ(v3->plugin_version, "4.0.0");
  EXPECT_EQ(v3->abi_minor, 4u);
  EXPECT_NE(v3->initial_hints, nullptr);
  EXPECT_NE(v3->set_unit_signals, nullptr);
  EXPECT_NE(v3->get_unit_costs, nullptr);
  EXPECT_NE(v3->get_budget_status, nullptr);
  EXPECT_STREQ(v2->plugin_version, "2.0.0");
  EXPECT_EQ(v2->abi_minor, 1u);
  EXPECT_EQ(v2->struct_size, SP_PLUGIN_TABLE_V1_1_SIZE);
  // v3's keys are unknown keys to 2.0.0.
  const sp_host_api_v1 host = all_routes_host();
  const std::vector<sp_block_desc_v1> blocks = descs();
  sp_policy_ctx *ctx = nullptr;
  const std::string config = budget_config("{bytes: 0.45}");
  EXPECT_EQ(v2->create(&host, config.c_str(), blocks.data(), kUnits, &ctx), SP_ERR_CONFIG);
  EXPECT_NE(std::string(v2->last_error(nullptr)).find("mode: expected one of off, static, dynamic, found 'budget'"),
            std::string::npos)
      << v2->last_error(nullptr);
}

TEST(PolicyV3Plugin, SignalsCostsAndBudgetStatusThroughTheTable) {
  const LoadedPlugin plugin(SP_POLICY_PLUGIN_PATH);
  ASSERT_TRUE(plugin.loaded()) << dlerror();
  const sp_host_api_v1 host = all_routes_host();
  const std::vector<sp_block_desc_v1> blocks = descs();
  sp_policy_ctx *ctx = nullptr;
  std::string config = budget_config("{bytes: 0.2}");
  ASSERT_EQ(plugin->create(&host, config.c_str(), blocks.data(), kUnits, &ctx), SP_ERR_CONFIG);
  EXPECT_NE(std::string(plugin->last_error(nullptr)).find("budget.bytes: expected at least 0.266"), std::string::npos);
  config = budget_config("{bytes: 0.45}");
  ASSERT_EQ(plugin->create(&host, config.c_str(), blocks.data(), kUnits, &ctx), SP_OK) << plugin->last_error(nullptr);
  const Signals signals = Signals::costs(std::vector<double>(kUnits, 0.002), std::vector<double>(kUnits, 0.01), 2.0);
  std::vector<const char *> names;
  const sp_unit_signals_v1 table = signals.view(names);
  ASSERT_EQ(plugin->set_unit_signals(ctx, -1, &table), SP_OK) << plugin->last_error(ctx);
  EXPECT_EQ(plugin->set_unit_signals(ctx, 3, &table), SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(plugin->last_error(ctx)).find("step 3 is outside"), std::string::npos);
  std::vector<sp_hint_v1> hints(kUnits);
  ASSERT_EQ(plugin->begin_step(ctx, 0), SP_OK);
  ASSERT_EQ(plugin->compute_hints(ctx, 0, hints.data(), kUnits), SP_OK);
  EXPECT_LE(bytes_of(hints), static_cast<std::uint64_t>(0.45 * kUnits * kBf16));
  std::vector<double> costs(kUnits);
  ASSERT_EQ(plugin->get_unit_costs(ctx, SP_PRECISION_NF4, costs.data(), kUnits), SP_OK);
  EXPECT_DOUBLE_EQ(costs[4], 0.01);
  EXPECT_EQ(plugin->get_unit_costs(ctx, 7, costs.data(), kUnits), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(plugin->get_unit_costs(ctx, SP_PRECISION_NF4, costs.data(), kUnits - 1), SP_ERR_INVALID_ARGUMENT);
  sp_budget_status_v1 status{};
  EXPECT_EQ(plugin->get_budget_status(ctx, &status), SP_ERR_INVALID_ARGUMENT) << "struct_size 0";
  status.struct_size = sizeof status;
  ASSERT_EQ(plugin->get_budget_status(ctx, &status), SP_OK);
  EXPECT_EQ(status.kind, SP_BUDGET_BYTES);
  EXPECT_DOUBLE_EQ(status.limit, 0.45);
  EXPECT_EQ(status.met, 1u);
  EXPECT_EQ(status.decided_at_step, 0);
  EXPECT_EQ(status.reads_step_signals, 1u);
  // A host of 1.2 or 1.3 hands the 1.2 layout: nothing beyond it is written.
  sp_budget_status_v1 older{};
  older.struct_size = SP_BUDGET_STATUS_V1_2_SIZE;
  older.reads_step_signals = 7;
  ASSERT_EQ(plugin->get_budget_status(ctx, &older), SP_OK);
  EXPECT_EQ(older.met, 1u);
  EXPECT_EQ(older.reads_step_signals, 7u);
  plugin->destroy(ctx);
}

// A live upgrade from 2.0.0 (ABI 1.1) to 4.0.0 in mode budget: the v2 blob's assignments, switch
// steps and loss-guard state carry over, the cooldown still holds, and the budget is met.
TEST(PolicyV3Plugin, AV2StateMigratesIntoABudgetPolicy) {
  const LoadedPlugin v2(SP_POLICY_PLUGIN_V2_EDITION_PATH);
  ASSERT_TRUE(v2.loaded()) << dlerror();
  const sp_host_api_v1 host = all_routes_host();
  const std::vector<sp_block_desc_v1> blocks = descs();
  const std::string guard = "  loss_guard: {enabled: true, window: 3}\n  min_steps_between_switches: 6\n";
  const std::string v2_config = standalone(
      "  tiers: [bf16, int8, nf4]\n  warmup_steps: 0\n  update_interval_steps: 1\n  telemetry_enabled: false\n"
      "  log_decisions: false\n" +
      guard);
  sp_policy_ctx *ctx = nullptr;
  ASSERT_EQ(v2->create(&host, v2_config.c_str(), blocks.data(), kUnits, &ctx), SP_OK) << v2->last_error(nullptr);
  std::vector<sp_hint_v1> hints(kUnits);
  for (std::int64_t step = 0; step < 8; ++step) {
    std::vector<sp_grad_moments_v1> moments;
    for (std::uint32_t b = 0; b < kUnits; ++b) moments.push_back(moments_with_l2(b, b < 4 ? 0.1 : 5.0 + step));
    sp_step_feedback_v1 feedback{};
    feedback.struct_size = sizeof feedback;
    feedback.loss = 1.0 + 0.01 * static_cast<double>(step);
    ASSERT_EQ(v2->begin_step(ctx, step), SP_OK);
    ASSERT_EQ(v2->post_backward(ctx, step, moments.data(), kUnits), SP_OK);
    ASSERT_EQ(v2->compute_hints(ctx, step, hints.data(), kUnits), SP_OK);
    ASSERT_EQ(v2->end_step(ctx, step, &feedback), SP_OK);
  }
  std::uint64_t size = 0;
  v2->export_state(ctx, nullptr, 0, &size);
  std::vector<std::uint8_t> blob(size);
  ASSERT_EQ(v2->export_state(ctx, blob.data(), size, &size), SP_OK);
  v2->destroy(ctx);
  ASSERT_EQ(blob[8], 2u);
  const PolicyState exported = decode_state(blob.data(), blob.size(), kUnits, 5);
  ASSERT_EQ(count(hints, SP_PRECISION_BF16), 4u) << "the v2 run moved the quiet blocks down";

  Driver v3(budget_config("{bytes: 0.45}", guard), kUnits);
  v3.engine().import_state(blob.data(), blob.size());
  const PolicyState &imported = v3.engine().state();
  for (std::uint32_t b = 0; b < kUnits; ++b) {
    EXPECT_EQ(imported.blocks[b].assignment, exported.blocks[b].assignment) << "block " << b;
    EXPECT_EQ(imported.blocks[b].last_switch_step, exported.blocks[b].last_switch_step) << "block " << b;
    EXPECT_EQ(imported.blocks[b].last_down_move.has_value(), exported.blocks[b].last_down_move.has_value());
  }
  EXPECT_EQ(imported.loss_window.losses, exported.loss_window.losses);
  ASSERT_FALSE(imported.loss_window.losses.empty());

  // Step 8: units that switched within the cooldown keep their tier; the rest meet the budget.
  const Signals signals = Signals::costs(std::vector<double>(kUnits, 0.001), std::vector<double>(kUnits, 0.002), 1.0);
  const std::vector<sp_hint_v1> &after = step_with(v3, 8, &signals);
  EXPECT_LE(bytes_of(after), static_cast<std::uint64_t>(0.45 * kUnits * kBf16));
  for (std::uint32_t b = 0; b < kUnits; ++b) {
    const std::optional<std::int64_t> &switched = exported.blocks[b].last_switch_step;
    if (switched && 8 - *switched < 6) {
      EXPECT_EQ(after[b].reason, SP_REASON_COOLDOWN) << "block " << b;
      EXPECT_EQ(after[b].precision, hints[b].precision) << "block " << b;
    }
  }
  // And through the table: 4.0.0 imports the blob 2.0.0 exported.
  const LoadedPlugin plugin(SP_POLICY_PLUGIN_PATH);
  ASSERT_TRUE(plugin.loaded()) << dlerror();
  const std::string v3_config = budget_config("{bytes: 0.45}", guard);
  ASSERT_EQ(plugin->create(&host, v3_config.c_str(), blocks.data(), kUnits, &ctx), SP_OK) << plugin->last_error(nullptr);
  EXPECT_EQ(plugin->import_state(ctx, blob.data(), blob.size()), SP_OK) << plugin->last_error(ctx);
  plugin->destroy(ctx);
}

}  // namespace
}  // namespace sp::policy::testing
