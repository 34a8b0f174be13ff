// NF4 (4-bit NormalFloat) quantization of row-major matrices, one absmax scale per group of G
// elements along a row. The transfer format of the third precision tier: about 0.27x the bytes
// of BF16 at G = 64.
//
// Layout: a rows x cols row-major tensor (a 1-D tensor is 1 x n). Each row is split into
// ceil(cols / G) groups of G consecutive elements (the last one may be shorter); groups never
// cross rows. Codes are packed two per byte over the flattened tensor: element e = r * cols + c
// lives in byte e / 2, in the low nibble when e is even and the high nibble when e is odd; a
// tensor with an odd element count leaves the last byte's high nibble zero. Scales are stored
// as bf16 bit patterns, row-major [rows][groups_per_row] (docs/kernels.md, "NF4", says why not
// fp32).
//
// Arithmetic, identical on every implementation (CPU reference, CPU vectorized, CUDA), so
// codes, scales and dequant(quant(x)) are bit-identical everywhere (docs/kernels.md, "NF4"):
//   absmax = max |x| over the group
//   scale  = absmax rounded UP to bf16 (so |x / scale| <= 1), clamped to the largest finite
//            bf16 (0x7F7F); 1.0 for an all-zero group; subnormal absmax -> subnormal bf16
//   v      = x / scale                       (fp32 IEEE division)
//   code   = number of midpoints m_k < v (strict), m_k = fp32(exact midpoint of levels k and
//            k + 1), the constants of bitsandbytes' dQuantizeNF4: a tie goes to the lower code
//   x'     = kNf4Levels[code] * scale        (fp32 multiply), then bf16 round-to-nearest-even
// Non-finite input: a group containing NaN or +-Inf gets scale = bf16 NaN (0x7FFF) and codes 7
// (level 0.0), so it dequantizes to NaN, as INT8 does. An all-zero group gets codes 7 and +0.0.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sp/kernels/dtype.h"

namespace sp::kernels {

// The 16 NormalFloat levels in increasing order (code = index): QLoRA (Dettmers et al. 2023,
// Appendix E) / bitsandbytes' NF4 table, each exact in fp32.
extern const float kNf4Levels[16];

constexpr uint32_t kNf4DefaultGroupSize = 64;

// True for 32, 64, 128 and 256. NF4 has no per-row mode: 4-bit codes need small groups.
bool is_supported_nf4_group_size(uint32_t group_size);

// Bytes of packed codes for a rows x cols tensor: ceil(rows * cols / 2).
std::size_t nf4_code_bytes(std::size_t rows, std::size_t cols);

// Scales stored for a rows x cols tensor: rows * ceil(cols / group_size). Throws
// std::invalid_argument for an unsupported group size.
std::size_t nf4_scale_count(std::size_t rows, std::size_t cols, uint32_t group_size);

// Quantizes src (fp32 or bf16, rows x cols) into codes (nf4_code_bytes) and bf16 scales
// (nf4_scale_count). Empty tensors are allowed (nothing written). Throws
// std::invalid_argument on an unsupported dtype or group size, or a null pointer with a
// non-empty tensor.
void quantize_nf4(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, uint32_t group_size,
                  uint8_t *codes, uint16_t *scales, const CpuExec &exec = {});

// codes + scales -> bf16 bit patterns (rows * cols).
void dequantize_nf4_to_bf16(const uint8_t *codes, const uint16_t *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, uint16_t *dst, const CpuExec &exec = {});

// codes + scales -> fp32 (rows * cols).
void dequantize_nf4_to_fp32(const uint8_t *codes, const uint16_t *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, float *dst, const CpuExec &exec = {});

}  // namespace sp::kernels
