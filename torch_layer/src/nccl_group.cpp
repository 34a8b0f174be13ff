#include "nccl_group.h"

#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL  // ProcessGroupNCCL.hpp declares nothing without it
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace sp::torch_layer::detail {

std::shared_ptr<Collectives> nccl_group(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                        std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return over_process_group(c10::make_intrusive<c10d::ProcessGroupNCCL>(std::move(store), rank, size, options));
}

}  // namespace sp::torch_layer::detail
