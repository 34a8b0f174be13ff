#include "sp/torch_layer/intra_op_pool.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <atomic>
#include <vector>

namespace sp::torch_layer {
namespace {

// Where the build runs the kernels on torch's team (GCC, LibTorch's libgomp), the pool follows
// torch.set_num_threads and runs every task once; elsewhere the kernels keep their own threads.
TEST(IntraOpPool, FollowsTorchsThreadCountAndRunsEveryTaskOnce) {
  const kernels::CpuExec exec = intra_op_exec();
  if (exec.pool == nullptr) GTEST_SKIP() << "this build runs the kernels on their own threads";
  const int before = at::get_num_threads();
  for (const int threads : {1, 2}) {
    at::set_num_threads(threads);
    EXPECT_EQ(exec.pool->size(), static_cast<unsigned>(threads));
    std::vector<std::atomic<int>> calls(7);
    exec.pool->run(calls.size(), [&](std::size_t i) { calls[i].fetch_add(1); });
    for (std::size_t i = 0; i < calls.size(); ++i) EXPECT_EQ(calls[i].load(), 1) << "task " << i;
  }
  at::set_num_threads(before);
}

}  // namespace
}  // namespace sp::torch_layer
