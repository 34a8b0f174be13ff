#include "policy_link.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

#include "sp/precision_abi.h"
#include "sp/torch_layer/paired_interval.h"

namespace sp::torch_layer {

namespace {

// The plugin's units: engine block b adds its sizes to unit unit_of[b].
std::vector<host::BlockDescription> unit_descriptions(const adapters::StreamingEngine& engine,
                                                      const std::vector<std::uint32_t>& unit_of,
                                                      const std::vector<std::string>& unit_names) {
  std::vector<host::BlockDescription> units(unit_names.size());
  for (std::uint32_t u = 0; u < units.size(); ++u) {
    units[u].id = u;
    units[u].name = unit_names[u];
  }
  for (const sp_block_desc_v1& d : engine.block_descs()) {
    host::BlockDescription& unit = units.at(unit_of.at(d.block_id));
    unit.num_params += d.num_params;
    for (Precision route : kPrecisions) unit.bytes[route] += engine.image_bytes(d.block_id, route);
  }
  return units;
}

std::unique_ptr<host::PolicySession> policy_session(std::vector<host::BlockDescription> units,
                                                    const std::filesystem::path& plugin_file, host::PolicyConfig config,
                                                    std::string host_name, std::filesystem::path output_dir,
                                                    std::shared_ptr<spdlog::logger> logger,
                                                    std::chrono::milliseconds hook_deadline) {
  host::PolicyHostOptions options;
  options.host_name = std::move(host_name);
  options.output_dir = std::move(output_dir);
  options.logger = std::move(logger);
  options.fallback = host::FallbackMode::last_good;
  options.hook_deadline = hook_deadline;
  options.supported_precisions = abi_mask_of_all();
  return std::make_unique<host::PolicySession>(plugin_file, std::move(config), std::move(units), std::move(options));
}

}  // namespace

std::unique_ptr<host::PolicySession> policy_session_per_block(const adapters::StreamingEngine& engine,
                                                              const std::filesystem::path& plugin_file,
                                                              host::PolicyConfig config, std::string host_name,
                                                              std::filesystem::path output_dir,
                                                              std::shared_ptr<spdlog::logger> logger,
                                                              std::chrono::milliseconds hook_deadline) {
  std::vector<std::uint32_t> unit_of;
  std::vector<std::string> names;
  for (const sp_block_desc_v1& d : engine.block_descs()) {
    unit_of.push_back(d.block_id);
    names.emplace_back(d.name);
  }
  return policy_session(unit_descriptions(engine, unit_of, names), plugin_file, std::move(config), std::move(host_name),
                        std::move(output_dir), std::move(logger), hook_deadline);
}

void PolicyLink::set_units(std::vector<std::uint32_t> unit_of, std::vector<std::string> names) {
  unit_of_ = std::move(unit_of);
  names_ = std::move(names);
}

void PolicyLink::open(const adapters::StreamingEngine& engine, const std::filesystem::path& plugin_file,
                      host::PolicyConfig config, std::string host_name, std::filesystem::path output_dir,
                      std::shared_ptr<spdlog::logger> logger, std::chrono::milliseconds hook_deadline,
                      AgreeAcrossRanks agree) {
  session_ = policy_session(unit_descriptions(engine, unit_of_, names_), plugin_file, std::move(config),
                            std::move(host_name), std::move(output_dir), std::move(logger), hook_deadline);
  agree_ = std::move(agree);
}

std::vector<Precision> PolicyLink::block_routes() const {
  const std::vector<host::UnitHint>& hints = session_->hints();
  if (hints.empty()) return {};
  std::vector<Precision> routes(unit_of_.size());
  for (std::size_t b = 0; b < unit_of_.size(); ++b) routes[b] = hints.at(unit_of_[b]).precision;
  return routes;
}

std::vector<std::vector<Precision>> PolicyLink::unit_routes(const std::vector<Precision>& routes) const {
  std::vector<std::vector<Precision>> out(names_.size());
  for (std::size_t b = 0; b < routes.size(); ++b) {
    std::vector<Precision>& unit = out.at(unit_of_.at(b));
    if (std::find(unit.begin(), unit.end(), routes[b]) == unit.end()) unit.push_back(routes[b]);
  }
  return out;
}

void PolicyLink::read_what_the_step_needs(bool one_process) {
  const std::optional<sp_budget_status_v1> budget = session_->budget_status();
  // Policy v4 decides by measurements and says so (ABI 1.4): the Taylor table, and for a frozen
  // base its gradients, would be computed every step for nothing.
  signals_wanted_ = budget && budget->kind != SP_BUDGET_NONE && budget->reads_step_signals != 0;
  frozen_gradients_wanted_ = signals_wanted_ && one_process;
}

void PolicyLink::give_step_signals(std::int64_t step, host::UnitSignalTable table) {
  session_->set_unit_signals(step, table);
  last_signals_ = std::move(table);
}

bool PolicyLink::set_unit_signals(std::optional<std::int64_t> last_begun, const host::UnitSignalTable& table,
                                  bool& first_hints) {
  first_hints = false;
  if (agree_) {
    // Every rank's plugin must decide from the same table, so the ranks compare it, bit for bit,
    // before any of them sends it.
    std::vector<std::int32_t> bits(2 * table.values.size() + 1, static_cast<std::int32_t>(table.names.size()));
    std::memcpy(bits.data() + 1, table.values.data(), table.values.size() * sizeof(double));
    agree(bits, "the signal table given to set_unit_signals");
  }
  if (!session_->set_unit_signals(last_begun.value_or(-1), table)) return false;
  last_signals_ = table;
  first_hints = take_first_hints(last_begun);
  return true;
}

std::vector<std::vector<Precision>> PolicyLink::propose_allocations() {
  std::vector<std::vector<Precision>> rows;
  const std::optional<std::vector<std::vector<sp_precision>>> proposed = session_->propose_allocations();
  std::vector<std::int32_t> codes;
  for (const std::vector<sp_precision>& row : proposed.value_or(std::vector<std::vector<sp_precision>>{})) {
    std::vector<Precision>& routes = rows.emplace_back();
    // The host checked every code against the routes it streams.
    for (sp_precision p : row) {
      routes.push_back(*from_abi(p));
      codes.push_back(p);
    }
  }
  // Every rank measures what it returns, in collectives: the same number of rows first, then the rows.
  agree({static_cast<std::int32_t>(rows.size())}, "the number of allocations the plugin proposed");
  agree(codes, "the allocations the plugin proposed");
  return rows;
}

bool PolicyLink::set_allocation_measurements(std::optional<std::int64_t> last_begun,
                                             const std::vector<std::vector<Precision>>& allocations,
                                             const std::vector<std::vector<double>>& example_costs, double confidence,
                                             bool& first_hints) {
  first_hints = false;
  const auto refuse = [](const std::string& why) {
    return std::invalid_argument("StreamedModel::set_allocation_measurements: " + why);
  };
  if (allocations.size() != example_costs.size()) {
    throw refuse(fmt::format("{} allocations but {} cost lists; give one per allocation", allocations.size(),
                             example_costs.size()));
  }
  if (allocations.empty()) throw refuse("no allocation given; measure what propose_allocations() returned");
  host::AllocationMeasurements measured;
  measured.confidence = confidence;
  measured.samples = example_costs[0].size();
  // The best of K alternatives is taken: each difference's interval is Bonferroni-corrected over
  // them, so that noise alone makes any one win with at most the chance of one interval.
  const std::size_t alternatives = std::max<std::size_t>(allocations.size(), 2) - 1;
  const double difference_confidence = 1.0 - (1.0 - confidence) / static_cast<double>(alternatives);
  for (std::size_t k = 0; k < allocations.size(); ++k) {
    if (allocations[k].size() != num_units()) {
      throw refuse(
          fmt::format("allocation {} has {} routes for {} policy units", k, allocations[k].size(), num_units()));
    }
    if (example_costs[k].size() != example_costs[0].size()) {
      throw refuse(fmt::format("allocation {} has {} costs and allocation 0 has {}: measure them on the same examples",
                               k, example_costs[k].size(), example_costs[0].size()));
    }
    host::AllocationMeasurement& row = measured.allocations.emplace_back();
    for (Precision p : allocations[k]) row.routes.push_back(to_abi(p));
    const PairedInterval cost = paired_interval(example_costs[k], confidence);
    row.cost = cost.mean;
    row.cost_upper = cost.high;
    std::vector<double> difference(example_costs[k].size());
    for (std::size_t i = 0; i < difference.size(); ++i) difference[i] = example_costs[k][i] - example_costs[0][i];
    const PairedInterval paired = paired_interval(difference, difference_confidence);
    row.difference = paired.mean;
    row.difference_upper = paired.high;
    // One example bounds nothing: the plugin takes an unbounded interval as not measured.
    if (!std::isfinite(row.cost_upper)) row.cost = row.cost_upper = std::numeric_limits<double>::quiet_NaN();
    if (!std::isfinite(row.difference_upper)) {
      row.difference = row.difference_upper = std::numeric_limits<double>::quiet_NaN();
    }
  }
  if (agree_) {
    // The sizes first, so that the comparison below is of equal lengths.
    agree({static_cast<std::int32_t>(allocations.size()), static_cast<std::int32_t>(measured.samples)},
          "the number of allocations and of costs given to set_allocation_measurements");
    std::vector<std::int32_t> bits(2);
    std::memcpy(bits.data(), &confidence, sizeof confidence);
    for (std::size_t k = 0; k < allocations.size(); ++k) {
      for (Precision p : allocations[k]) bits.push_back(to_abi(p));
      const std::size_t at = bits.size();
      bits.resize(at + 2 * example_costs[k].size());
      std::memcpy(bits.data() + at, example_costs[k].data(), example_costs[k].size() * sizeof(double));
    }
    agree(bits, "the allocations, confidence and costs given to set_allocation_measurements");
  }
  if (!session_->set_allocation_measurements(last_begun.value_or(-1), measured)) return false;
  first_hints = take_first_hints(last_begun);
  return true;
}

}  // namespace sp::torch_layer
