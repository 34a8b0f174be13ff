// INT8 symmetric quantization of row-major matrices, per row or per group of G elements.
//
// Layout: a tensor is a row-major rows x cols matrix (a 1-D tensor is 1 x n). With
// group_size == 0 every row has one scale; otherwise each row is split into
// ceil(cols / G) groups of G consecutive elements (the last one may be shorter), each with
// its own scale. Scales are fp32, row-major [rows][groups_per_row].
//
// Arithmetic, identical on every implementation (CPU reference, CPU vectorized, CUDA), so
// dequant(quant(x)) is bit-identical everywhere:
//   absmax = max |x| over the row/group
//   scale  = absmax / 127.0f                 (fp32 division, IEEE round to nearest)
//            1.0f when absmax == 0 (an all-zero row/group gives scale 1 and zeros);
//            raised to FLT_MIN when smaller, so 1/scale stays finite
//   inv    = 1.0f / scale                    (fp32 division)
//   q      = clamp(rintf(x * inv), -127, 127)  (round half to even; or stochastic)
//   x'     = float(q) * scale                (fp32 multiply), then bf16 round-to-nearest-even
// Non-finite input: a row/group containing NaN or +-Inf gets scale = NaN and all-zero codes,
// so its dequantized values are NaN. A corrupted master weight stays visibly corrupted
// instead of turning into a plausible finite value.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sp/kernels/dtype.h"

namespace sp::kernels {

// Group sizes accepted besides 0 (= per row).
constexpr uint32_t kSupportedGroupSizes[] = {32, 64, 128, 256};

// True for 0 and the sizes in kSupportedGroupSizes.
bool is_supported_group_size(uint32_t group_size);

// Scales stored for a rows x cols tensor: rows when group_size == 0, else
// rows * ceil(cols / group_size). Throws std::invalid_argument for an unsupported group size.
std::size_t scale_count(std::size_t rows, std::size_t cols, uint32_t group_size);

struct QuantizeOptions {
  uint32_t group_size = 0;  // 0 = per row; else one of kSupportedGroupSizes
  Rounding rounding = Rounding::kNearestEven;
  uint64_t seed = 0;  // used by Rounding::kStochastic only; element index = row * cols + col
};

// Quantizes src (fp32 or bf16, rows x cols) into codes (rows * cols bytes) and scales
// (scale_count(rows, cols, group_size) floats). Empty tensors are allowed (nothing written).
// Throws std::invalid_argument on an unsupported dtype or group size, or a null pointer
// with a non-empty tensor.
void quantize_int8(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, const QuantizeOptions &options,
                   int8_t *codes, float *scales, const CpuExec &exec = {});

// codes + scales -> bf16 bit patterns (rows * cols).
void dequantize_int8_to_bf16(const int8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                             uint32_t group_size, uint16_t *dst, const CpuExec &exec = {});

// codes + scales -> fp32 (rows * cols), x' = float(q) * scale without the bf16 step.
void dequantize_int8_to_fp32(const int8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                             uint32_t group_size, float *dst, const CpuExec &exec = {});

}  // namespace sp::kernels
