// AdamW over fp32 master weights on the host, alone or fused with the rebuild of a block's
// transfer image (the fused host optimizer: one sweep reads each master byte once).
//
// Arithmetic, element by element, identical on every implementation and thread count (IEEE
// fp32, no FMA contraction; the constants come from make_adamw_step):
//   grad = g * grad_scale
//   m    = beta1 * m + (1 - beta1) * grad
//   v    = beta2 * v + ((1 - beta2) * grad) * grad
//   w    = w * decay - (step_size * m) / (sqrt(v) * inv_bias2 + eps)
// with decay = 1 for tensors registered without weight decay. A NaN or Inf gradient poisons the
// element, as in the unfused loop; callers skip steps with non-finite gradients.
//
// Moments may be stored in bf16 (half the optimizer state): they are widened to fp32 (exact),
// the update runs in fp32 as above and uses those fp32 m and v, and m and v are stored rounded
// to bf16, to nearest even or stochastically. Stochastic rounding draws its bits from
// (moment_seed, step t, element index), so it is reproducible on every implementation and
// thread count; it keeps the small per-step changes of a slowly moving moment, which round to
// nearest erases once they fall below half a bf16 ulp (0.4 % of the value).
//
// adamw_update_slab() writes the masters, the moments and the image; its result is the same
// bytes as adamw_update() over every tensor followed by build_slab() on the updated masters,
// which is its CPU reference (CpuImpl::kReference runs exactly that).
#pragma once

#include <cstddef>
#include <cstdint>

#include "sp/kernels/dtype.h"
#include "sp/kernels/slab.h"

namespace sp::kernels {

struct AdamWHyperparameters {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

// One step's constants in fp32, computed in double and rounded once.
struct AdamWStep {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float step_size = 0.0f;   // lr / (1 - beta1^t)
  float inv_bias2 = 1.0f;   // 1 / sqrt(1 - beta2^t)
  float decay = 1.0f;       // 1 - lr * weight_decay, for tensors with decay
  float grad_scale = 1.0f;  // multiplies every gradient (global-norm clipping)
  int64_t t = 1;            // the step count: seeds the stochastic rounding of bf16 moments
};

// The constants of step `t` (1 for the first step) at learning rate `lr`. Throws
// std::invalid_argument for t < 1.
AdamWStep make_adamw_step(const AdamWHyperparameters &hyper, double lr, int64_t t, double grad_scale);

// One parameter: its fp32 master, gradient and two moments, rows x cols elements each (a 1-D
// tensor is 1 x n). All four buffers are owned by the caller, must not overlap and stay valid
// for the call; master and moments are updated in place, the gradient is only read.
struct AdamWTensor {
  float *master = nullptr;
  const float *grad = nullptr;
  void *exp_avg = nullptr;     // moment_dtype elements: float, or bf16 bit patterns (uint16_t)
  void *exp_avg_sq = nullptr;  // the same
  TensorShape shape;
  bool decay = true;
  DType moment_dtype = DType::kFloat32;                // kFloat32 or kBFloat16
  Rounding moment_rounding = Rounding::kNearestEven;  // how bf16 moments are stored
  uint64_t moment_seed = 0;                            // stochastic rounding: this tensor's stream
};

// Updates one tensor in place. Throws std::invalid_argument on a null buffer for a non-empty
// tensor, a moment dtype other than fp32 and bf16, or a size overflow.
void adamw_update(const AdamWStep &step, const AdamWTensor &tensor, const CpuExec &exec = {});

// Updates every tensor and writes the image of the updated masters (as build_slab with
// `encoding` would) into `image`, `capacity` bytes, in one sweep: a row (or, for BF16, a chunk)
// is updated and encoded while it is in cache. Returns the image size. Validates everything
// before writing anything: the encoding, the capacity and alignment (as build_slab) and each
// tensor's buffers (as adamw_update); throws std::invalid_argument naming what is wrong.
uint64_t adamw_update_slab(const SlabEncoding &encoding, const AdamWStep &step, const AdamWTensor *tensors,
                           std::size_t n_tensors, uint8_t *image, uint64_t capacity, const CpuExec &exec = {});

}  // namespace sp::kernels
