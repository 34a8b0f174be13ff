// What each minor of plugin ABI 1 holds, in one table. The host looks a plugin's minor up once,
// when it loads it, and reads the plugin's layout and abilities from that entry instead of
// comparing minor numbers wherever it builds a struct or calls a function. A new minor is a new
// entry here (as NCCL keeps one adapter per plugin version it still loads).
#pragma once

#include <cstddef>
#include <cstdint>

#include <sp/plugin_abi_v1.h>

namespace sp::host::detail {

struct AbiMinorLayout {
  std::uint32_t minor = 0;
  // Where a function table of this minor ends, and what it adds to the previous minor's (for
  // the message that refuses a table too short for the minor it claims).
  std::size_t table_size = 0;
  const char* table_adds = "";
  // The sizes stamped on the structs the host hands a plugin of this minor: it never sees a
  // field of a later minor.
  std::uint32_t host_api_size = 0;
  std::uint32_t step_feedback_size = 0;
  // 1.2 on; 0 before: get_budget_status does not exist.
  std::uint32_t budget_status_size = 0;
  // The precisions a plugin of this minor can name in a hint.
  sp_precision_mask precisions = 0;
  // Routes beyond BF16 and INT8: the host's supported_precisions, set_transfer_bytes and
  // set_precision_calibration_errors.
  bool has_precision_routes = false;
  // 1.2: set_unit_signals, get_unit_costs and get_budget_status.
  bool has_unit_signals = false;
  // 1.3: initial_hints.
  bool has_initial_hints = false;
  // 1.4: propose_allocations and set_allocation_measurements.
  bool has_allocation_measurements = false;
};

// The entry of `minor`; PluginLibrary has refused a minor above SP_PLUGIN_ABI_MINOR before any
// lookup, so `minor` is one of the host's own. Throws std::logic_error otherwise.
const AbiMinorLayout& abi_minor_layout(std::uint32_t minor);

}  // namespace sp::host::detail
