// Allocations measured jointly (ABI 1.4): the engine proposes the allocation in force and the
// rule's alternatives to it, and takes the host's measurement of exactly that proposal back,
// validated completely before the rule acts on it.
#include "sp/policy/decision_rule.h"
#include "sp/policy/engine.h"
#include "sp/policy/errors.h"
#include "sp/policy/routes.h"

#include <fmt/format.h>

#include <cmath>

namespace sp::policy {
namespace {

// A measured value beyond this magnitude is refused, as a measured unit cost is.
constexpr double kLargestValue = 1e12;

bool between_steps(StepPhase phase) { return phase == StepPhase::before_first_step || phase == StepPhase::ended; }

// A mean and its upper bound: finite, the bound at least the mean; NaN for both is "not measured".
bool plausible_interval(double mean, double upper) {
  if (std::isnan(mean) && std::isnan(upper)) return true;
  return std::isfinite(mean) && std::isfinite(upper) && upper >= mean && std::abs(mean) <= kLargestValue &&
         std::abs(upper) <= kLargestValue;
}

}  // namespace

const std::vector<std::vector<sp_precision>> &PolicyEngine::propose_allocations(std::uint32_t n) {
  if (!between_steps(state_.phase)) {
    throw OrderError(fmt::format("propose_allocations called inside step {}; call it between steps",
                                 state_.current_step));
  }
  if (n != n_blocks()) {
    throw InvalidArgument(fmt::format("propose_allocations: n = {}, but the policy was created for {} blocks", n,
                                      n_blocks()));
  }
  proposal_.clear();
  std::vector<std::vector<sp_precision>> alternatives = rule_->alternatives();
  if (alternatives.empty()) return proposal_;
  std::vector<sp_precision> in_force(n_blocks());
  for (std::uint32_t b = 0; b < n_blocks(); ++b) in_force[b] = travels_as(state_.blocks[b].assignment);
  proposal_.push_back(std::move(in_force));
  for (std::vector<sp_precision> &alternative : alternatives) proposal_.push_back(std::move(alternative));
  return proposal_;
}

void PolicyEngine::set_allocation_measurements(std::int64_t step, const sp_allocation_measurements_v1 *measurements) {
  if (!between_steps(state_.phase)) {
    throw OrderError(fmt::format("set_allocation_measurements called inside step {}; call it between steps",
                                 state_.current_step));
  }
  if (measurements == nullptr) throw InvalidArgument("set_allocation_measurements: measurements is null");
  const sp_allocation_measurements_v1 &m = *measurements;
  if (m.struct_size < SP_ALLOCATION_MEASUREMENTS_V1_4_SIZE) {
    throw InvalidArgument(fmt::format("set_allocation_measurements: struct_size is {}, smaller than the {} bytes of "
                                      "ABI 1.4",
                                      m.struct_size, SP_ALLOCATION_MEASUREMENTS_V1_4_SIZE));
  }
  if (step < -1 || step > state_.current_step) {
    throw InvalidArgument(fmt::format("set_allocation_measurements: step {} is outside [-1, {}] (-1: before the first "
                                      "step; at most the current step)",
                                      step, state_.current_step));
  }
  if (m.n_blocks != n_blocks()) {
    throw InvalidArgument(fmt::format("set_allocation_measurements: n_blocks = {}, but the policy was created for {} "
                                      "blocks",
                                      m.n_blocks, n_blocks()));
  }
  if (proposal_.empty()) {
    throw InvalidArgument("set_allocation_measurements: no proposal is open; call propose_allocations first (a step "
                          "or an earlier measurement closed the last one)");
  }
  if (m.n_allocations != proposal_.size()) {
    throw InvalidArgument(fmt::format("set_allocation_measurements: n_allocations = {}, but the proposal has {}",
                                      m.n_allocations, proposal_.size()));
  }
  if (m.routes == nullptr || m.cost == nullptr || m.cost_upper == nullptr || m.difference == nullptr ||
      m.difference_upper == nullptr) {
    throw InvalidArgument("set_allocation_measurements: routes, cost, cost_upper, difference and difference_upper "
                          "must all be given");
  }
  if (!(m.confidence > 0.0 && m.confidence < 1.0)) {
    throw InvalidArgument(fmt::format("set_allocation_measurements: confidence is {}; expected a value in (0, 1)",
                                      m.confidence));
  }
  AllocationMeasurements measured{{}, m.samples, m.confidence};
  for (std::uint32_t k = 0; k < m.n_allocations; ++k) {
    MeasuredAllocation row{std::vector<sp_precision>(m.routes + static_cast<std::size_t>(k) * n_blocks(),
                                                     m.routes + static_cast<std::size_t>(k + 1) * n_blocks()),
                           m.cost[k], m.cost_upper[k], k == 0 ? 0.0 : m.difference[k],
                           k == 0 ? 0.0 : m.difference_upper[k]};
    for (std::uint32_t b = 0; b < n_blocks(); ++b) {
      if (row.routes[b] != proposal_[k][b]) {
        throw InvalidArgument(fmt::format("set_allocation_measurements: allocation {} has block {} at precision {}, "
                                          "but the proposal has {}: measure the latest proposal, in its order",
                                          k, b, row.routes[b], proposal_[k][b]));
      }
    }
    if (!plausible_interval(row.cost, row.cost_upper)) {
      throw InvalidArgument(fmt::format("set_allocation_measurements: allocation {} has cost = {} and cost_upper = {}; "
                                        "expected finite values of magnitude at most {}, the bound >= the mean (or "
                                        "both NaN)",
                                        k, row.cost, row.cost_upper, kLargestValue));
    }
    if (!plausible_interval(row.difference, row.difference_upper)) {
      throw InvalidArgument(fmt::format("set_allocation_measurements: allocation {} has difference = {} and "
                                        "difference_upper = {}; expected finite values of magnitude at most {}, the "
                                        "bound >= the mean (or both NaN)",
                                        k, row.difference, row.difference_upper, kLargestValue));
    }
    measured.rows.push_back(std::move(row));
  }
  // A decision since the proposal (initial_hints or compute_hints on new costs) may have moved the
  // allocation that row 0 stood for: the alternatives were swaps around another allocation.
  for (std::uint32_t b = 0; b < n_blocks(); ++b) {
    if (travels_as(state_.blocks[b].assignment) != proposal_[0][b]) {
      throw InvalidArgument(fmt::format("set_allocation_measurements: block {} travels at precision {} now, but the "
                                        "proposal's allocation 0 has {}: the allocation moved since the proposal; "
                                        "propose again",
                                        b, travels_as(state_.blocks[b].assignment), proposal_[0][b]));
    }
  }
  rule_->take_allocation_measurements(step, measured);
  proposal_.clear();
}

}  // namespace sp::policy
