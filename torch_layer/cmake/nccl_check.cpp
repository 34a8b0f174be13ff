// Configure-time check (torch_layer/CMakeLists.txt): does this LibTorch give c10d's NCCL group?
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

int main() {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = std::chrono::milliseconds(1000);
  c10::intrusive_ptr<c10d::Store> store;
  if (c10d::getNcclVersion().empty()) return 1;
  // Never run: only compiled and linked.
  if (options->timeout.count() == 0) c10::make_intrusive<c10d::ProcessGroupNCCL>(store, 0, 1, options);
  return 0;
}
