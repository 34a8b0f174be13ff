// Element types, CPU execution choice and rounding modes shared by every kernel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace sp::kernels {

// Element type of a tensor handed to a kernel. BF16 and FP16 are stored as their raw
// 16-bit patterns (uint16_t); no vendor half type appears in the interface.
enum class DType : uint8_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
};

std::size_t dtype_size(DType dtype);
const char *dtype_name(DType dtype);

// Which CPU implementation runs. kReference is the scalar, single-threaded definition of
// correctness; kVectorized is the SIMD-friendly, multi-threaded version that production
// code uses on machines without a GPU.
enum class CpuImpl : uint8_t {
  kReference = 0,
  kVectorized = 1,
};

// A caller's thread pool for the CPU kernels to run on, instead of starting threads of their
// own beside it: a host whose framework keeps worker threads (LibTorch's intra-op pool) lends
// them, so the two do not contend for the same cores.
class ThreadPool {
 public:
  virtual ~ThreadPool() = default;
  // How many tasks can run at once (at least 1).
  virtual unsigned size() const = 0;
  // Calls task(0), ..., task(n - 1), each once, and returns when all have returned. The kernels'
  // tasks do not throw.
  virtual void run(std::size_t n, const std::function<void(std::size_t)> &task) const = 0;
};

// How a CPU kernel executes. The result never depends on `threads`: work is split into
// fixed-size chunks and partial results are combined in chunk order.
struct CpuExec {
  CpuImpl impl = CpuImpl::kVectorized;
  unsigned threads = 0;  // 0: pool->size() with a pool, else std::thread::hardware_concurrency();
                         // ignored by kReference
  // Where the work runs: null starts std::threads per call. Not owned; it must outlive the call.
  const ThreadPool *pool = nullptr;
};

// Rounding of a narrowing conversion.
//   kNearestEven: IEEE round to nearest, ties to even.
//   kStochastic:  rounds up with probability equal to the distance from the lower
//                 neighbour (unbiased, E[round(x)] = x). The random bits are a hash of
//                 (seed, element index), so a given seed reproduces the same result on
//                 every implementation, every thread count and every run.
enum class Rounding : uint8_t {
  kNearestEven = 0,
  kStochastic = 1,
};

}  // namespace sp::kernels
