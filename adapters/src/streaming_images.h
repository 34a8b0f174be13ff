// What StreamingEngine's two files share about transfer images: their sizes and encodings per
// route, and the per-block record of the image in its host slab. Private to the adapters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "sp/adapters/streaming_engine.h"
#include "sp/kernels/slab.h"

namespace sp::adapters {
namespace detail {

std::string block_label(const BlockSpec &block, std::uint32_t id);

// The group size of each route: per StreamingConfig for the quantized ones, 0 (none) for BF16.
using GroupSizes = PerPrecision<std::uint32_t>;

GroupSizes group_sizes(const StreamingConfig &config);
sp::kernels::SlabEncoding encoding_for(Precision precision, const GroupSizes &groups);
std::uint64_t image_size(const BlockSpec &block, Precision precision, const GroupSizes &groups);

}  // namespace detail

struct StreamingEngine::BlockImage {
  std::uint32_t slab = 0;
  Precision precision = Precision::bf16;
  std::uint64_t weights_version = 0;   // bumped by on_weights_updated()
  std::uint64_t built_version = 0;     // the weights version the image holds
  sp::kernels::SlabView view;          // layout of the image now in the slab
  const Event *last_reader = nullptr;  // copy-end event of the latest copy out of the slab
  PerPrecision<std::uint64_t> bytes;   // image size per route
  std::uint64_t bytes_of(Precision p) const { return bytes[p]; }
};

}  // namespace sp::adapters
