// Argument checks of the quantize / dequantize entry points, shared by the CPU and the CUDA
// versions so both reject the same inputs with the same messages.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sp/kernels/quantize.h"

namespace sp::kernels::detail {

// Throws std::invalid_argument naming `function`: unsupported group size or source dtype,
// rows * cols overflow, or a null pointer for a non-empty tensor.
// `scales` must also be non-null for per-row tensors with empty rows (they get scale 1).
void check_quantize_arguments(const void *src, DType src_dtype, std::size_t rows, std::size_t cols,
                              const QuantizeOptions &options, const void *codes, const void *scales,
                              const char *function);

void check_dequantize_arguments(const void *codes, const float *scales, std::size_t rows, std::size_t cols,
                                uint32_t group_size, const void *dst, const char *function);

// NF4 (sp/kernels/nf4.h): group size one of 32/64/128/256, fp32 or bf16 source, no overflow,
// non-null buffers for a non-empty tensor.
void check_nf4_quantize_arguments(const void *src, DType src_dtype, std::size_t rows, std::size_t cols,
                                  uint32_t group_size, const void *codes, const void *scales, const char *function);

void check_nf4_dequantize_arguments(const void *codes, const void *scales, std::size_t rows, std::size_t cols,
                                    uint32_t group_size, const void *dst, const char *function);

// Per-row tensors with cols == 0 still own one scale per row.
inline bool has_empty_rows(std::size_t rows, std::size_t cols, uint32_t group_size) {
  return rows != 0 && cols == 0 && group_size == 0;
}

}  // namespace sp::kernels::detail
