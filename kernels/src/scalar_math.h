// Scalar arithmetic shared verbatim by the CPU and CUDA implementations. Every bit-exactness
// guarantee of the public headers rests on both sides calling these functions.
#pragma once

#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__CUDACC__)
#define SP_HD __host__ __device__ __forceinline__
#else
#define SP_HD inline
#endif

namespace sp::kernels::detail {

SP_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

SP_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint16_t kBf16CanonicalNaN = 0x7FFFu;

SP_HD float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// IEEE half (binary16) to float, exact.
SP_HD float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bits_float(sign | kInfBits | (mantissa << 13));
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Subnormal: mantissa * 2^-24, exact in fp32.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

// float -> bf16, round to nearest even; NaN -> canonical 0x7FFF (as __float2bfloat16_rn).
SP_HD uint16_t bf16_round_nearest_even(float x) {
  const uint32_t u = float_bits(x);
  if ((u & kAbsMask) > kInfBits) return kBf16CanonicalNaN;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Counter-based random bits, a pure function of (seed, element index): every implementation
// and every thread partition draws the same bits for the same element.
SP_HD uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// 32-bit operations only, so the loops that draw them vectorize (x86 has no packed 64-bit
// multiply below AVX-512). index -> index * odd constant is a bijection and murmur3's fmix32
// is one too, so the elements of a tensor (index < 2^32) draw distinct, well-mixed words.
SP_HD uint32_t random_bits(uint64_t seed, uint64_t index) {
  uint32_t h = static_cast<uint32_t>(index) * 0x9E3779B1u ^ static_cast<uint32_t>(seed);
  h ^= static_cast<uint32_t>(index >> 32) * 0x85EBCA77u ^ static_cast<uint32_t>(seed >> 32);
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// Seed of tensor `tensor_index` in a multi-tensor image, so tensors draw independent streams.
SP_HD uint64_t derive_seed(uint64_t seed, uint64_t tensor_index) {
  return splitmix64(seed ^ splitmix64(tensor_index + 0x632BE59BD9B4E019ull));
}

// float -> bf16, stochastic: adding 16 random bits below the kept mantissa then truncating
// rounds up with probability (discarded bits) / 2^16.
SP_HD uint16_t bf16_round_stochastic(float x, uint32_t random) {
  const uint32_t u = float_bits(x);
  if ((u & kAbsMask) > kInfBits) return kBf16CanonicalNaN;
  if ((u & kAbsMask) == kInfBits) return static_cast<uint16_t>(u >> 16);
  return static_cast<uint16_t>((u + (random & 0xFFFFu)) >> 16);
}

// Scale of a row/group from the bit pattern of its largest |x| (abs_bits = max over
// float_bits(x) & kAbsMask, which orders like |x| and puts NaN above Inf above finites).
SP_HD float quant_scale(uint32_t abs_bits, float max_code) {
  if (abs_bits >= kInfBits) return bits_float(0x7FC00000u);  // NaN: the group is poisoned
  if (abs_bits == 0) return 1.0f;
  const float scale = bits_float(abs_bits) / max_code;
  return scale < FLT_MIN ? FLT_MIN : scale;
}

SP_HD float reciprocal(float scale) { return 1.0f / scale; }

// Round half to even for |v| < 2^22: adding and removing 1.5 * 2^23 leaves no fraction bits,
// and the FPU rounds that addition to nearest even. Equal to rintf on that range, and
// vectorizes on plain SSE2, where rintf is a library call.
SP_HD float round_small_nearest_even(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return (v + kMagic) - kMagic;
}

// Clamp written as selects (not fminf/fmaxf, whose NaN rules keep GCC from using SIMD min/max);
// the callers never pass NaN.
SP_HD float clamp_code(float v, float limit) {
  v = v < -limit ? -limit : v;
  return v > limit ? limit : v;
}

// |x * inv_scale| <= 127 * (1 + 2^-22) because |x| <= absmax, so the rounding above applies.
SP_HD int8_t int8_code_nearest_even(float x, float inv_scale) {
  const float v = clamp_code(round_small_nearest_even(x * inv_scale), 127.0f);
  return static_cast<int8_t>(static_cast<int32_t>(v));
}

SP_HD int8_t int8_code_stochastic(float x, float inv_scale, uint32_t random) {
  const float v = x * inv_scale;
  const float nearest = round_small_nearest_even(v);
  const float lower = nearest - static_cast<float>(nearest > v);  // floorf without a library call
  // 24 random bits -> [0, 1); converted through int32, which x86 SIMD has (unsigned it lacks).
  const float threshold = static_cast<float>(static_cast<int32_t>(random >> 8)) * 5.9604644775390625e-8f;
  const float q = lower + static_cast<float>(threshold < v - lower);
  return static_cast<int8_t>(static_cast<int32_t>(clamp_code(q, 127.0f)));
}

// ---- NF4 (sp/kernels/nf4.h; docs/kernels.md, "NF4") ----

constexpr uint16_t kBf16MaxFinite = 0x7F7Fu;
constexpr uint32_t kNf4ZeroCode = 7;  // the code of level 0.0

// The 16 NormalFloat levels (QLoRA, Dettmers et al. 2023, Appendix E; bitsandbytes' NF4
// table), as exact fp32 hex literals: the one definition of the levels. kNf4Levels, the
// midpoints below and the reference implementation are derived from it; nf4_test.cpp checks it
// against the published decimal values. A switch, not an array, so device code can call it; it
// only fills lookup tables.
SP_HD constexpr float nf4_level(uint32_t code) {
  switch (code & 15u) {
    case 0:
      return -0x1p+0f;
    case 1:
      return -0x1.647362p-1f;
    case 2:
      return -0x1.0cd66p-1f;
    case 3:
      return -0x1.94654p-2f;
    case 4:
      return -0x1.23449ap-2f;
    case 5:
      return -0x1.7a6a7ep-3f;
    case 6:
      return -0x1.74f0e2p-4f;
    case 7:
      return 0.0f;
    case 8:
      return 0x1.45f5fep-4f;
    case 9:
      return 0x1.4995c6p-3f;
    case 10:
      return 0x1.f809bap-3f;
    case 11:
      return 0x1.5a0674p-2f;
    case 12:
      return 0x1.c3497p-2f;
    case 13:
      return 0x1.200f56p-1f;
    case 14:
      return 0x1.722766p-1f;
    default:
      return 0x1p+0f;
  }
}

// Midpoint k (0..14) between levels k and k + 1: their exact midpoint (the sum of two fp32
// values this close in magnitude is exact in double, and so is the halving) rounded once to
// fp32 -- the constants of bitsandbytes' dQuantizeNF4 decision tree. The one definition of the
// midpoints; evaluated at compile time only (Nf4Midpoint, nf4_midpoints()).
SP_HD constexpr float nf4_midpoint(uint32_t k) {
  return static_cast<float>((static_cast<double>(nf4_level(k)) + static_cast<double>(nf4_level(k + 1))) / 2.0);
}

// Midpoint K as a compile-time constant that device code may read (a constexpr static member
// of scalar type).
template <uint32_t K>
struct Nf4Midpoint {
  static_assert(K < 15, "NF4 has 15 midpoints");
  static constexpr float value = nf4_midpoint(K);
};

// All 15 midpoints in order, for host loops that compare against each (the CPU vector encode).
constexpr std::array<float, 15> nf4_midpoints() {
  std::array<float, 15> midpoints{};
  for (uint32_t k = 0; k < 15; ++k) midpoints[k] = nf4_midpoint(k);
  return midpoints;
}

template <uint32_t... K>
SP_HD uint32_t nf4_count_above_midpoints(float v, std::integer_sequence<uint32_t, K...>) {
  return (0u + ... + static_cast<uint32_t>(v > Nf4Midpoint<K>::value));
}

// Code of a normalized value v = x / scale: the number of midpoints strictly below v. v equal
// to a midpoint takes the lower code, as bitsandbytes' tree's strict '>' does. Any v above the
// last midpoint, 1 + ulps included, is code 15. Written as a sum of compares so the CPU loop
// vectorizes. v must not be NaN.
SP_HD uint32_t nf4_code_of_normalized(float v) {
  return nf4_count_above_midpoints(v, std::make_integer_sequence<uint32_t, 15>{});
}

// bitsandbytes clamps a group's absmax to this before taking its reciprocal, so an all-zero or
// tiny group still gets a finite one (1e38).
constexpr float kNf4MinAbsmax = 1e-38f;
constexpr uint32_t kFloatCanonicalNaN = 0x7FC00000u;

// A group's absmax from the bit pattern of its largest |x| (abs_bits, as for quant_scale): the
// value itself, or NaN when the group holds NaN or +-Inf (the group is poisoned: codes 7, and it
// dequantizes to NaN). This is the fp32 scale bitsandbytes stores.
SP_HD float nf4_absmax(uint32_t abs_bits) { return bits_float(abs_bits >= kInfBits ? kFloatCanonicalNaN : abs_bits); }

// The bf16 scale the slab stores for a group: its absmax rounded to nearest even, clamped to
// the largest finite bf16 when that would round to Inf (absmax above 3.3895e38); canonical NaN
// for a poisoned group. 0 for an all-zero group, whose codes are all 7 (level 0.0).
SP_HD uint16_t nf4_scale_bits(uint32_t abs_bits) {
  if (abs_bits >= kInfBits) return kBf16CanonicalNaN;
  const uint16_t nearest = bf16_round_nearest_even(bits_float(abs_bits));
  return nearest > kBf16MaxFinite ? kBf16MaxFinite : nearest;
}

// The multiplier of a finite group: bitsandbytes' 1 / max(absmax, 1e-38), one IEEE fp32
// division per group (exact-rounded on every implementation; nvcc's default -prec-div=true).
SP_HD float nf4_inverse_absmax(float absmax) { return 1.0f / (absmax < kNf4MinAbsmax ? kNf4MinAbsmax : absmax); }

// Code of x in a finite group: v = x * inverse (fp32 multiply), then the midpoint compares.
// bitsandbytes clamps v to [-1, 1] first; that changes no code (every midpoint lies inside), so
// it is left out.
SP_HD uint32_t nf4_code(float x, float inverse) { return nf4_code_of_normalized(x * inverse); }

// A stored scale as fp32: the bf16 scales of the slab, or fp32 absmax as bitsandbytes keeps it.
SP_HD float nf4_scale_value(uint16_t bf16_bits) { return bf16_bits_to_float(bf16_bits); }
SP_HD float nf4_scale_value(float absmax) { return absmax; }

// Packing: element e of the flattened tensor lives in byte e / 2, in the HIGH nibble when e is
// even (bitsandbytes' order: the first of a pair is the high nibble).
SP_HD uint32_t nf4_nibble(uint32_t byte, uint64_t element) { return element % 2 == 0 ? byte >> 4 : byte & 15u; }

}  // namespace sp::kernels::detail
