// One row (or span) of each image encoding, from fp32. The whole-tensor quantizers run these
// row by row, and the fused optimizer runs them on each row right after updating it, so both
// produce the same bytes by construction.
#pragma once

#include <cstddef>
#include <cstdint>

#include "quantize_arguments.h"
#include "sp/kernels/bf16.h"
#include "sp/kernels/quantize.h"

namespace sp::kernels::detail {

// Elements [first_index, first_index + n) of a tensor to bf16 (first_index feeds stochastic
// rounding).
void fp32_to_bf16_span(const float *src, uint16_t *dst, std::size_t n, std::size_t first_index,
                       const Bf16Options &options);

// Row `row` of a rows x cols tensor: its groups' scales (scales_row, groups_per_row of them)
// and codes (codes_row, cols bytes), as quantize_int8 writes them.
void quantize_int8_row(const float *src_row, std::size_t row, std::size_t cols, const QuantizeOptions &options,
                       int8_t *codes_row, float *scales_row);

// Row `row` of an NF4 tensor: scales_row gets its bf16 scales, `codes` (the whole tensor's
// packed codes) its nibbles; scratch holds cols bytes. With odd cols a byte straddles rows r
// and r + 1 (r even), so one thread must write both: see nf4_rows_per_unit.
void quantize_nf4_row(const float *src_row, std::size_t row, std::size_t cols, uint32_t group_size, uint8_t *scratch,
                      uint8_t *codes, uint16_t *scales_row);

// Rows a thread takes together when it writes NF4 codes: 2 when cols is odd, else 1.
inline std::size_t nf4_rows_per_unit(std::size_t cols) { return cols % 2 == 0 ? 1 : 2; }

}  // namespace sp::kernels::detail
