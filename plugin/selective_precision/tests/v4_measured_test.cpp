// Policy v4 (mode measured): the prior from the first step's routes, then the allocation by
// the measured costs' upper bounds, hysteresis in standard errors, no decision after
// decide_until_step; its config, its own state section and hot swaps with v3 (docs/policy.md,
// "Policy v4").
#include "budget_test_support.h"
#include "policy_test_support.h"
#include "loaded_plugin.h"

#include "sp/policy/budget.h"
#include "sp/policy/errors.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <array>
#include <filesystem>
#include <fstream>
#include <unistd.h>
#include <cmath>
#include <string>
#include <vector>

namespace sp::policy::testing {
namespace {

// Tiers bf16 and nf4, every step a decision step, no cooldown; `extra` lines (indented by 2).
std::string measured_config(const std::string &budget, const std::string &extra = "") {
  return standalone("  mode: measured\n  budget: " + budget +
                    "\n  tiers: [bf16, nf4]\n  warmup_steps: 0\n  update_interval_steps: 1\n"
                    "  min_steps_between_switches: 0\n  telemetry_enabled: false\n  log_decisions: false\n" +
                    extra);
}

// 0.92 of the all-BF16 bytes (14720 of 16000): one unit in NF4 (1468 saved) meets it, and a second
// would only add its cost.
constexpr const char *kOneNf4 = "{bytes: 0.92}";

// A measurement as calibrate sends it: NF4's mean, standard error and upper bound per unit.
Signals measured(const std::vector<double> &mean, const std::vector<double> &se, const std::vector<double> &upper) {
  Signals table{{"measured_cost.nf4", "measured_cost_se.nf4", "measured_cost_upper.nf4"}, {}, kNaN};
  for (std::size_t u = 0; u < mean.size(); ++u) {
    table.values.insert(table.values.end(), {mean[u], se[u], upper[u]});
  }
  return table;
}

// Every unit at mean 0.08, se 0.01, upper 0.1 except those given.
Signals measured_with(const std::vector<std::pair<std::uint32_t, std::array<double, 3>>> &units) {
  std::vector<double> mean(kUnits, 0.08), se(kUnits, 0.01), upper(kUnits, 0.1);
  for (const auto &[u, values] : units) {
    mean[u] = values[0];
    se[u] = values[1];
    upper[u] = values[2];
  }
  return measured(mean, se, upper);
}

std::vector<sp_hint_v1> initial(PolicyEngine &engine) {
  std::vector<sp_hint_v1> hints(kUnits);
  engine.initial_hints(hints.data(), kUnits);
  return hints;
}

std::vector<std::uint32_t> nf4_units(const std::vector<sp_hint_v1> &hints) {
  std::vector<std::uint32_t> units;
  for (const sp_hint_v1 &hint : hints) {
    if (hint.precision == SP_PRECISION_NF4) units.push_back(hint.block_id);
  }
  return units;
}

TEST(PolicyV4, RoutesFromTheFirstStepByThePriorThenByTheUpperBoundsMeasuredBeforeIt) {
  Driver driver(measured_config(kOneNf4), kUnits);
  PolicyEngine &engine = driver.engine();
  const std::vector<sp_hint_v1> prior = initial(engine);
  ASSERT_EQ(nf4_units(prior).size(), 1u);
  // use_more_bits keeps units 0 and 7 (the first and last eighth) out of the prior's NF4.
  EXPECT_NE(nf4_units(prior)[0], 0u);
  EXPECT_NE(nf4_units(prior)[0], 7u);
  EXPECT_EQ(status_of(engine).decided_at_step, -1);

  // Unit 3's mean is the lowest, but its interval is wide; unit 5's upper bound is the lowest.
  send(engine, -1, measured_with({{3, {0.001, 0.025, 0.05}}, {5, {0.01, 0.001, 0.012}}}));
  const std::vector<sp_hint_v1> decided = initial(engine);
  EXPECT_EQ(nf4_units(decided), std::vector<std::uint32_t>{5});
  EXPECT_EQ(decided[5].reason, SP_REASON_BUDGET);
  const sp_budget_status_v1 status = status_of(engine);
  EXPECT_EQ(status.met, 1);
  EXPECT_DOUBLE_EQ(status.planned_cost, 0.012);
  EXPECT_TRUE(std::isnan(status.planned_loss_fraction)) << "a measured cost is not a fraction of the loss";
  EXPECT_EQ(status.reads_step_signals, 0u) << "v4 decides without the steps' Taylor table, so the host skips it";
  double costs[kUnits];
  engine.unit_costs(SP_PRECISION_NF4, costs, kUnits);
  EXPECT_DOUBLE_EQ(costs[3], 0.05);

  // The first step runs on those routes, and keeps them.
  EXPECT_EQ(nf4_units(step_with(driver, 0, nullptr)), std::vector<std::uint32_t>{5});
  EXPECT_LE(bytes_of(driver.hints()), static_cast<std::uint64_t>(0.92 * kUnits * kBf16));
}

TEST(PolicyV4, LeavesATierOnlyForAGainOfMoreThanSwitchSigmasStandardErrors) {
  Driver driver(measured_config(kOneNf4, "  switch_sigmas: 2\n"), kUnits);
  send(driver.engine(), -1, measured_with({{5, {0.01, 0.001, 0.012}}}));
  ASSERT_EQ(nf4_units(initial(driver.engine())), std::vector<std::uint32_t>{5});
  // Unit 2's upper bound is 0.001 lower, but moving to it costs 2 of its standard errors (0.002).
  const Signals close = measured_with({{5, {0.01, 0.001, 0.012}}, {2, {0.009, 0.001, 0.011}}});
  EXPECT_EQ(nf4_units(step_with(driver, 0, &close)), std::vector<std::uint32_t>{5});
  // 0.004 lower is beyond them.
  const Signals clear = measured_with({{5, {0.01, 0.001, 0.012}}, {2, {0.006, 0.001, 0.008}}});
  EXPECT_EQ(nf4_units(step_with(driver, 1, &clear)), std::vector<std::uint32_t>{2});
}

TEST(PolicyV4, MakesNoDecisionAfterDecideUntilStep) {
  Driver driver(measured_config(kOneNf4, "  decide_until_step: 3\n"), kUnits);
  send(driver.engine(), -1, measured_with({{5, {0.01, 0.001, 0.012}}}));
  ASSERT_EQ(nf4_units(initial(driver.engine())), std::vector<std::uint32_t>{5});
  const Signals better = measured_with({{5, {0.01, 0.001, 0.012}}, {2, {0.001, 0.001, 0.002}}});
  for (std::int64_t step = 0; step < 6; ++step) step_with(driver, step, step == 5 ? &better : nullptr);
  EXPECT_EQ(nf4_units(driver.hints()), std::vector<std::uint32_t>{5}) << "a table after step 3 moved a unit";
  EXPECT_EQ(status_of(driver.engine()).decided_at_step, -1);
  // A re-solve for another reason (the sizes, sent again) takes the costs it decided by, not the late table's.
  const std::vector<std::uint64_t> sizes(kUnits, kBf16);
  driver.engine().set_transfer_bytes(SP_PRECISION_BF16, sizes.data(), kUnits);
  EXPECT_EQ(nf4_units(step_with(driver, 6, nullptr)), std::vector<std::uint32_t>{5});
  EXPECT_EQ(status_of(driver.engine()).decided_at_step, 6);
}

TEST(PolicyV4, ATableWithoutMeasuredColumnsIsNotAMeasurement) {
  Driver driver(measured_config(kOneNf4), kUnits);
  const std::vector<std::uint32_t> prior = nf4_units(initial(driver.engine()));
  const Signals taylor = Signals::costs(std::vector<double>(kUnits, 0.0), std::vector<double>(kUnits, 0.0), 2.0);
  step_with(driver, 0, &taylor);
  EXPECT_EQ(nf4_units(driver.hints()), prior);
  EXPECT_TRUE(std::isnan(status_of(driver.engine()).planned_cost)) << "still the prior's allocation";
}

TEST(PolicyV4, RefusesAnIntervalThatDoesNotHoldItsMeanAndChangesNothing) {
  Driver driver(measured_config(kOneNf4), kUnits);
  send(driver.engine(), -1, measured_with({{5, {0.01, 0.001, 0.012}}}));
  const std::vector<std::uint8_t> before = driver.engine().export_state();
  try {
    send(driver.engine(), -1, measured_with({{4, {0.02, 0.001, 0.01}}}));
    ADD_FAILURE() << "an upper bound below its mean was taken";
  } catch (const InvalidArgument &error) {
    EXPECT_NE(std::string(error.what()).find("unit 4 has measured_cost.nf4 = 0.02"), std::string::npos) << error.what();
  }
  EXPECT_EQ(driver.engine().export_state(), before);
}

TEST(PolicyV4, RefusesValuesTheKnapsackCannotSum) {
  Driver driver(measured_config(kOneNf4), kUnits);
  try {
    send(driver.engine(), -1, measured_with({{2, {1e300, 0.0, 1e308}}}));
    ADD_FAILURE() << "a cost of 1e308 was taken";
  } catch (const InvalidArgument &error) {
    EXPECT_NE(std::string(error.what()).find("of magnitude at most"), std::string::npos) << error.what();
  }
}

TEST(PolicyV4, ItsMeasurementCrossesAHotSwapThroughV3AndBack) {
  Driver v4(measured_config(kOneNf4), kUnits);
  send(v4.engine(), -1, measured_with({{5, {0.01, 0.001, 0.012}}}));
  initial(v4.engine());
  step_with(v4, 0, nullptr);
  const std::vector<std::uint8_t> blob = v4.engine().export_state();

  // v3 takes it over: the shared state migrates, v4's section rides along unread.
  Driver v3(standalone("  mode: budget\n  budget: {bytes: 0.92}\n  tiers: [bf16, nf4]\n  warmup_steps: 0\n"
                       "  min_steps_between_switches: 0\n  telemetry_enabled: false\n"),
            kUnits);
  v3.engine().import_state(blob.data(), blob.size());
  EXPECT_EQ(v3.engine().state().blocks[5].assignment, Assignment::nf4);
  const std::vector<std::uint8_t> through_v3 = v3.engine().export_state();

  Driver back(measured_config(kOneNf4), kUnits);
  back.engine().import_state(through_v3.data(), through_v3.size());
  double costs[kUnits];
  back.engine().unit_costs(SP_PRECISION_NF4, costs, kUnits);
  EXPECT_DOUBLE_EQ(costs[5], 0.012);
  EXPECT_EQ(nf4_units(step_with(back, 1, nullptr)), std::vector<std::uint32_t>{5});

  // A v3 blob carries no measurement: v4 decides by the prior until it measures.
  Driver fresh_v3(standalone("  mode: budget\n  budget: {bytes: 0.92}\n  tiers: [bf16, nf4]\n  warmup_steps: 0\n"
                             "  telemetry_enabled: false\n"),
                  kUnits);
  const Signals taylor = Signals::costs(std::vector<double>(kUnits, 0.0), std::vector<double>(kUnits, 0.0), 2.0);
  step_with(fresh_v3, 0, &taylor);
  const std::vector<std::uint8_t> v3_blob = fresh_v3.engine().export_state();
  back.engine().import_state(v3_blob.data(), v3_blob.size());
  back.engine().unit_costs(SP_PRECISION_NF4, costs, kUnits);
  EXPECT_TRUE(std::isnan(costs[5]));
  step_with(back, 1, nullptr);
  EXPECT_TRUE(std::isnan(status_of(back.engine()).planned_cost)) << "the prior decides after a v3 blob";
}

TEST(PolicyV4, RefusesADamagedSectionOfItsOwnAndKeepsItsState) {
  Driver v4(measured_config(kOneNf4), kUnits);
  send(v4.engine(), -1, measured_with({{5, {0.01, 0.001, 0.012}}}));
  initial(v4.engine());
  std::vector<std::uint8_t> blob = v4.engine().export_state();
  Driver target(measured_config(kOneNf4), kUnits);
  const std::vector<std::uint8_t> before = target.engine().export_state();
  // The last value of the blob's last section (v4's; no measured choice stands, so none follows)
  // is unit 7's NF4 upper bound in the adopted measurement: make it -1, below its mean, and seal
  // the blob again.
  store_f64(blob, blob.size() - 4 - 8, -1.0);
  reseal(blob);
  try {
    target.engine().import_state(blob.data(), blob.size());
    ADD_FAILURE() << "a damaged measured-costs section was taken";
  } catch (const StateError &error) {
    EXPECT_NE(std::string(error.what()).find("unit 7 has a measured cost"), std::string::npos) << error.what();
  }
  EXPECT_EQ(target.engine().export_state(), before);
}

TEST(PolicyV4, TelemetryStatesTheMeasurementItDecidedBy) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("sp_policy_v4_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    Driver driver(standalone("  mode: measured\n  budget: " + std::string(kOneNf4) +
                             "\n  tiers: [bf16, nf4]\n  warmup_steps: 0\n  log_decisions: false\n"
                             "  telemetry_file: v4.jsonl\n"),
                  kUnits, nullptr, dir.string());
    send(driver.engine(), -1, measured_with({{5, {0.01, 0.001, 0.012}}}));
    initial(driver.engine());
    const Signals later = measured_with({{5, {0.01, 0.001, 0.012}}, {2, {0.02, 0.001, 0.03}}});
    step_with(driver, 0, &later);
  }
  const nlohmann::json record = first_telemetry_record(dir / "v4.jsonl");
  ASSERT_FALSE(record.is_null());
  EXPECT_EQ(record["mode"], "measured");
  EXPECT_EQ(record["budget"]["source"], "measured");
  EXPECT_NEAR(record["budget"]["planned_cost"].get<double>(), 0.012, 1e-12);
  EXPECT_EQ(record["measured"]["tables"], 2);
  EXPECT_EQ(record["measured"]["last_step"], 0);
  EXPECT_EQ(record["measured"]["adopted"], true);
  EXPECT_EQ(record["measured"]["switch_sigmas"], 2.0);
  EXPECT_TRUE(record["measured"]["decide_until_step"].is_null());
  EXPECT_EQ(record["measured"]["boundary_swaps"], 2);
  EXPECT_EQ(record["measured"]["measured_choice"], false);
  EXPECT_FALSE(record["measured"].contains("last_swaps")) << "no swap was measured";
  EXPECT_EQ(record["measured"]["drift"]["sigmas"], 4.0);
  EXPECT_EQ(record["measured"]["drift"]["window"], 8);
  EXPECT_EQ(record["measured"]["drift"]["wanted"], false);
  EXPECT_EQ(record["measured"]["drift"]["requests"], 0);
  EXPECT_TRUE(record["block_details"]["2"]["drift_evidence"].is_null()) << "no window was tested yet";
  EXPECT_EQ(record["block_details"]["5"]["precision"], "nf4");
  EXPECT_EQ(record["block_details"]["2"]["measured_cost"]["nf4"]["upper"], 0.03);
  EXPECT_TRUE(record["block_details"]["2"]["measured_cost"]["int8"]["mean"].is_null());
  EXPECT_FALSE(record["block_details"]["2"].contains("predicted_cost")) << "v3's fields are v3's";
  std::filesystem::remove_all(dir);
}

// ---- the swaps at the boundary, measured jointly (ABI 1.4) ----

// What a host measured of `proposal`: allocation k's cost and its paired difference from
// allocation 0, each as (mean, upper bound).
sp_allocation_measurements_v1 measurement_of(const std::vector<std::vector<sp_precision>> &proposal,
                                             std::vector<sp_precision> &routes, const std::vector<double> &cost,
                                             const std::vector<double> &cost_upper, const std::vector<double> &difference,
                                             const std::vector<double> &difference_upper) {
  routes.clear();
  for (const std::vector<sp_precision> &row : proposal) routes.insert(routes.end(), row.begin(), row.end());
  return sp_allocation_measurements_v1{sizeof(sp_allocation_measurements_v1),
                                       static_cast<std::uint32_t>(proposal.size()),
                                       kUnits,
                                       0,
                                       routes.data(),
                                       cost.data(),
                                       cost_upper.data(),
                                       difference.data(),
                                       difference_upper.data(),
                                       256,
                                       0.95};
}

// Every unit's post_backward moments, a gradient of 1000 elements of magnitude `scale` (unit `odd`'s
// `odd_scale` times that), each unit's a little apart.
std::vector<sp_grad_moments_v1> gradients(double scale, double odd_scale = 1.0, std::uint32_t odd = kUnits) {
  std::vector<sp_grad_moments_v1> moments;
  for (std::uint32_t u = 0; u < kUnits; ++u) {
    const double g = scale * (u == odd ? odd_scale : 1.0) * (1.0 + 0.1 * u);
    moments.push_back({u, 0, 1000 * g * g, 0.0, g, 1000, 0});
  }
  return moments;
}

std::vector<std::uint32_t> nf4_units_of(const std::vector<sp_precision> &routes) {
  std::vector<std::uint32_t> units;
  for (std::uint32_t u = 0; u < routes.size(); ++u) {
    if (routes[u] == SP_PRECISION_NF4) units.push_back(u);
  }
  return units;
}

// Unit 5 in NF4 by the unit costs; units 2 and 3 are the next cheapest to narrow.
Signals boundary_costs() {
  return measured_with({{5, {0.01, 0.001, 0.012}}, {2, {0.015, 0.001, 0.02}}, {3, {0.02, 0.001, 0.03}}});
}

TEST(PolicyV4, ProposesTheSwapsAtItsBoundaryAndTakesOneOnlyBeyondItsInterval) {
  Driver driver(measured_config(kOneNf4), kUnits);
  PolicyEngine &engine = driver.engine();
  EXPECT_TRUE(engine.propose_allocations(kUnits).empty()) << "nothing to swap before a measurement";
  send(engine, -1, boundary_costs());
  ASSERT_EQ(nf4_units(initial(engine)), std::vector<std::uint32_t>{5});
  // The allocation in force, then unit 5 back to BF16 with each of the two units cheapest to
  // narrow in its place: the same bytes.
  const std::vector<std::vector<sp_precision>> proposal = engine.propose_allocations(kUnits);
  ASSERT_EQ(proposal.size(), 3u);
  EXPECT_EQ(nf4_units_of(proposal[0]), std::vector<std::uint32_t>{5});
  EXPECT_EQ(nf4_units_of(proposal[1]), std::vector<std::uint32_t>{2});
  EXPECT_EQ(nf4_units_of(proposal[2]), std::vector<std::uint32_t>{3});

  // Unit 3 measured lower on average, but within the noise; unit 2 lower beyond it.
  std::vector<sp_precision> routes;
  const std::vector<double> cost{0.05, 0.04, 0.03}, cost_upper{0.06, 0.05, 0.05};
  const std::vector<double> difference{0.0, -0.01, -0.02}, difference_upper{0.0, -0.002, 0.001};
  const sp_allocation_measurements_v1 m =
      measurement_of(proposal, routes, cost, cost_upper, difference, difference_upper);
  engine.set_allocation_measurements(-1, &m);
  EXPECT_EQ(nf4_units(initial(engine)), std::vector<std::uint32_t>{2});
  EXPECT_THROW(engine.set_allocation_measurements(-1, &m), InvalidArgument) << "a proposal is answered once";

  // Training keeps the measured choice, as it keeps a measured allocation.
  EXPECT_EQ(nf4_units(step_with(driver, 0, nullptr)), std::vector<std::uint32_t>{2});
  EXPECT_LE(bytes_of(driver.hints()), static_cast<std::uint64_t>(0.92 * kUnits * kBf16));
  // A new measurement of the units replaces it: the knapsack decides again.
  const Signals again = boundary_costs();
  EXPECT_EQ(nf4_units(step_with(driver, 1, &again)), std::vector<std::uint32_t>{5});
}

TEST(PolicyV4, RefusesAMeasurementOfAnotherProposalAndChangesNothing) {
  Driver driver(measured_config(kOneNf4), kUnits);
  PolicyEngine &engine = driver.engine();
  send(engine, -1, boundary_costs());
  initial(engine);
  std::vector<std::vector<sp_precision>> proposal = engine.propose_allocations(kUnits);
  ASSERT_EQ(proposal.size(), 3u);
  const std::vector<std::uint8_t> before = engine.export_state();
  std::swap(proposal[1], proposal[2]);
  std::vector<sp_precision> routes;
  const std::vector<double> cost{0.05, 0.04, 0.03}, cost_upper{0.06, 0.05, 0.04};
  const std::vector<double> difference{0.0, -0.01, -0.02}, difference_upper{0.0, -0.002, -0.01};
  sp_allocation_measurements_v1 m = measurement_of(proposal, routes, cost, cost_upper, difference, difference_upper);
  try {
    engine.set_allocation_measurements(-1, &m);
    ADD_FAILURE() << "a measurement of the alternatives in another order was taken";
  } catch (const InvalidArgument &error) {
    EXPECT_NE(std::string(error.what()).find("allocation 1 has block 2 at precision 0, but the proposal has 2"),
              std::string::npos)
        << error.what();
  }
  std::swap(proposal[1], proposal[2]);
  const std::vector<double> inverted{0.0, -0.01, -0.03};
  m = measurement_of(proposal, routes, cost, cost_upper, difference, inverted);
  EXPECT_THROW(engine.set_allocation_measurements(-1, &m), InvalidArgument) << "an upper bound below its mean";
  m = measurement_of(proposal, routes, cost, cost_upper, difference, difference_upper);
  m.confidence = 1.0;
  EXPECT_THROW(engine.set_allocation_measurements(-1, &m), InvalidArgument);
  EXPECT_EQ(engine.export_state(), before);
  EXPECT_EQ(nf4_units(initial(engine)), std::vector<std::uint32_t>{5});
}

TEST(PolicyV4, AMeasuredSwapCrossesAStateRoundTripAndNotDecideUntilStep) {
  Driver driver(measured_config(kOneNf4, "  decide_until_step: 0\n"), kUnits);
  PolicyEngine &engine = driver.engine();
  send(engine, -1, boundary_costs());
  initial(engine);
  std::vector<std::vector<sp_precision>> proposal = engine.propose_allocations(kUnits);
  std::vector<sp_precision> routes;
  const std::vector<double> cost{0.05, 0.04, 0.03}, cost_upper{0.06, 0.05, 0.04};
  const std::vector<double> difference{0.0, -0.01, -0.005}, difference_upper{0.0, -0.002, -0.001};
  sp_allocation_measurements_v1 m = measurement_of(proposal, routes, cost, cost_upper, difference, difference_upper);
  engine.set_allocation_measurements(-1, &m);
  ASSERT_EQ(nf4_units(initial(engine)), std::vector<std::uint32_t>{2}) << "the lowest mean beyond its interval";
  const std::vector<std::uint8_t> blob = engine.export_state();
  Driver resumed(measured_config(kOneNf4, "  decide_until_step: 0\n"), kUnits);
  resumed.engine().import_state(blob.data(), blob.size());
  EXPECT_EQ(nf4_units(step_with(resumed, 0, nullptr)), std::vector<std::uint32_t>{2});

  // From decide_until_step on, a measurement could act only after it: however far the gradients
  // move, nothing is proposed, and the choice stands.
  for (std::int64_t step = 1; step < 40; ++step) {
    EXPECT_EQ(nf4_units(step_with(resumed, step, nullptr, gradients(1.0, step < 20 ? 1.0 : 1000.0))),
              std::vector<std::uint32_t>{2});
    EXPECT_TRUE(resumed.engine().propose_allocations(kUnits).empty()) << "step " << step;
  }
}

TEST(PolicyV4, ASwapHoldsOnlyWhileTheKnapsackAnswersWithTheAllocationItWasMeasuredAgainst) {
  // Under 0.80 the knapsack takes units 5, 2 and 3 into NF4; the measured swap trades 3 for 4.
  const Signals costs = measured_with({{5, {0.01, 0.001, 0.012}}, {2, {0.015, 0.001, 0.02}},
                                       {3, {0.02, 0.001, 0.03}}, {4, {0.03, 0.001, 0.04}}});
  Driver tight(measured_config("{bytes: 0.80}", "  boundary_swaps: 1\n"), kUnits);
  send(tight.engine(), -1, costs);
  ASSERT_EQ(nf4_units(initial(tight.engine())), (std::vector<std::uint32_t>{2, 3, 5}));
  const std::vector<std::vector<sp_precision>> proposal = tight.engine().propose_allocations(kUnits);
  ASSERT_EQ(proposal.size(), 2u);
  ASSERT_EQ(nf4_units_of(proposal[1]), (std::vector<std::uint32_t>{2, 4, 5}));
  std::vector<sp_precision> routes;
  const std::vector<double> cost{0.05, 0.04}, upper{0.06, 0.05}, difference{0.0, -0.01}, difference_upper{0.0, -0.002};
  const sp_allocation_measurements_v1 m = measurement_of(proposal, routes, cost, upper, difference, difference_upper);
  tight.engine().set_allocation_measurements(-1, &m);
  ASSERT_EQ(nf4_units(initial(tight.engine())), (std::vector<std::uint32_t>{2, 4, 5}));
  const std::vector<std::uint8_t> blob = tight.engine().export_state();

  // The same budget after a state round trip: the knapsack still answers {2, 3, 5}, the swap holds.
  Driver again(measured_config("{bytes: 0.80}", "  boundary_swaps: 1\n"), kUnits);
  again.engine().import_state(blob.data(), blob.size());
  EXPECT_EQ(nf4_units(step_with(again, 0, nullptr)), (std::vector<std::uint32_t>{2, 4, 5}));
  // A looser budget: the knapsack answers {5}, an allocation the swap was never measured against,
  // though the swap would fit. The knapsack decides.
  Driver loose(measured_config(kOneNf4, "  boundary_swaps: 1\n"), kUnits);
  loose.engine().import_state(blob.data(), blob.size());
  EXPECT_EQ(nf4_units(step_with(loose, 0, nullptr)), std::vector<std::uint32_t>{5});
}

TEST(PolicyV4, ANewMeasurementWithoutAWinnerSupersedesAChoiceNotYetTaken) {
  Driver driver(measured_config(kOneNf4), kUnits);
  PolicyEngine &engine = driver.engine();
  send(engine, -1, boundary_costs());
  initial(engine);
  std::vector<sp_precision> routes;
  const std::vector<double> cost{0.05, 0.04, 0.03}, upper{0.06, 0.05, 0.04}, difference{0.0, -0.01, 0.001},
      wins{0.0, -0.002, 0.003}, loses{0.0, 0.001, 0.003};
  std::vector<std::vector<sp_precision>> proposal = engine.propose_allocations(kUnits);
  sp_allocation_measurements_v1 m = measurement_of(proposal, routes, cost, upper, difference, wins);
  engine.set_allocation_measurements(-1, &m);
  // Measured again before any decision took the swap: the same proposal, and now no winner.
  proposal = engine.propose_allocations(kUnits);
  ASSERT_EQ(nf4_units_of(proposal[0]), std::vector<std::uint32_t>{5});
  m = measurement_of(proposal, routes, cost, upper, difference, loses);
  engine.set_allocation_measurements(-1, &m);
  EXPECT_EQ(nf4_units(initial(engine)), std::vector<std::uint32_t>{5});
}

TEST(PolicyV4, ProposesNothingWhileNewerUnitCostsWaitToBeAdopted) {
  Driver driver(measured_config(kOneNf4), kUnits);
  send(driver.engine(), -1, boundary_costs());
  initial(driver.engine());
  ASSERT_EQ(driver.engine().propose_allocations(kUnits).size(), 3u);
  // Sent again, they are taken at the next initial_hints or compute_hints: until then the
  // allocation they give is not in force, and no swap around the old one is worth measuring.
  send(driver.engine(), -1, boundary_costs());
  EXPECT_TRUE(driver.engine().propose_allocations(kUnits).empty());
  initial(driver.engine());
  EXPECT_EQ(driver.engine().propose_allocations(kUnits).size(), 3u);
}

// ---- re-measuring when the gradients drift ----

TEST(PolicyV4Drift, OnceTrainingBeganTheBoundaryIsMeasuredAgainOnlyWhenTheGradientsDriftBeyondTheirNoise) {
  Driver driver(measured_config(kOneNf4), kUnits);
  PolicyEngine &engine = driver.engine();
  send(engine, -1, boundary_costs());
  initial(engine);
  ASSERT_EQ(engine.propose_allocations(kUnits).size(), 3u) << "before the first step, as measured";
  // Each unit's gradients wander by a few percent from step to step: noise, never drift. The first
  // 8 steps (drift_window) are the reference; each next 8 are tested against it.
  const auto wander = [](std::int64_t step) { return 1.0 + 0.05 * std::sin(1.7 * static_cast<double>(step)); };
  for (std::int64_t step = 0; step < 64; ++step) {
    step_with(driver, step, nullptr, gradients(wander(step)));
    EXPECT_TRUE(engine.propose_allocations(kUnits).empty()) << "step " << step;
  }
  // Unit 6's gradients grow tenfold: within its next window the evidence exceeds drift_sigmas.
  std::int64_t asked = -1;
  for (std::int64_t step = 64; step < 72 && asked < 0; ++step) {
    step_with(driver, step, nullptr, gradients(wander(step), 10.0, 6));
    if (!engine.propose_allocations(kUnits).empty()) asked = step;
  }
  ASSERT_EQ(asked, 71) << "the window of steps 64 to 71 is the first one tested with the change";
  // The watch's windows are not part of the state: a damaged blob refused leaves the request
  // standing, and one imported takes the reference anew.
  std::vector<std::uint8_t> blob = engine.export_state();
  std::vector<std::uint8_t> damaged = blob;
  store_f64(damaged, damaged.size() - 4 - 8, -1.0);
  reseal(damaged);
  EXPECT_THROW(engine.import_state(damaged.data(), damaged.size()), StateError);
  EXPECT_EQ(engine.propose_allocations(kUnits).size(), 4u);
  {
    Driver resumed(measured_config(kOneNf4), kUnits);
    resumed.engine().import_state(blob.data(), blob.size());
    EXPECT_TRUE(resumed.engine().propose_allocations(kUnits).empty());
  }
  // Unit 6 is far from the cut (its cost is the common 0.1), but its cost is the one in doubt: its
  // move to NF4 is measured too, against each widening.
  const std::vector<std::vector<sp_precision>> proposal = engine.propose_allocations(kUnits);
  ASSERT_EQ(proposal.size(), 4u);
  EXPECT_EQ(nf4_units_of(proposal[0]), std::vector<std::uint32_t>{5});
  EXPECT_EQ(nf4_units_of(proposal[3]), std::vector<std::uint32_t>{6});
  // Measured, with no winner: the routes stay, and the watch takes its reference anew.
  std::vector<sp_precision> routes;
  const std::vector<double> cost{0.05, 0.06, 0.07, 0.08}, upper{0.06, 0.07, 0.08, 0.09},
      difference{0.0, 0.01, 0.02, 0.03}, difference_upper{0.0, 0.02, 0.03, 0.04};
  const sp_allocation_measurements_v1 m = measurement_of(proposal, routes, cost, upper, difference, difference_upper);
  engine.set_allocation_measurements(71, &m);
  for (std::int64_t step = 72; step < 96; ++step) {
    EXPECT_EQ(nf4_units(step_with(driver, step, nullptr, gradients(wander(step), 10.0, 6))),
              std::vector<std::uint32_t>{5});
    EXPECT_TRUE(engine.propose_allocations(kUnits).empty()) << "step " << step;
  }
}

TEST(PolicyV4Drift, OfUnitsDriftingInOneWindowTheStrongestEvidenceIsMeasured) {
  Driver driver(measured_config(kOneNf4, "  boundary_swaps: 1\n"), kUnits);
  PolicyEngine &engine = driver.engine();
  send(engine, -1, boundary_costs());
  initial(engine);
  // Units 1 and 6 drift in the same window, unit 6 the further; one drifted unit is measured.
  for (std::int64_t step = 0; step < 16; ++step) {
    std::vector<sp_grad_moments_v1> moments = gradients(1.0 + 0.05 * std::sin(1.7 * static_cast<double>(step)));
    if (step >= 8) {
      moments[1].sum_sq *= 9.0;
      moments[6].sum_sq *= 10000.0;
    }
    step_with(driver, step, nullptr, moments);
  }
  const std::vector<std::vector<sp_precision>> proposal = engine.propose_allocations(kUnits);
  ASSERT_EQ(proposal.size(), 3u);
  EXPECT_EQ(nf4_units_of(proposal[1]), std::vector<std::uint32_t>{2}) << "the boundary's own";
  EXPECT_EQ(nf4_units_of(proposal[2]), std::vector<std::uint32_t>{6}) << "the strongest drift, not the first unit";
}

TEST(PolicyV4Drift, ASwapMeasuredAroundAStandingSwapHoldsAgainstTheKnapsacksAnswer) {
  Driver driver(measured_config(kOneNf4), kUnits);
  PolicyEngine &engine = driver.engine();
  send(engine, -1, boundary_costs());
  initial(engine);
  // Before the first step, unit 2 in NF4 measured better than the knapsack's unit 5.
  std::vector<std::vector<sp_precision>> proposal = engine.propose_allocations(kUnits);
  // (measurement_of's struct points into these vectors.)
  std::vector<sp_precision> routes;
  const std::vector<double> cost{0.05, 0.04, 0.05}, upper{0.06, 0.05, 0.06}, first_difference{0.0, -0.01, 0.0},
      first_upper{0.0, -0.002, 0.001}, second_difference{0.0, 0.0, -0.01}, second_upper{0.0, 0.001, -0.002};
  sp_allocation_measurements_v1 m = measurement_of(proposal, routes, cost, upper, first_difference, first_upper);
  engine.set_allocation_measurements(-1, &m);
  ASSERT_EQ(nf4_units(initial(engine)), std::vector<std::uint32_t>{2});
  // Unit 3 drifts; around unit 2, unit 3 in its place measures better still.
  for (std::int64_t step = 0; step < 16; ++step)
    step_with(driver, step, nullptr, gradients(1.0, step < 8 ? 1.0 : 10.0, 3));
  proposal = engine.propose_allocations(kUnits);
  ASSERT_EQ(proposal.size(), 3u);
  ASSERT_EQ(nf4_units_of(proposal[0]), std::vector<std::uint32_t>{2});
  ASSERT_EQ(nf4_units_of(proposal[2]), std::vector<std::uint32_t>{3});
  m = measurement_of(proposal, routes, cost, upper, second_difference, second_upper);
  engine.set_allocation_measurements(15, &m);
  // The knapsack still answers unit 5, which both swaps were measured to beat.
  EXPECT_EQ(nf4_units(step_with(driver, 16, nullptr, gradients(1.0, 10.0, 3))), std::vector<std::uint32_t>{3});
  EXPECT_EQ(nf4_units(step_with(driver, 17, nullptr, gradients(1.0, 10.0, 3))), std::vector<std::uint32_t>{3});
}

TEST(PolicyV4Drift, AMeasuredWinnerMovesTheRoutesAtTheNextStep) {
  Driver driver(measured_config(kOneNf4, "  drift_window: 4\n"), kUnits);
  PolicyEngine &engine = driver.engine();
  send(engine, -1, boundary_costs());
  initial(engine);
  std::int64_t step = 0;
  for (; step < 8; ++step) step_with(driver, step, nullptr, gradients(1.0, step < 4 ? 1.0 : 0.01, 2));
  const std::vector<std::vector<sp_precision>> proposal = engine.propose_allocations(kUnits);
  ASSERT_EQ(proposal.size(), 3u) << "unit 2 drifted, already at the boundary: its swaps, as before the first step";
  ASSERT_EQ(nf4_units_of(proposal[1]), std::vector<std::uint32_t>{2});
  std::vector<sp_precision> routes;
  const std::vector<double> cost{0.05, 0.04, 0.05}, upper{0.06, 0.05, 0.06}, difference{0.0, -0.01, 0.0},
      difference_upper{0.0, -0.002, 0.001};
  const sp_allocation_measurements_v1 m = measurement_of(proposal, routes, cost, upper, difference, difference_upper);
  engine.set_allocation_measurements(step - 1, &m);
  EXPECT_EQ(nf4_units(step_with(driver, step, nullptr, gradients(1.0, 0.01, 2))), std::vector<std::uint32_t>{2});
  EXPECT_TRUE(engine.propose_allocations(kUnits).empty());
}

TEST(PolicyV4Drift, DriftSigmasZeroNeverAsksNorDoesAnAllocationNoMeasurementMade) {
  Driver off(measured_config(kOneNf4, "  drift_sigmas: 0\n  drift_window: 2\n"), kUnits);
  send(off.engine(), -1, boundary_costs());
  initial(off.engine());
  // Without a measurement the prior's routes have nothing to drift from.
  Driver prior(measured_config(kOneNf4, "  drift_window: 2\n"), kUnits);
  initial(prior.engine());
  for (std::int64_t step = 0; step < 20; ++step) {
    for (Driver *driver : {&off, &prior}) {
      step_with(*driver, step, nullptr, gradients(step < 10 ? 1.0 : 100.0));
      EXPECT_TRUE(driver->engine().propose_allocations(kUnits).empty()) << "step " << step;
    }
  }
}

TEST(PolicyV4, BoundarySwapsZeroProposesNothing) {
  Driver driver(measured_config(kOneNf4, "  boundary_swaps: 0\n"), kUnits);
  send(driver.engine(), -1, boundary_costs());
  initial(driver.engine());
  EXPECT_TRUE(driver.engine().propose_allocations(kUnits).empty());
  driver.engine().begin_step(0);
  EXPECT_THROW(driver.engine().propose_allocations(kUnits), OrderError) << "between steps only";
}

TEST(PolicyV4Plugin, ProposalsThroughTheTableSayWhatRoomTheyNeed) {
  const LoadedPlugin plugin(SP_POLICY_PLUGIN_PATH);
  ASSERT_TRUE(plugin.loaded()) << dlerror();
  EXPECT_EQ(plugin->abi_minor, 4u);
  const sp_host_api_v1 host = all_routes_host();
  std::vector<sp_block_desc_v1> blocks;
  for (std::uint32_t b = 0; b < kUnits; ++b) blocks.push_back({sizeof(sp_block_desc_v1), b, 1000, kBf16, kInt8, nullptr});
  const std::string config = measured_config(kOneNf4);
  sp_policy_ctx *ctx = nullptr;
  ASSERT_EQ(plugin->create(&host, config.c_str(), blocks.data(), kUnits, &ctx), SP_OK) << plugin->last_error(nullptr);
  const std::vector<std::uint64_t> nf4(kUnits, kNf4);
  ASSERT_EQ(plugin->set_transfer_bytes(ctx, SP_PRECISION_NF4, nf4.data(), kUnits), SP_OK);
  std::vector<const char *> names;
  const Signals costs = boundary_costs();
  const sp_unit_signals_v1 table = costs.view(names);
  ASSERT_EQ(plugin->set_unit_signals(ctx, -1, &table), SP_OK) << plugin->last_error(ctx);
  std::vector<sp_hint_v1> hints(kUnits);
  ASSERT_EQ(plugin->initial_hints(ctx, hints.data(), kUnits), SP_OK);
  std::uint32_t count = 0;
  EXPECT_EQ(plugin->propose_allocations(ctx, nullptr, kUnits, 0, &count), SP_ERR_BUFFER_TOO_SMALL);
  ASSERT_EQ(count, 3u);
  std::vector<sp_precision> routes(count * kUnits, -1);
  ASSERT_EQ(plugin->propose_allocations(ctx, routes.data(), kUnits, count, &count), SP_OK) << plugin->last_error(ctx);
  EXPECT_EQ(nf4_units_of(std::vector<sp_precision>(routes.begin() + kUnits, routes.begin() + 2 * kUnits)),
            std::vector<std::uint32_t>{2});
  const std::vector<double> cost{0.05, 0.04, 0.03}, upper{0.06, 0.05, 0.04}, difference{0.0, -0.01, -0.005},
      difference_upper{0.0, -0.002, -0.001};
  sp_allocation_measurements_v1 m{sizeof m, count, kUnits, 0, routes.data(), cost.data(), upper.data(),
                                  difference.data(), difference_upper.data(), 64, 0.95};
  m.struct_size = SP_ALLOCATION_MEASUREMENTS_V1_4_SIZE - 8;
  EXPECT_EQ(plugin->set_allocation_measurements(ctx, -1, &m), SP_ERR_INVALID_ARGUMENT);
  m.struct_size = sizeof m;
  ASSERT_EQ(plugin->set_allocation_measurements(ctx, -1, &m), SP_OK) << plugin->last_error(ctx);
  ASSERT_EQ(plugin->initial_hints(ctx, hints.data(), kUnits), SP_OK);
  EXPECT_EQ(nf4_units(hints), std::vector<std::uint32_t>{2});
  plugin->destroy(ctx);
}

TEST(PolicyV4Config, NamesTheKeyAndWhatWasExpected) {
  const std::string path = "selective_precision.";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {standalone("  mode: measured\n"), path + "budget: mode is measured, but no budget is given; expected budget: "
                                                "{bytes: F}"},
      {standalone("  mode: measured\n  budget: {loss: 0.01}\n"),
       path + "budget: mode measured decides by a cost that is not the training loss; expected budget: {bytes: F}"},
      {measured_config(kOneNf4, "  switch_sigmas: -1\n"),
       path + "switch_sigmas: expected a number in [0, 100], found -1"},
      {measured_config(kOneNf4, "  decide_until_step: 2.5\n"), path + "decide_until_step: expected an integer >= -1"},
      {measured_config(kOneNf4, "  switch_sigma: 1\n"),
       path + "switch_sigma: unknown key; did you mean 'switch_sigmas'?"},
      {measured_config(kOneNf4, "  drift_window: 1\n"),
       path + "drift_window: expected an integer in [2, 10000], found 1"},
      {measured_config(kOneNf4, "  drift_sigmas: -2\n"),
       path + "drift_sigmas: expected a number in [0, 100] (0: the boundary is never measured again), found -2"},
  };
  for (const auto &[yaml, expected] : cases) {
    try {
      parse_policy_config(yaml, kUnits);
      ADD_FAILURE() << "accepted:\n" << yaml;
    } catch (const PolicyConfigError &error) {
      EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << yaml << "\n-> " << error.what();
    }
  }
  const ParsedConfig other_mode =
      parse_policy_config(standalone("  mode: budget\n  budget: {bytes: 0.5}\n  switch_sigmas: 3\n"), kUnits);
  ASSERT_EQ(other_mode.warnings.size(), 1u);
  EXPECT_NE(other_mode.warnings[0].find("switch_sigmas: mode budget does not read this key"), std::string::npos)
      << other_mode.warnings[0];
}

}  // namespace
}  // namespace sp::policy::testing
