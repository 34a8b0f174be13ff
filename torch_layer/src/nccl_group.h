// c10d's NCCL group, in a translation unit of its own: compiled only where the project's
// configure step found LibTorch built with NCCL and NCCL's headers (SP_HAVE_C10D_NCCL).
#pragma once

#include <chrono>
#include <memory>

#include "sp/torch_layer/collectives.h"

namespace sp::torch_layer::detail {

// An NCCL group of `size` ranks meeting through `store`; each collective gives up after
// `timeout`. Its tensors are on the CUDA device each rank computes on.
std::shared_ptr<Collectives> nccl_group(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                        std::chrono::milliseconds timeout);

}  // namespace sp::torch_layer::detail
