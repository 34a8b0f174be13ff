// FP8 E4M3 (OCP / NVIDIA "e4m3fn": bias 7, no infinities, 0x7F/0xFF are NaN, max 448)
// quantization, per row or per group, with the same layout as quantize.h.
//
// Arithmetic, identical on CPU and CUDA:
//   scale = amax / 448.0f  (1.0f for an all-zero row/group; raised to FLT_MIN when smaller)
//   inv   = 1.0f / scale
//   code  = e4m3(x * inv)  round to nearest even, saturating to +-448 (CUDA __NV_SATFINITE)
//   x'    = float(code) * scale, then bf16 round-to-nearest-even
// A row/group containing NaN or +-Inf gets scale = NaN and all-zero codes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sp/kernels/dtype.h"

namespace sp::kernels {

constexpr float kFp8E4M3Max = 448.0f;

// Software twin of CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3): round to
// nearest even, finite values beyond +-448 (and +-Inf) saturate to +-448, NaN gives the NaN
// code with the input's sign (0x7F or 0xFF), as cuda_fp8.hpp's software path does.
uint8_t fp8_e4m3_from_float(float x);

// Exact decode of an E4M3 code; 0x7F and 0xFF decode to NaN.
float fp8_e4m3_to_float(uint8_t code);

// Same contract as quantize_int8 (group_size 0 = per row, else one of kSupportedGroupSizes),
// with E4M3 codes. Round to nearest even only.
void quantize_fp8_e4m3(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, uint32_t group_size,
                       uint8_t *codes, float *scales, const CpuExec &exec = {});

void dequantize_fp8_e4m3_to_bf16(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                                 uint32_t group_size, uint16_t *dst, const CpuExec &exec = {});

void dequantize_fp8_e4m3_to_fp32(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                                 uint32_t group_size, float *dst, const CpuExec &exec = {});

}  // namespace sp::kernels
