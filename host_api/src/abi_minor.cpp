#include "abi_minor.h"

#include <sp/precision_abi.h>

#include <stdexcept>
#include <string>

namespace sp::host::detail {
namespace {

using Table = sp_policy_plugin_v1_table;

constexpr std::size_t kTableV1_0End = offsetof(Table, last_error) + sizeof(Table::last_error);
static_assert(sizeof(void*) != 8 || kTableV1_0End == SP_PLUGIN_TABLE_V1_0_SIZE,
              "the 1.0 table ends where the header says");
constexpr std::size_t kTableV1_1End =
    offsetof(Table, set_precision_calibration_errors) + sizeof(Table::set_precision_calibration_errors);
static_assert(sizeof(void*) != 8 || kTableV1_1End == SP_PLUGIN_TABLE_V1_1_SIZE, "the 1.1 table ends where the header says");
constexpr std::size_t kTableV1_2End = offsetof(Table, get_budget_status) + sizeof(Table::get_budget_status);
static_assert(sizeof(void*) != 8 || kTableV1_2End == SP_PLUGIN_TABLE_V1_2_SIZE, "the 1.2 table ends where the header says");
constexpr std::size_t kTableV1_3End = offsetof(Table, initial_hints) + sizeof(Table::initial_hints);
static_assert(sizeof(void*) != 8 || kTableV1_3End == SP_PLUGIN_TABLE_V1_3_SIZE, "the 1.3 table ends where the header says");
constexpr std::size_t kTableV1_4End =
    offsetof(Table, set_allocation_measurements) + sizeof(Table::set_allocation_measurements);

// Indexed by minor.
const AbiMinorLayout kLayouts[] = {
    {0, kTableV1_0End, "every field up to last_error", SP_HOST_API_V1_0_SIZE, SP_STEP_FEEDBACK_V1_0_SIZE, 0,
     abi_mask_since(0), false, false, false, false},
    {1, kTableV1_1End, "the ABI 1.1 functions set_transfer_bytes and set_precision_calibration_errors",
     static_cast<std::uint32_t>(sizeof(sp_host_api_v1)), static_cast<std::uint32_t>(sizeof(sp_step_feedback_v1)), 0,
     abi_mask_since(1), true, false, false, false},
    {2, kTableV1_2End, "the ABI 1.2 functions set_unit_signals, get_unit_costs and get_budget_status",
     static_cast<std::uint32_t>(sizeof(sp_host_api_v1)), static_cast<std::uint32_t>(sizeof(sp_step_feedback_v1)),
     SP_BUDGET_STATUS_V1_2_SIZE, abi_mask_since(2), true, true, false, false},
    {3, kTableV1_3End, "the ABI 1.3 function initial_hints", static_cast<std::uint32_t>(sizeof(sp_host_api_v1)),
     static_cast<std::uint32_t>(sizeof(sp_step_feedback_v1)), SP_BUDGET_STATUS_V1_2_SIZE, abi_mask_since(3), true, true,
     true, false},
    {4, kTableV1_4End, "the ABI 1.4 functions propose_allocations and set_allocation_measurements",
     static_cast<std::uint32_t>(sizeof(sp_host_api_v1)), static_cast<std::uint32_t>(sizeof(sp_step_feedback_v1)),
     SP_BUDGET_STATUS_V1_4_SIZE, abi_mask_since(4), true, true, true, true},
};
static_assert(sizeof(sp_budget_status_v1) == SP_BUDGET_STATUS_V1_4_SIZE || sizeof(void*) != 8,
              "the host compiles the newest layout of sp_budget_status_v1");
static_assert(sizeof(kLayouts) / sizeof(kLayouts[0]) == SP_PLUGIN_ABI_MINOR + 1,
              "one layout per minor this host implements");

}  // namespace

const AbiMinorLayout& abi_minor_layout(std::uint32_t minor) {
  if (minor > SP_PLUGIN_ABI_MINOR) {
    throw std::logic_error("abi_minor_layout: ABI 1." + std::to_string(minor) +
                           " is newer than this host's; PluginLibrary::load should have refused it");
  }
  return kLayouts[minor];
}

}  // namespace sp::host::detail
