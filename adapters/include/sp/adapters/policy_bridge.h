// PolicyBridge (Conductor's role in the seed): combines the policy plugin's per-block hints
// with the runtime's own limits and answers, per fetch, which path a block takes and how far
// ahead the engine may prefetch.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "sp/adapters/transfer_image.h"

namespace sp::adapters {

// Limits the runtime imposes on the data path, e.g. under memory pressure or to protect the
// optimizer phase. Unset fields impose nothing.
struct RuntimeLimitHints {
  std::optional<std::uint32_t> max_inflight_h2d;           // fetches issued ahead of the current one
  std::optional<std::uint32_t> prefetch_window_cap;        // caps the configured prefetch window
  bool suppress_speculative = false;                       // no prefetch into the next phase before it begins
  std::map<std::uint32_t, Precision> block_precision_map;  // overrides the plugin's hint
};

// Who decided a block's route. The plugin says where INT8 or NF4 is safe, the
// benchmark-driven transfer policy (sp-bench) where it is worth it, and the runtime may pin a
// block for a step.
enum class RouteAuthority : std::uint8_t { plugin, transfer_policy, runtime_pin };
const char *route_authority_name(RouteAuthority authority);

struct RouteDecision {
  Precision precision = Precision::bf16;
  RouteAuthority decided_by = RouteAuthority::plugin;
  Precision requested = Precision::bf16;  // what the pin or the plugin asked for
};

// The transfer policy's verdict per quantized route and block: pays[route][b] is true where
// that route was measured faster than BF16 for block b's size on this machine. An empty vector
// means the route pays nowhere (e.g. NF4 under a transfer policy from before NF4 was measured).
// BF16's entry stays empty: BF16 is what a route that does not pay falls back to.
struct TransferGate {
  PerPrecision<std::vector<bool>> pays;
};

class PolicyBridge {
 public:
  explicit PolicyBridge(std::uint32_t num_blocks);

  std::uint32_t num_blocks() const { return num_blocks_; }

  // Takes the plugin's routes, one per block (its hints, which the host validated and translated
  // from the ABI: sp::host::PolicySession::compute_hints()). Throws std::invalid_argument for
  // another count, leaving the previous routes in place. The routes stand until replaced: a
  // policy decides for the following steps, not for one fetch.
  void set_plugin_routes(const std::vector<Precision> &routes);
  // Back to the default route (BF16 everywhere): no hints yet, or none restored.
  void clear_plugin_routes();

  // Limits reset at every step begin and only tighten within a step: numeric caps take the
  // minimum, suppress_speculative is sticky, and a block pinned in the precision map keeps its
  // first pin until the step ends (a fetch already routed by it is never contradicted).
  void begin_step();
  void tighten(const RuntimeLimitHints &limits);
  const RuntimeLimitHints &limits() const { return limits_; }

  // The transfer policy's verdict per block and route (each vector empty or of size
  // num_blocks). With a gate, a quantized hint goes through only where its route pays; a
  // block hinted NF4 where NF4 does not pay takes INT8 if INT8 pays (more precise, so always
  // safe for quality), else BF16. A block hinted INT8 never falls to NF4 (less precise than
  // the plugin allowed). Without a gate the plugin's hint alone decides. Throws
  // std::invalid_argument on a size mismatch, leaving the previous gate in place.
  void set_transfer_gate(TransferGate gate);
  void clear_transfer_gate();
  bool has_transfer_gate() const { return has_gate_; }
  const TransferGate &transfer_gate() const { return gate_; }

  // A precision map pin, else the plugin's hint where the transfer gate lets it through,
  // else the fallback above; with who decided.
  RouteDecision decide(std::uint32_t block) const;
  Precision route(std::uint32_t block) const { return decide(block).precision; }
  // How many fetches beyond the current one may be in flight.
  std::uint32_t lookahead(std::uint32_t configured_window) const;

 private:
  void check_block(std::uint32_t block, const char *what) const;

  std::uint32_t num_blocks_;
  std::vector<Precision> plugin_route_;
  bool has_gate_ = false;
  TransferGate gate_;  // vectors empty or num_blocks long
  RuntimeLimitHints limits_;
};

}  // namespace sp::adapters
