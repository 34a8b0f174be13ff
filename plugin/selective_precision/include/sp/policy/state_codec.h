// The state blob that carries a policy instance across a hot swap.
//
// Layout (all integers little-endian, doubles as their IEEE-754 bits):
//   header   magic "SPPOLST\0" (8) | format_version u32 | section_count u32 | total_size u64
//   sections tag u32 | payload_size u64 | payload   ("PLCY" then "BLKS", each once;
//            format 2 adds "LOSS" (measured NF4 bytes, loss window) and "BLK2" (v2 per block);
//            format 3 adds "BDGT" (v3: signals, smoothed costs, the budget's allocation);
//            format 4 adds one section per decision rule that keeps state of its own, under the
//            rule's tag, e.g. "MSRD" (v4: measured costs))
//   trailer  crc32 u32 of every byte before it
// docs/policy.md lists the fields of each section.
#pragma once

#include "sp/policy/config.h"
#include "sp/policy/state.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace sp::policy {
// Format 4 adds the decision rules' own sections (v4's measured costs) after format 3's; format 3
// is policy v3's, format 2 policy v2's; the 1.0.0 edition writes format 1 as 1.0.0
// did. Each edition reads the formats up to its own (format 1 blobs: empty loss window, no
// moves recorded; formats 1 and 2: no signals, no allocation).
inline constexpr std::uint32_t kStateFormatVersion =
    SP_POLICY_EDITION >= 4 ? 4 : SP_POLICY_EDITION >= 3 ? 3 : SP_POLICY_EDITION >= 2 ? 2 : 1;

// The format encode_state writes for `state`: format 2 while it holds no v3 state (no signal
// table, no allocation), so that a 2.0.0 plugin can still take over from it; format 4 only
// when a rule keeps a section of its own, so that a 3.x plugin takes over from any other.
std::uint32_t state_format_for(const PolicyState &state);

std::vector<std::uint8_t> encode_state(const PolicyState &state);

// Validates the whole blob and builds a state for `n_blocks` blocks whose windows hold
// `window_capacity` samples; when the blob's windows hold more, the newest samples are kept.
// Throws StateError with a message that names what is wrong; never reads past `size`.
// `loss_window_capacity` keeps the newest losses of a longer loss window likewise.
PolicyState decode_state(const std::uint8_t *blob, std::size_t size, std::uint32_t n_blocks,
                         std::uint32_t window_capacity, std::uint32_t loss_window_capacity = kMaxHistoryWindow);

}  // namespace sp::policy
