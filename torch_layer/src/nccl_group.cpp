// c10d's NCCL group, in a translation unit of its own: compiled only where LibTorch was built
// with NCCL and nccl.h was found (SP_HAVE_C10D_NCCL, torch_layer/CMakeLists.txt).
#include "sp/torch_layer/collectives.h"

#include <cstdlib>

#include <fmt/format.h>

#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL  // ProcessGroupNCCL.hpp declares nothing without it
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace sp::torch_layer {

std::shared_ptr<Collectives> nccl_group(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                        std::chrono::milliseconds timeout) {
  // ProcessGroupNCCL::Options is laid out by this nccl.h: a LibTorch that loaded another NCCL
  // would construct it with another layout.
  const std::string loaded = c10d::getNcclVersion();
  const std::string compiled = fmt::format("{}.{}.", NCCL_MAJOR, NCCL_MINOR);
  if (loaded.rfind(compiled, 0) != 0) {
    throw std::invalid_argument(fmt::format(
        "nccl_group: this build was compiled with nccl.h {}.{}.{}, but LibTorch loaded NCCL {}; configure it with "
        "SP_NCCL_INCLUDE_DIR naming the include directory of NCCL {}",
        NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, loaded, loaded));
  }
  // Without a blocking wait, wait() only orders the streams: a dead rank would hang the next
  // copy to the host until the NCCL watchdog ends the process, instead of raising by name.
  setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return over_process_group(c10::make_intrusive<c10d::ProcessGroupNCCL>(std::move(store), rank, size, options));
}

}  // namespace sp::torch_layer
