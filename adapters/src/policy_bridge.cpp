#include "sp/adapters/policy_bridge.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>


namespace sp::adapters {

PolicyBridge::PolicyBridge(std::uint32_t num_blocks)
    : num_blocks_(num_blocks), plugin_route_(num_blocks, Precision::bf16) {}

void PolicyBridge::check_block(std::uint32_t block, const char *what) const {
  if (block >= num_blocks_) {
    throw std::invalid_argument(
        fmt::format("{}: block id {} is out of range (there are {} blocks)", what, block, num_blocks_));
  }
}

void PolicyBridge::set_plugin_routes(const std::vector<Precision> &routes) {
  if (routes.size() != num_blocks_) {
    throw std::invalid_argument(fmt::format("PolicyBridge::set_plugin_routes: {} routes; expected one per block ({})",
                                            routes.size(), num_blocks_));
  }
  plugin_route_ = routes;
}

void PolicyBridge::clear_plugin_routes() { std::fill(plugin_route_.begin(), plugin_route_.end(), Precision::bf16); }

void PolicyBridge::begin_step() { limits_ = RuntimeLimitHints{}; }

namespace {
void take_minimum(std::optional<std::uint32_t> &current, std::optional<std::uint32_t> offered) {
  if (offered && (!current || *offered < *current)) {
    current = offered;
  }
}
}  // namespace

void PolicyBridge::tighten(const RuntimeLimitHints &limits) {
  for (const auto &[block, precision] : limits.block_precision_map) {
    check_block(block, "RuntimeLimitHints.block_precision_map");
    (void)precision;
  }
  take_minimum(limits_.max_inflight_h2d, limits.max_inflight_h2d);
  take_minimum(limits_.prefetch_window_cap, limits.prefetch_window_cap);
  limits_.suppress_speculative = limits_.suppress_speculative || limits.suppress_speculative;
  for (const auto &[block, precision] : limits.block_precision_map) {
    limits_.block_precision_map.emplace(block, precision);
  }
}

const char *route_authority_name(RouteAuthority authority) {
  switch (authority) {
    case RouteAuthority::plugin:
      return "plugin";
    case RouteAuthority::transfer_policy:
      return "transfer_policy";
    case RouteAuthority::runtime_pin:
      return "runtime_pin";
  }
  return "unknown";
}

void PolicyBridge::set_transfer_gate(TransferGate gate) {
  for (const Precision route : kPrecisions) {
    const std::vector<bool> &verdicts = gate.pays[route];
    if (!is_quantized(route) && !verdicts.empty()) {
      throw std::invalid_argument(
          fmt::format("PolicyBridge: the transfer gate has verdicts for {}; BF16 always goes "
                      "through, so expected none",
                      precision_name(route)));
    }
    if (!verdicts.empty() && verdicts.size() != num_blocks_) {
      throw std::invalid_argument(
          fmt::format("PolicyBridge: the transfer gate has {} entries in {}_pays; expected none or one per "
                      "block ({})",
                      verdicts.size(), precision_name(route), num_blocks_));
    }
  }
  gate_ = std::move(gate);
  has_gate_ = true;
}

void PolicyBridge::clear_transfer_gate() {
  gate_ = TransferGate{};
  has_gate_ = false;
}

RouteDecision PolicyBridge::decide(std::uint32_t block) const {
  check_block(block, "PolicyBridge::route");
  const auto pinned = limits_.block_precision_map.find(block);
  if (pinned != limits_.block_precision_map.end()) {
    return {pinned->second, RouteAuthority::runtime_pin, pinned->second};
  }
  const Precision wanted = plugin_route_[block];
  if (!has_gate_ || wanted == Precision::bf16) {
    return {wanted, RouteAuthority::plugin, wanted};
  }
  // A route that does not pay falls back to the next more precise one that does (never to a
  // less precise one than the plugin allowed), and BF16 always goes through.
  for (auto route = static_cast<int>(wanted); route > static_cast<int>(Precision::bf16); --route) {
    const std::vector<bool> &verdicts = gate_.pays[static_cast<Precision>(route)];
    if (!verdicts.empty() && verdicts[block]) {
      const Precision taken = static_cast<Precision>(route);
      return {taken, taken == wanted ? RouteAuthority::plugin : RouteAuthority::transfer_policy, wanted};
    }
  }
  return {Precision::bf16, RouteAuthority::transfer_policy, wanted};
}

std::uint32_t PolicyBridge::lookahead(std::uint32_t configured_window) const {
  std::uint32_t window = configured_window;
  if (limits_.prefetch_window_cap) {
    window = std::min(window, *limits_.prefetch_window_cap);
  }
  if (limits_.max_inflight_h2d) {
    window = std::min(window, *limits_.max_inflight_h2d);
  }
  return window;
}

}  // namespace sp::adapters
