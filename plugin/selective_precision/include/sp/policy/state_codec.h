// The state blob that carries a policy instance across a hot swap.
//
// Layout (all integers little-endian, doubles as their IEEE-754 bits):
//   header   magic "SPPOLST\0" (8) | format_version u32 | section_count u32 | total_size u64
//   sections tag u32 | payload_size u64 | payload   ("PLCY" then "BLKS", each once;
//            format 2 adds "LOSS" (measured NF4 bytes, loss window) and "BLK2" (v2 per block))
//   trailer  crc32 u32 of every byte before it
// docs/policy.md lists the fields of each section.
#pragma once

#include "sp/policy/config.h"
#include "sp/policy/state.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace sp::policy {
// Format 2 is policy v2's; the 1.0.0 edition writes format 1 as 1.0.0 did. Format 2 reads
// format 1 blobs (empty loss window, no moves recorded).
inline constexpr std::uint32_t kStateFormatVersion = SP_POLICY_EDITION >= 2 ? 2 : 1;

std::vector<std::uint8_t> encode_state(const PolicyState &state);

// Validates the whole blob and builds a state for `n_blocks` blocks whose windows hold
// `window_capacity` samples; when the blob's windows hold more, the newest samples are kept.
// Throws StateError with a message that names what is wrong; never reads past `size`.
// `loss_window_capacity` keeps the newest losses of a longer loss window likewise.
PolicyState decode_state(const std::uint8_t *blob, std::size_t size, std::uint32_t n_blocks,
                         std::uint32_t window_capacity, std::uint32_t loss_window_capacity = kMaxHistoryWindow);

}  // namespace sp::policy
