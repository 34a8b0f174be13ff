// The scalar, single-threaded reference implementations: the definition of correctness.
// They are written independently of scalar_math.h (double-precision neighbour comparisons,
// std::nearbyint; only the stochastic-rounding random bits
// come from scalar_math.h, as they are part of the definition), so a test that compares the fast
// implementations against them checks the fast formulations rather than repeating them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sp/kernels/adamw.h"
#include "sp/kernels/bf16.h"
#include "sp/kernels/moments.h"
#include "sp/kernels/quantize.h"

namespace sp::kernels::reference {

float load(const void *src, DType dtype, std::size_t index);

uint16_t bf16_from_float(float x);
uint16_t bf16_from_float_stochastic(float x, uint32_t random);

void fp32_to_bf16(const float *src, uint16_t *dst, std::size_t n, const Bf16Options &options);

void quantize_int8(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, const QuantizeOptions &options,
                   int8_t *codes, float *scales);

// dst_bf16 or dst_fp32 (exactly one non-null).
void dequantize_int8(const int8_t *codes, const float *scales, std::size_t rows, std::size_t cols, uint32_t group_size,
                     uint16_t *dst_bf16, float *dst_fp32);

// NF4 (sp/kernels/nf4.h): element by element, nibble by nibble, as bitsandbytes' Python
// reference writes it; `absmax` gets the fp32 scales (NaN for a poisoned group).
void quantize_nf4(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, uint32_t group_size,
                  uint8_t *codes, float *absmax);

// The slab's bf16 scale of an absmax: nearest even, the largest finite bf16 instead of Inf.
uint16_t nf4_bf16_scale(float absmax);

// dst_bf16 or dst_fp32 (exactly one non-null); scales as fp32 values.
void dequantize_nf4(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                    uint32_t group_size, uint16_t *dst_bf16, float *dst_fp32);

void grad_moments(const GradTensor *tensors, std::size_t n_tensors, uint32_t n_blocks, sp_grad_moments_v1 *out);

// AdamW element by element, the expression of sp/kernels/adamw.h written out.
void adamw_update(const AdamWStep &step, const AdamWTensor &tensor);

double relative_error(const void *a, DType a_dtype, const void *b, DType b_dtype, std::size_t n);

}  // namespace sp::kernels::reference
