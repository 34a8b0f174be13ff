// What a run needs in host memory and what the machine has, read from /proc: sp-train refuses
// a model that cannot fit before it allocates it, and reports its peak.
#pragma once

#include <cstdint>

#include "train_config.h"

namespace sp::train {

// The host memory a run of `c` adds at its peak to what the process holds before it builds
// anything (LibTorch, the corpus: resident_bytes() then), by its largest parts:
//   - the fp32 masters of the streamed matrices (in full mode also their gradients and AdamW's
//     two moments; on a GPU also the pinned buffers the gradients cross to the host in);
//   - the slabs of the training and the evaluation engine (one per unit plus the spares, each
//     as large as the largest unit's BF16 image, which an NF4 or INT8 image never exceeds); on
//     the CPU also the two engines' "device" slots (prefetch window + 2 per engine, each room
//     for a BF16 image and a quantized one), which a GPU keeps in its own memory;
//   - on the CPU, the activations: the input of every unit, which the recompute keeps, and the
//     working set of one block's recompute and backward (per token about 7 + 2 x mlp_ratio
//     widths saved for the backward, half as much again for their gradients, and the attention
//     scores and probabilities with theirs).
// Checked against heaptrack and the measured peaks in docs/results.md ("Host memory estimate").
//
// Sharded data parallelism keeps the masters' part of the blocks a rank owns (each rank owns
// every shards-th unit), but never less than one fp32 copy of every streamed matrix: the
// model's own initialization, which the layer takes over and frees.
std::uint64_t estimated_host_bytes(const TrainConfig& c, std::uint32_t shards);

// This process's resident set now.
std::uint64_t resident_bytes();

// This process's peak resident set.
std::uint64_t peak_rss_bytes();

// MemAvailable of /proc/meminfo, in bytes; 0 where it does not say.
std::uint64_t available_host_bytes();

}  // namespace sp::train
