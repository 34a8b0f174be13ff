// The kernels' host passes on LibTorch's intra-op threads. at::parallel_for is a header template
// that opens an OpenMP region in the caller's translation unit, so this file alone is compiled
// with OpenMP where that is LibTorch's runtime (CMakeLists.txt): its regions then run on the
// team torch's own ops use, whose workers spin between ops and would otherwise contend with
// threads of the kernels' own. Elsewhere the kernels start their own threads, as they always may.
#include "sp/torch_layer/intra_op_pool.h"

#include <ATen/Config.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <functional>

namespace sp::torch_layer {

#if AT_PARALLEL_OPENMP && defined(_OPENMP)
namespace {

class IntraOpPool final : public sp::kernels::ThreadPool {
 public:
  unsigned size() const override { return static_cast<unsigned>(std::max(1, at::get_num_threads())); }
  void run(std::size_t n, const std::function<void(std::size_t)>& task) const override {
    at::parallel_for(0, static_cast<std::int64_t>(n), 1, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) task(static_cast<std::size_t>(i));
    });
  }
};

}  // namespace

sp::kernels::CpuExec intra_op_exec() {
  static const IntraOpPool pool;
  sp::kernels::CpuExec exec;
  exec.pool = &pool;
  return exec;
}
#else
sp::kernels::CpuExec intra_op_exec() { return {}; }
#endif

}  // namespace sp::torch_layer
