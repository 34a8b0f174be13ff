// ABI 1.4 on the host: the allocations a plugin proposes, checked against the routes this host
// streams, and their measurements handed back in the ABI's layout.
#include <sp/host/policy_host.h>

#include "abi_minor.h"
#include "plugin_call_scope.h"
#include "policy_host_impl.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <stdexcept>

namespace sp::host {

std::optional<std::vector<std::vector<sp_precision>>> PolicyHost::propose_allocations() {
  Impl& impl = *impl_;
  if (impl.open_step) {
    throw std::logic_error(fmt::format("PolicyHost::propose_allocations: step {} is open; call it between steps",
                                       *impl.open_step));
  }
  if (!impl.quarantine.empty() || !impl.active->abi().has_allocation_measurements) return std::nullopt;
  detail::PluginInstance& active = *impl.active;
  const std::uint32_t n = impl.block_count();
  std::vector<sp_precision> routes;
  std::uint32_t count = 0;
  const auto propose = [&] {
    const detail::PluginCallScope scope(active.label(), "propose_allocations");
    const auto capacity = static_cast<std::uint32_t>(routes.size() / n);
    return active.table().propose_allocations(active.ctx(), routes.empty() ? nullptr : routes.data(), n, capacity,
                                              &count);
  };
  sp_status status = propose();
  if (status == SP_ERR_BUFFER_TOO_SMALL) {
    routes.assign(static_cast<std::size_t>(count) * n, SP_PRECISION_BF16);
    status = propose();
  }
  if (!impl.check_hook("propose_allocations", impl.now_text(), status, impl.failures.allocation_measurements)) {
    return std::nullopt;
  }
  if (static_cast<std::size_t>(count) * n > routes.size()) {
    ++impl.failures.allocation_measurements;
    impl.logger->error("policy plugin {} said {} allocations in propose_allocations, but had room for {}: the "
                       "proposal is dropped",
                       active.label(), count, routes.size() / n);
    return std::nullopt;
  }
  std::vector<std::vector<sp_precision>> rows;
  for (std::uint32_t k = 0; k < count; ++k) {
    std::vector<sp_precision> row(routes.begin() + static_cast<std::ptrdiff_t>(k) * n,
                                  routes.begin() + static_cast<std::ptrdiff_t>(k + 1) * n);
    for (std::uint32_t b = 0; b < n; ++b) {
      if (!detail::in_mask(active.abi().precisions & impl.options.supported_precisions, row[b])) {
        ++impl.failures.allocation_measurements;
        impl.logger->error("policy plugin {} proposed allocation {} with block {} at precision {} ({}), which this "
                           "host does not stream: the proposal is dropped",
                           active.label(), k, b, row[b], detail::precision_name(row[b]));
        return std::nullopt;
      }
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

bool PolicyHost::set_allocation_measurements(std::int64_t step, const AllocationMeasurements& measurements) {
  Impl& impl = *impl_;
  const std::uint32_t n = impl.block_count();
  std::vector<sp_precision> routes;
  std::vector<double> cost, cost_upper, difference, difference_upper;
  for (std::size_t k = 0; k < measurements.allocations.size(); ++k) {
    const AllocationMeasurement& a = measurements.allocations[k];
    if (a.routes.size() != n) {
      throw std::invalid_argument(fmt::format("PolicyHost::set_allocation_measurements: allocation {} has {} routes "
                                              "for {} blocks",
                                              k, a.routes.size(), n));
    }
    routes.insert(routes.end(), a.routes.begin(), a.routes.end());
    cost.push_back(a.cost);
    cost_upper.push_back(a.cost_upper);
    difference.push_back(a.difference);
    difference_upper.push_back(a.difference_upper);
  }
  if (impl.open_step) {
    throw std::logic_error(fmt::format(
        "PolicyHost::set_allocation_measurements: step {} is open; call it between steps", *impl.open_step));
  }
  if (!impl.quarantine.empty() || !impl.active->abi().has_allocation_measurements) return false;
  sp_allocation_measurements_v1 table{};
  table.struct_size = sizeof table;
  table.n_allocations = static_cast<std::uint32_t>(measurements.allocations.size());
  table.n_blocks = n;
  table.routes = routes.data();
  table.cost = cost.data();
  table.cost_upper = cost_upper.data();
  table.difference = difference.data();
  table.difference_upper = difference_upper.data();
  table.samples = measurements.samples;
  table.confidence = measurements.confidence;
  detail::PluginInstance& active = *impl.active;
  const sp_status status = [&] {
    const detail::PluginCallScope scope(active.label(), "set_allocation_measurements");
    return active.table().set_allocation_measurements(active.ctx(), step, &table);
  }();
  return impl.check_hook("set_allocation_measurements", fmt::format("(step {}) {}", step, impl.now_text()), status,
                         impl.failures.allocation_measurements);
}

}  // namespace sp::host
