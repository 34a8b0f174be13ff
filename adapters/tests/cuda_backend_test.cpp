#include "sp/adapters/cuda_backend.h"

#include <gtest/gtest.h>

#include <future>

#include "engine_test_support.h"
#include "sp/testing/gpu_gate.h"
#include "sp/adapters/instrumented_backend.h"

namespace sp::adapters {
namespace {

using testing::config_for;
using testing::run_checked_step;
using testing::set_routes;
using testing::SyntheticModel;

class CudaEngine : public ::testing::Test {
 protected:
  void SetUp() override { SP_SKIP_UNLESS_GPU(CudaBackend::device_available(), "no CUDA device"); }
};

TEST_F(CudaEngine, SlotsHoldBf16AndDequantizedInt8BitForBit) {
  CudaBackend backend;
  SyntheticModel model(5, 21);
  for (std::uint32_t group : {0u, 128u}) {
    StreamingConfig config = config_for(model.blocks(), 2);
    config.int8_group_size = group;
    StreamingEngine engine(backend, config, model.blocks());
    run_checked_step(engine, backend, model.blocks(), 0, group);
    set_routes(engine, {Precision::int8, Precision::bf16, Precision::int8, Precision::int8, Precision::bf16});
    model.update_weights(2, 1e-3f);
    engine.on_weights_updated(2);
    const StepTransferMetrics metrics = run_checked_step(engine, backend, model.blocks(), 1, group);
    EXPECT_GT(metrics.fetches[sp::Precision::int8], 0u);
  }
}

// The NF4 route on the device: staged packed codes and bf16 scales, dequantized by the CUDA
// kernel into the compute region, bit for bit the CPU reference; mixed with the other routes.
TEST_F(CudaEngine, Nf4SlotsHoldTheCpuDequantBitForBit) {
  CudaBackend backend;
  SyntheticModel model(5, 23);
  for (std::uint32_t group : {32u, 64u, 256u}) {
    StreamingConfig config = config_for(model.blocks(), 2);
    config.nf4_group_size = group;
    StreamingEngine engine(backend, config, model.blocks());
    set_routes(engine, std::vector<Precision>(5, Precision::nf4));
    StepTransferMetrics metrics = run_checked_step(engine, backend, model.blocks(), 0, 0, group);
    EXPECT_EQ(metrics.fetches[sp::Precision::nf4], engine.schedule().fetches().size());
    set_routes(engine, {Precision::nf4, Precision::bf16, Precision::int8, Precision::nf4, Precision::int8});
    model.update_weights(3, 1e-3f);
    engine.on_weights_updated(3);
    metrics = run_checked_step(engine, backend, model.blocks(), 1, 0, group);
    EXPECT_GT(metrics.fetches[sp::Precision::nf4], 0u);
    EXPECT_GT(metrics.fetches[sp::Precision::int8], 0u);
  }
}

TEST_F(CudaEngine, SteadyStateMakesNoHostSynchronization) {
  CudaBackend cuda;
  InstrumentedBackend backend(cuda);
  SyntheticModel model(6, 22);
  StreamingEngine engine(backend, config_for(model.blocks(), 2, /*spare_slabs=*/2), model.blocks());
  set_routes(engine,
             {Precision::int8, Precision::bf16, Precision::nf4, Precision::bf16, Precision::int8, Precision::nf4});
  for (std::int64_t step = 0; step < 4; ++step) {
    if (step == 1) {
      backend.reset_counts();
    }
    engine.begin_step(step);
    for (const BlockUse &use : engine.schedule().uses()) {
      engine.acquire(use.block);
      engine.release(use.block);
    }
    engine.end_step();
    // The trainer's optimizer step drains the device between steps; the engine's own calls
    // are what is counted.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  EXPECT_EQ(backend.counts().host_syncs, 0u);
}

// A not-ready event is not an error, but the runtime records cudaErrorNotReady as the last
// error; left there, the next kernel launch check would throw it. A host function that waits
// for the test holds the copy stream, so the event is certainly pending when queried.
TEST_F(CudaEngine, QueryingAPendingEventLeavesNoErrorBehind) {
  CudaBackend backend;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  auto gate = [](void *future) { static_cast<std::shared_future<void> *>(future)->wait(); };
  ASSERT_EQ(cudaLaunchHostFunc(backend.stream(Queue::copy), gate, &released), cudaSuccess);
  std::unique_ptr<Event> event = backend.create_event();
  backend.record(*event, Queue::copy);
  EXPECT_FALSE(backend.query(*event));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  release.set_value();
  backend.synchronize(*event);
  EXPECT_TRUE(backend.query(*event));
}

}  // namespace
}  // namespace sp::adapters
