// NF4 (4-bit NormalFloat) quantization of row-major matrices, one absmax scale per group of G
// elements along a row. The transfer format of the third precision tier: about 0.27x the bytes
// of BF16 at G = 64.
//
// The codes are bitsandbytes' (QLoRA's reference implementation), bit for bit: for row lengths
// that are a multiple of the group size, quantize_nf4 gives the packed bytes of
// bitsandbytes.functional.quantize_4bit(x, blocksize=G, quant_type="nf4") and its fp32 absmax
// (python/tests/test_formats.py checks both against the installed bitsandbytes).
//
// Layout: a rows x cols row-major tensor (a 1-D tensor is 1 x n). Each row is split into
// ceil(cols / G) groups of G consecutive elements (the last one may be shorter); groups never
// cross rows. Codes are packed two per byte over the flattened tensor: element e = r * cols + c
// lives in byte e / 2, in the HIGH nibble when e is even and the low nibble when e is odd (the
// first of a pair is the high nibble, as in bitsandbytes); a tensor with an odd element count
// leaves the last byte's low nibble zero. Scales are row-major [rows][groups_per_row], either
// fp32 (the absmax itself, bitsandbytes' format) or bf16 bit patterns (the slab's, 2 bytes per
// group instead of 4; docs/kernels.md, "NF4").
//
// Arithmetic, identical on every implementation (CPU reference, CPU vectorized, CUDA), so
// codes, scales and dequant(quant(x)) are bit-identical everywhere (docs/kernels.md, "NF4"):
//   absmax  = max |x| over the group (bf16 input widened exactly)
//   inverse = 1 / max(absmax, 1e-38)             (fp32 IEEE division, bitsandbytes' clamp)
//   v       = x * inverse                        (fp32 multiply)
//   code    = number of midpoints m_k < v (strict), m_k = fp32(exact midpoint of levels k and
//             k + 1), bitsandbytes' bucket bounds: a tie goes to the lower code
//   scale   = absmax (fp32), or absmax rounded to nearest even bf16, clamped to the largest
//             finite bf16 (0x7F7F)
//   x'      = kNf4Levels[code] * scale           (fp32 multiply), then bf16 round-to-nearest-even
// With fp32 scales x' is bitsandbytes' dequantize_4bit exactly. With bf16 scales the scale is
// off by at most 2^-9 of itself, so x' is within one bf16 ulp of it.
// Non-finite input, which bitsandbytes leaves undefined: a group containing NaN or +-Inf gets
// scale NaN (fp32 0x7FC00000, bf16 0x7FFF) and codes 7 (level 0.0), so it dequantizes to NaN,
// as INT8 does. An all-zero group gets scale 0 and codes 7, and dequantizes to +0.0.
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

// Quantizes src (fp32 or bf16, rows x cols) into codes (nf4_code_bytes) and scales
// (nf4_scale_count): bf16 bit patterns for the slab, or fp32 absmax as bitsandbytes stores it.
// The codes are the same either way. Empty tensors are allowed (nothing written). Throws
// std::invalid_argument on an unsupported dtype or group size, or a null pointer with a
// non-empty tensor.
void quantize_nf4(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, uint32_t group_size,
                  uint8_t *codes, uint16_t *scales, const CpuExec &exec = {});
void quantize_nf4(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, uint32_t group_size,
                  uint8_t *codes, float *scales, const CpuExec &exec = {});

// codes + scales (bf16 bit patterns or fp32) -> bf16 bit patterns (rows * cols).
void dequantize_nf4_to_bf16(const uint8_t *codes, const uint16_t *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, uint16_t *dst, const CpuExec &exec = {});
void dequantize_nf4_to_bf16(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, uint16_t *dst, const CpuExec &exec = {});

// codes + scales -> fp32 (rows * cols).
void dequantize_nf4_to_fp32(const uint8_t *codes, const uint16_t *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, float *dst, const CpuExec &exec = {});
void dequantize_nf4_to_fp32(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, float *dst, const CpuExec &exec = {});

}  // namespace sp::kernels
