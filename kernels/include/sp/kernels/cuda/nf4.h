// CUDA twins of sp/kernels/nf4.h. Same layout (two 4-bit codes per byte over the flattened
// tensor, the first of a pair in the high nibble, as bitsandbytes packs them; scales
// [rows][groups_per_row]) and the same arithmetic, so codes, scales and dequantized values are
// bit-identical to the CPU versions.
//
// All pointers are device pointers. Every call only enqueues work on `stream`: no host sync,
// no allocation. Throws std::invalid_argument for bad arguments (checked on the host with the
// CPU library's checks) and std::runtime_error naming the CUDA error when a launch fails.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "sp/kernels/nf4.h"

namespace sp::kernels::cuda {

// Two kernels on `stream`: the groups' fp32 absmax (one warp per group), then the packed codes
// (one thread per code byte, so a byte that straddles two rows has a single writer), which
// read the absmax back. fp32 scales only: images are built on the host, and this twin exists
// for bitsandbytes' format; the slab's bf16 scale of a group is nf4.h's rounding of its absmax.
void quantize_nf4(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, uint32_t group_size,
                  uint8_t *codes, float *scales, cudaStream_t stream);

// The step after every NF4 transfer: reads 0.5 byte + 2/G bytes of scale per element, writes
// 2. With cols % 8 == 0, 4-byte aligned codes and 16-byte aligned dst (slab payloads are
// 256-aligned), each thread turns one 4-byte load (8 codes) into one 16-byte store, a warp's
// accesses contiguous.
// Scales as the slab stores them (bf16 bit patterns) or fp32 absmax (bitsandbytes').
void dequantize_nf4_to_bf16(const uint8_t *codes, const uint16_t *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, uint16_t *dst, cudaStream_t stream);
void dequantize_nf4_to_bf16(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, uint16_t *dst, cudaStream_t stream);

void dequantize_nf4_to_fp32(const uint8_t *codes, const uint16_t *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, float *dst, cudaStream_t stream);
void dequantize_nf4_to_fp32(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, float *dst, cudaStream_t stream);

}  // namespace sp::kernels::cuda
