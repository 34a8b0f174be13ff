// What the tests of the budgeted modes (v3's budget, v4's measured) share: the driver's block
// sizes, a signal table as a host builds one, and one step with a table.
#pragma once

#include "policy_test_support.h"

#include "sp/policy/engine.h"

#include <sp/plugin_abi_v1.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

namespace sp::policy::testing {

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
inline constexpr std::uint32_t kUnits = 8;
// Driver's blocks: 2000 BF16 bytes, 1000 INT8, no NF4 bytes (the nominal image: 532 at group 64).
inline constexpr std::uint64_t kBf16 = 2000;
inline constexpr std::uint64_t kInt8 = 1000;
inline constexpr std::uint64_t kNf4 = 532;

// A signal table as a host builds one: named columns, a units x columns matrix.
struct Signals {
  std::vector<std::string> names;
  std::vector<double> values;
  double loss = kNaN;

  // Columns loss_cost.int8 and loss_cost.nf4, one pair per unit.
  static Signals costs(const std::vector<double> &int8, const std::vector<double> &nf4, double loss) {
    Signals table{{"loss_cost.int8", "loss_cost.nf4"}, {}, loss};
    for (std::size_t u = 0; u < int8.size(); ++u) {
      table.values.push_back(int8[u]);
      table.values.push_back(nf4[u]);
    }
    return table;
  }
  sp_unit_signals_v1 view(std::vector<const char *> &name_pointers) const {
    name_pointers.clear();
    for (const std::string &name : names) name_pointers.push_back(name.c_str());
    return sp_unit_signals_v1{sizeof(sp_unit_signals_v1),
                              static_cast<std::uint32_t>(values.size() / std::max<std::size_t>(names.size(), 1)),
                              static_cast<std::uint32_t>(names.size()),
                              0,
                              name_pointers.data(),
                              values.data(),
                              loss,
                              64};
  }
};

inline void send(PolicyEngine &engine, std::int64_t step, const Signals &signals) {
  std::vector<const char *> names;
  const sp_unit_signals_v1 table = signals.view(names);
  engine.set_unit_signals(step, &table);
}

inline std::uint64_t bytes_of(const std::vector<sp_hint_v1> &hints) {
  std::uint64_t total = 0;
  for (const sp_hint_v1 &hint : hints) {
    total += hint.precision == SP_PRECISION_NF4 ? kNf4 : hint.precision == SP_PRECISION_INT8 ? kInt8 : kBf16;
  }
  return total;
}

inline std::size_t count(const std::vector<sp_hint_v1> &hints, sp_precision precision) {
  std::size_t n = 0;
  for (const sp_hint_v1 &hint : hints) n += hint.precision == precision ? 1 : 0;
  return n;
}

inline sp_budget_status_v1 status_of(const PolicyEngine &engine) {
  sp_budget_status_v1 status{};
  status.struct_size = sizeof status;
  engine.budget_status(&status);
  return status;
}

// One step with the table sent between begin_step and compute_hints, as a host that measures
// in the backward pass does.
inline const std::vector<sp_hint_v1> &step_with(Driver &driver, std::int64_t step, const Signals *signals,
                                         const std::vector<sp_grad_moments_v1> &moments = {},
                                         const sp_step_feedback_v1 *feedback = nullptr) {
  PolicyEngine &engine = driver.engine();
  engine.begin_step(step);
  if (signals != nullptr) send(engine, step, *signals);
  engine.post_backward(step, moments.data(), static_cast<std::uint32_t>(moments.size()));
  engine.compute_hints(step, driver.mutable_hints().data(), kUnits);
  engine.end_step(step, feedback);
  return driver.hints();
}

// The first record of the telemetry file `path`, parsed.
inline nlohmann::json first_telemetry_record(const std::filesystem::path &path) {
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line)) return nullptr;
  return nlohmann::json::parse(line);
}

}  // namespace sp::policy::testing
