#include "sp/adapters/streaming_engine.h"

#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine_test_support.h"
#include "sp/adapters/host_backend.h"
#include "sp/adapters/instrumented_backend.h"
#include "sp/kernels/adamw.h"

namespace sp::adapters {
namespace {

using ::testing::AllOf;
using testing::config_for;
using ::testing::HasSubstr;
using testing::run_checked_step;
using testing::set_routes;
using testing::SyntheticModel;

constexpr std::uint32_t kBlocks = 6;

TEST(StreamingEngine, Bf16SlotsHoldTheBf16ImageBitForBit) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 1);
  StreamingEngine engine(backend, config_for(model.blocks(), 2), model.blocks());
  const StepTransferMetrics metrics = run_checked_step(engine, backend, model.blocks(), 0, 0);
  EXPECT_EQ(metrics.fetches[sp::Precision::bf16], engine.schedule().fetches().size());
  EXPECT_EQ(metrics.fetches[sp::Precision::int8], 0u);
}

// Sizes that are not a multiple of the image alignment (what a model width like 9 gives):
// every slab and slot must still start where an image may start.
TEST(StreamingEngine, SlabAndSlotSizesNeedNotBeAligned) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 3);
  StreamingConfig config = config_for(model.blocks(), 2);
  const StreamingEngine sizing(backend, config, model.blocks());
  config.int8_group_size = 32;
  config.device_slot_bytes = sizing.image_bytes(0, Precision::bf16) + 1;
  config.host_slab_bytes = config.device_slot_bytes + 3;
  ASSERT_NE(config.host_slab_bytes % 16, 0u);
  StreamingEngine engine(backend, config, model.blocks());
  set_routes(engine,
             {Precision::int8, Precision::bf16, Precision::int8, Precision::bf16, Precision::int8, Precision::bf16});
  run_checked_step(engine, backend, model.blocks(), 0, config.int8_group_size);
}

class Int8Groups : public ::testing::TestWithParam<std::uint32_t> {};

TEST_P(Int8Groups, Int8SlotsHoldTheDequantizedImageBitForBit) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 2);
  StreamingConfig config = config_for(model.blocks(), 1);
  config.int8_group_size = GetParam();
  StreamingEngine engine(backend, config, model.blocks());
  set_routes(engine, std::vector<Precision>(kBlocks, Precision::int8));
  const StepTransferMetrics metrics = run_checked_step(engine, backend, model.blocks(), 0, config.int8_group_size);
  EXPECT_EQ(metrics.fetches[sp::Precision::int8], engine.schedule().fetches().size());
  EXPECT_EQ(metrics.h2d_bytes[sp::Precision::bf16], 0u);
  // Bytes on the wire are the INT8 images, fetch by fetch.
  std::uint64_t expected_int8 = 0;
  std::uint64_t expected_all_bf16 = 0;
  for (const BlockFetch &fetch : engine.schedule().fetches()) {
    expected_int8 += engine.image_bytes(fetch.block, Precision::int8);
    expected_all_bf16 += engine.image_bytes(fetch.block, Precision::bf16);
  }
  EXPECT_EQ(metrics.h2d_bytes[sp::Precision::int8], expected_int8);
  EXPECT_EQ(metrics.h2d_bytes_all_bf16, expected_all_bf16);
  EXPECT_LT(metrics.h2d_bytes[sp::Precision::int8], metrics.h2d_bytes_all_bf16);
}

INSTANTIATE_TEST_SUITE_P(PerRowAndGroups, Int8Groups, ::testing::Values(0u, 32u, 128u));

struct WindowCase {
  std::uint32_t window;
  bool backward;
};

class PrefetchWindows : public ::testing::TestWithParam<WindowCase> {};

// After the trainer acquires the use served by fetch f, exactly the fetches up to f + window
// have been issued, whichever direction they go: forward, across the turn, backward.
TEST_P(PrefetchWindows, IssuesExactlyTheWindowAheadInScheduleOrder) {
  const WindowCase param = GetParam();
  HostBackend backend;
  SyntheticModel model(kBlocks, 3);
  StreamingConfig config = config_for(model.blocks(), param.window);
  config.backward = param.backward;
  StreamingEngine engine(backend, config, model.blocks());
  const auto fetches = static_cast<std::uint32_t>(engine.schedule().fetches().size());
  ASSERT_EQ(fetches, param.backward ? 2 * kBlocks - 1 : kBlocks);

  for (int step = 0; step < 2; ++step) {
    engine.begin_step(step);
    EXPECT_EQ(engine.issued_fetches(), std::min(param.window, fetches));
    for (const BlockUse &use : engine.schedule().uses()) {
      const BlockView &view = engine.acquire(use.block);
      EXPECT_EQ(view.block, use.block);
      EXPECT_EQ(view.phase, use.phase);
      EXPECT_EQ(engine.issued_fetches(), std::min(use.fetch + 1 + param.window, fetches))
          << engine.schedule().describe_use(&use - engine.schedule().uses().data());
      testing::expect_view_holds(backend, view, model.blocks()[use.block], 0);
      engine.release(use.block);
    }
    const StepTransferMetrics metrics = engine.end_step();
    EXPECT_EQ(metrics.prefetch_hits, param.window == 0 ? 0u : fetches);
    EXPECT_EQ(metrics.prefetch_misses, param.window == 0 ? fetches : 0u);
    EXPECT_EQ(metrics.slots_total, param.window + 2);
    EXPECT_LE(metrics.slots_in_flight_peak, param.window + 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Windows, PrefetchWindows,
                         ::testing::Values(WindowCase{0, true}, WindowCase{1, true}, WindowCase{2, true},
                                           WindowCase{kBlocks, true}, WindowCase{0, false}, WindowCase{2, false},
                                           WindowCase{kBlocks, false}));

TEST(StreamingEngine, PrefetchCrossesTheForwardToBackwardTurn) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 4);
  StreamingEngine engine(backend, config_for(model.blocks(), 2), model.blocks());
  engine.begin_step(0);
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    engine.acquire(b);
    engine.release(b);
  }
  // The last forward block's fetch also serves its backward; the two after it are the
  // backward fetches of the blocks below, issued before the trainer turns around.
  const auto &fetches = engine.schedule().fetches();
  ASSERT_EQ(engine.issued_fetches(), kBlocks + 2);
  EXPECT_EQ(fetches[kBlocks].block, kBlocks - 2);
  EXPECT_EQ(fetches[kBlocks].phase, Phase::backward);
  EXPECT_EQ(fetches[kBlocks + 1].block, kBlocks - 3);
  for (std::uint32_t use = kBlocks; use < engine.schedule().uses().size(); ++use) {
    const std::uint32_t block = engine.schedule().uses()[use].block;
    engine.acquire(block);
    engine.release(block);
  }
  EXPECT_EQ(engine.end_step().prefetch_misses, 0u);
}

// A host that calls its blocks in another order than their ids: the schedule follows it from
// the next step, the views hold each block's own weights, and every fetch is a prefetch hit.
TEST(StreamingEngine, FollowsABlockOrderSetBetweenSteps) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 5);
  StreamingEngine engine(backend, config_for(model.blocks(), 2), model.blocks());
  std::vector<std::uint32_t> order(kBlocks);
  for (std::uint32_t i = 0; i < kBlocks; ++i) order[i] = (5 * i + 1) % kBlocks;  // 1, 0, 5, 4, 3, 2
  engine.set_block_order(order);
  for (int step = 0; step < 2; ++step) {
    engine.begin_step(step);
    std::vector<std::uint32_t> forward;
    for (const BlockUse &use : engine.schedule().uses()) {
      const BlockView &view = engine.acquire(use.block);
      testing::expect_view_holds(backend, view, model.blocks()[use.block], 0);
      if (use.phase == Phase::forward) forward.push_back(use.block);
      engine.release(use.block);
    }
    EXPECT_EQ(forward, order);
    const StepTransferMetrics metrics = engine.end_step();
    EXPECT_EQ(metrics.prefetch_misses, 0u);
    EXPECT_EQ(metrics.prefetch_hits, 2 * kBlocks - 1);
  }
  // Refused with the schedule unchanged: a wrong order, and any order during a step.
  EXPECT_THROW(engine.set_block_order({0, 1}), std::invalid_argument);
  EXPECT_EQ(engine.schedule().options().order, order);
  engine.begin_step(2);
  EXPECT_THROW(engine.set_block_order({}), std::logic_error);
  EXPECT_EQ(engine.schedule().uses()[0].block, order[0]);
  engine.end_step();
  engine.set_block_order({});
  EXPECT_EQ(engine.schedule().uses()[0].block, 0u);
}

TEST(StreamingEngine, PrecisionSwitchesMidRunWithoutWeightUpdate) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 6);
  StreamingEngine engine(backend, config_for(model.blocks(), 1), model.blocks());
  run_checked_step(engine, backend, model.blocks(), 0, 0);
  set_routes(engine,
             {Precision::int8, Precision::bf16, Precision::int8, Precision::int8, Precision::bf16, Precision::int8});
  StepTransferMetrics metrics = run_checked_step(engine, backend, model.blocks(), 1, 0);
  EXPECT_EQ(metrics.image_rebuilds, 4u);  // the four switched blocks, once each
  EXPECT_GT(metrics.fetches[sp::Precision::int8], 0u);
  set_routes(engine, std::vector<Precision>(kBlocks, Precision::bf16));
  metrics = run_checked_step(engine, backend, model.blocks(), 2, 0);
  EXPECT_EQ(metrics.image_rebuilds, 4u);
  EXPECT_EQ(metrics.fetches[sp::Precision::int8], 0u);
}

TEST(StreamingEngine, PrecisionSwitchAndWeightUpdateInTheSameStep) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 7);
  StreamingEngine engine(backend, config_for(model.blocks(), 2), model.blocks());
  run_checked_step(engine, backend, model.blocks(), 0, 0);
  // After backward: new hints, then the optimizer updates every block.
  set_routes(engine,
             {Precision::bf16, Precision::int8, Precision::int8, Precision::bf16, Precision::int8, Precision::bf16});
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    model.update_weights(b, 1e-3f);
    engine.on_weights_updated(b);
  }
  StepTransferMetrics metrics = run_checked_step(engine, backend, model.blocks(), 1, 0);
  EXPECT_EQ(metrics.image_rebuilds, kBlocks);  // one rebuild per block covers both changes
}

// Sharded data parallelism: an engine whose blocks' masters live elsewhere streams the images
// their owner sends, bit for bit, and refuses to rebuild them from the freed masters.
TEST(StreamingEngine, AnImageReceivedFromTheOwnerStreamsAsItsOwnWould) {
  HostBackend backend;
  SyntheticModel owner_model(kBlocks, 8), other_model(kBlocks, 9);
  StreamingEngine owner(backend, config_for(owner_model.blocks(), 1, 1), owner_model.blocks());
  StreamingEngine other(backend, config_for(other_model.blocks(), 1, 1), other_model.blocks());
  const std::vector<Precision> routes{Precision::nf4, Precision::int8, Precision::bf16,
                                      Precision::nf4, Precision::int8, Precision::bf16};
  set_routes(owner, routes);
  set_routes(other, routes);
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    owner_model.update_weights(b, 1e-3f);
    owner.on_weights_updated(b);
    other.forget_masters(b);
    EXPECT_FALSE(other.has_masters(b));
    const StreamingEngine::ImageBytes sent = owner.image(b, routes[b]);
    ASSERT_EQ(sent.bytes, owner.image_bytes(b, routes[b]));
    other.receive_image(b, routes[b], [&](std::uint8_t *data, std::uint64_t bytes) {
      ASSERT_EQ(bytes, sent.bytes);
      std::memcpy(data, sent.data, bytes);
    });
  }
  // The other engine's slots now hold the owner's weights, not its own (different) masters.
  run_checked_step(other, backend, owner_model.blocks(), 0, 0);

  // A route it holds no image for, an update, or a rebuild: refused by name, never read from
  // the freed masters.
  set_routes(other, std::vector<Precision>(kBlocks, Precision::bf16));
  EXPECT_THAT([&] { other.begin_step(1); },
              ::testing::ThrowsMessage<std::logic_error>(AllOf(HasSubstr("layer0"), HasSubstr("receive_image()"))));
  EXPECT_THAT([&] { other.on_weights_updated(2); },
              ::testing::ThrowsMessage<std::logic_error>(HasSubstr("another process")));
  EXPECT_THAT([&] { other.image(0, Precision::int8); },
              ::testing::ThrowsMessage<std::logic_error>(HasSubstr("receive_image()")));

  // Bytes of another route or group size are refused, and the image in force stays.
  const StreamingEngine::ImageBytes int8_image = owner.image(1, Precision::int8);
  EXPECT_THAT(
      [&] {
        other.receive_image(1, Precision::nf4, [&](std::uint8_t *data, std::uint64_t bytes) {
          std::memcpy(data, int8_image.data, std::min(bytes, int8_image.bytes));
        });
      },
      ::testing::ThrowsMessage<std::logic_error>(AllOf(HasSubstr("layer1"), HasSubstr("failed validation"))));
  EXPECT_THAT([&] { other.receive_image(1, Precision::int8, [](std::uint8_t *, std::uint64_t) {
                throw std::runtime_error("the sender died");
              }); },
              ::testing::ThrowsMessage<std::runtime_error>(HasSubstr("the sender died")));
  set_routes(other, routes);
  run_checked_step(other, backend, owner_model.blocks(), 1, 0);
}

// Gradients and AdamW moments for every tensor of a SyntheticModel, seeded.
struct OptimizerState {
  std::vector<std::vector<float>> grads, exp_avg, exp_avg_sq;

  explicit OptimizerState(const std::vector<BlockSpec> &blocks) {
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 0.01f);
    for (const BlockSpec &block : blocks) {
      for (const TensorSpec &tensor : block.tensors) {
        const std::size_t n = tensor.rows * tensor.cols;
        grads.emplace_back(n);
        for (float &g : grads.back()) g = normal(rng);
        exp_avg.emplace_back(n, 0.0f);
        exp_avg_sq.emplace_back(n, 0.0f);
      }
    }
  }

  std::vector<sp::kernels::AdamWTensor> tensors(SyntheticModel &model, std::uint32_t block) {
    std::vector<sp::kernels::AdamWTensor> out;
    const std::size_t per_block = model.blocks()[block].tensors.size();
    for (std::size_t t = 0; t < per_block; ++t) {
      const TensorSpec &spec = model.blocks()[block].tensors[t];
      const std::size_t i = block * per_block + t;
      out.push_back(sp::kernels::AdamWTensor{model.master(block, t), grads[i].data(), exp_avg[i].data(),
                                             exp_avg_sq[i].data(), {spec.rows, spec.cols}, true});
    }
    return out;
  }
};

// Two models of the same shapes whose fp32 masters are equal bit for bit.
void expect_same_masters(SyntheticModel &a, SyntheticModel &b) {
  for (std::uint32_t block = 0; block < a.blocks().size(); ++block) {
    for (std::size_t t = 0; t < a.blocks()[block].tensors.size(); ++t) {
      const TensorSpec &spec = a.blocks()[block].tensors[t];
      ASSERT_EQ(std::memcmp(a.master(block, t), b.master(block, t), spec.rows * spec.cols * 4), 0)
          << "block " << block << " " << spec.name;
    }
  }
}

// The fused pass against AdamW followed by on_weights_updated, on every route: the same
// masters and the same delivered weights (run_checked_step compares each slot with the kernels'
// reference encoding of the current masters), and one rebuild per block.
TEST(StreamingEngine, UpdateWeightsEqualsTheOptimizerThenTheRebuild) {
  HostBackend backend;
  SyntheticModel fused_model(kBlocks, 9), unfused_model(kBlocks, 9);
  StreamingEngine fused(backend, config_for(fused_model.blocks(), 2, 2), fused_model.blocks());
  StreamingEngine unfused(backend, config_for(unfused_model.blocks(), 2, 2), unfused_model.blocks());
  OptimizerState fused_state(fused_model.blocks()), unfused_state(unfused_model.blocks());
  const std::vector<Precision> routes = {Precision::bf16, Precision::int8, Precision::nf4,
                                         Precision::nf4,  Precision::int8, Precision::bf16};
  for (std::int64_t step = 0; step < 3; ++step) {
    run_checked_step(fused, backend, fused_model.blocks(), step, 0);
    run_checked_step(unfused, backend, unfused_model.blocks(), step, 0);
    set_routes(fused, routes);
    set_routes(unfused, routes);
    const sp::kernels::AdamWStep adam =
        sp::kernels::make_adamw_step(sp::kernels::AdamWHyperparameters{0.9, 0.95, 1e-8, 0.1}, 1e-2, step + 1, 0.5);
    for (std::uint32_t b = 0; b < kBlocks; ++b) {
      fused.update_weights(b, adam, fused_state.tensors(fused_model, b));
      for (const sp::kernels::AdamWTensor &t : unfused_state.tensors(unfused_model, b)) {
        sp::kernels::adamw_update(adam, t);
      }
      unfused.on_weights_updated(b);
    }
    SCOPED_TRACE("step " + std::to_string(step));
    expect_same_masters(fused_model, unfused_model);
    if (HasFatalFailure()) return;
  }
  const StepTransferMetrics metrics = run_checked_step(fused, backend, fused_model.blocks(), 3, 0);
  EXPECT_EQ(metrics.h2d_bytes[sp::Precision::nf4] > 0 && metrics.h2d_bytes[sp::Precision::int8] > 0, true);
}

TEST(StreamingEngine, UpdateWeightsRefusesTensorsThatAreNotTheBlocksMasters) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 10);
  StreamingEngine engine(backend, config_for(model.blocks(), 1), model.blocks());
  OptimizerState state(model.blocks());
  const sp::kernels::AdamWStep adam =
      sp::kernels::make_adamw_step(sp::kernels::AdamWHyperparameters{}, 1e-2, 1, 1.0);
  const std::vector<float> before(model.master(2, 0), model.master(2, 0) + 17 * 259);
  std::vector<sp::kernels::AdamWTensor> swapped = state.tensors(model, 2);
  std::swap(swapped[0], swapped[1]);
  EXPECT_THAT([&] { engine.update_weights(2, adam, swapped); },
              ::testing::ThrowsMessage<std::invalid_argument>(AllOf(HasSubstr("layer2"), HasSubstr("attn.qkv"))));
  std::vector<sp::kernels::AdamWTensor> missing_grad = state.tensors(model, 2);
  missing_grad[0].grad = nullptr;
  EXPECT_THAT([&] { engine.update_weights(2, adam, missing_grad); },
              ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr("null grad")));
  EXPECT_THROW(engine.update_weights(kBlocks, adam, state.tensors(model, 2)), std::invalid_argument);
  EXPECT_EQ(std::memcmp(before.data(), model.master(2, 0), before.size() * 4), 0);
  // The engine still streams the untouched weights.
  run_checked_step(engine, backend, model.blocks(), 0, 0);
}

// The split update (begin_update, run on another thread, finish_update) while the engine
// streams the other blocks, as the layer's update during the backward does: the same masters
// as update_weights(), the block cannot be fetched in between, and an update that fails or
// never ran leaves an engine that delivers the unchanged weights.
TEST(StreamingEngine, ASplitUpdateRunsOnAnotherThreadWhileTheOtherBlocksStream) {
  HostBackend backend;
  SyntheticModel split_model(kBlocks, 11), whole_model(kBlocks, 11);
  StreamingEngine split(backend, config_for(split_model.blocks(), 2, 2), split_model.blocks());
  StreamingEngine whole(backend, config_for(whole_model.blocks(), 2, 2), whole_model.blocks());
  OptimizerState split_state(split_model.blocks()), whole_state(whole_model.blocks());
  const std::vector<Precision> routes = {Precision::nf4, Precision::bf16, Precision::int8,
                                         Precision::nf4, Precision::int8, Precision::bf16};
  set_routes(split, routes);
  set_routes(whole, routes);
  const sp::kernels::AdamWStep adam =
      sp::kernels::make_adamw_step(sp::kernels::AdamWHyperparameters{0.9, 0.95, 1e-8, 0.1}, 1e-2, 1, 1.0);
  run_checked_step(whole, backend, whole_model.blocks(), 0, 0);
  for (std::uint32_t b = 0; b < kBlocks; ++b) whole.update_weights(b, adam, whole_state.tensors(whole_model, b));

  // Block 5's sweep runs on a thread while a step streams blocks 0 and 1 (the prefetch window,
  // 2, keeps the fetches short of block 5).
  split.begin_step(0);
  StreamingEngine::WeightUpdate update = split.begin_update(5);
  EXPECT_THAT([&] { split.begin_update(5); },
              ::testing::ThrowsMessage<std::logic_error>(HasSubstr("being updated")));
  EXPECT_THAT([&] { split.on_weights_updated(5); },
              ::testing::ThrowsMessage<std::logic_error>(HasSubstr("being updated")));
  std::thread sweep([&] { update.run(adam, split_state.tensors(split_model, 5)); });
  const std::vector<BlockUse> &uses = split.schedule().uses();
  std::size_t use = 0;
  try {
    for (; uses[use].block < 2; ++use) {
      split.acquire(uses[use].block);
      split.release(uses[use].block);
    }
  } catch (...) {
    sweep.join();
    throw;
  }
  sweep.join();
  split.finish_update(update);
  for (; use < uses.size(); ++use) {
    split.acquire(uses[use].block);
    split.release(uses[use].block);
  }
  split.end_step();
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    if (b != 5) split.update_weights(b, adam, split_state.tensors(split_model, b));
  }
  expect_same_masters(split_model, whole_model);
  run_checked_step(split, backend, split_model.blocks(), 1, 0);

  StreamingEngine::WeightUpdate busy = split.begin_update(0);
  // Never run: a cancel, after which the block streams its unchanged weights.
  const std::vector<float> before(split_model.master(0, 0), split_model.master(0, 0) + 17 * 259);
  split.finish_update(busy);
  EXPECT_THROW(split.finish_update(busy), std::logic_error);
  run_checked_step(split, backend, split_model.blocks(), 2, 0);
  // A failed run (the tensors are not the block's masters) rethrows its error at finish.
  StreamingEngine::WeightUpdate refused = split.begin_update(0);
  refused.run(adam, split_state.tensors(split_model, 1));
  EXPECT_THAT([&] { split.finish_update(refused); },
              ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr("not the block's master")));
  EXPECT_EQ(std::memcmp(before.data(), split_model.master(0, 0), before.size() * 4), 0);
  run_checked_step(split, backend, split_model.blocks(), 3, 0);
}

TEST(StreamingEngine, StaleImageGuardFetchesTheNewWeightsAfterASwitch) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 8);
  StreamingEngine engine(backend, config_for(model.blocks(), 1), model.blocks());
  run_checked_step(engine, backend, model.blocks(), 0, 0);

  // Switch block 3 to INT8: its INT8 image is built from the old weights at the update call
  // below only if the guard tracks both the route and the weights version.
  std::vector<Precision> routes(kBlocks, Precision::bf16);
  routes[3] = Precision::int8;
  set_routes(engine, routes);
  engine.begin_step(1);
  for (const BlockUse &use : engine.schedule().uses()) {
    engine.acquire(use.block);
    engine.release(use.block);
  }
  engine.end_step();
  model.update_weights(3, 0.5f);
  engine.on_weights_updated(3);
  run_checked_step(engine, backend, model.blocks(), 2, 0);

  // Switching back after another update must not resurrect the BF16 image of step 0.
  model.update_weights(3, -0.25f);
  engine.on_weights_updated(3);
  set_routes(engine, std::vector<Precision>(kBlocks, Precision::bf16));
  run_checked_step(engine, backend, model.blocks(), 3, 0);
}

TEST(StreamingEngine, RuntimePinOverridesThePluginAndPrefetchLimitsTighten) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 9);
  StreamingEngine engine(backend, config_for(model.blocks(), 3), model.blocks());
  set_routes(engine, std::vector<Precision>(kBlocks, Precision::int8));
  engine.begin_step(0);
  EXPECT_EQ(engine.issued_fetches(), 3u);
  RuntimeLimitHints limits;
  limits.prefetch_window_cap = 1;
  limits.block_precision_map[5] = Precision::bf16;
  engine.policy_bridge().tighten(limits);
  std::uint32_t bf16_views = 0;
  for (const BlockUse &use : engine.schedule().uses()) {
    const BlockView &view = engine.acquire(use.block);
    // Fetches 0..2 were issued before the cap; afterwards one fetch ahead at most.
    const auto fetches = static_cast<std::uint32_t>(engine.schedule().fetches().size());
    EXPECT_EQ(engine.issued_fetches(), std::min(fetches, std::max(3u, use.fetch + 2)));
    testing::expect_view_holds(backend, view, model.blocks()[use.block], 0);
    bf16_views += view.precision == Precision::bf16 ? 1 : 0;
    EXPECT_EQ(view.precision, use.block == 5 ? Precision::bf16 : Precision::int8);
    engine.release(use.block);
  }
  EXPECT_EQ(bf16_views, 2u);  // block 5 forward and backward share one fetch
  engine.end_step();
  // Limits reset at the next step: the full window again, and block 5 back on INT8.
  engine.begin_step(1);
  EXPECT_EQ(engine.issued_fetches(), 3u);
  EXPECT_EQ(engine.policy_bridge().route(5), Precision::int8);
}

// Limits given to begin_step bind the fetches begin_step issues ahead too: every fetch of the
// step takes the pinned route, here INT8 and NF4 where the plugin said BF16 and the transfer
// gate says no quantized route pays. Pinned after begin_step, the first fetches would already
// have gone BF16.
TEST(StreamingEngine, PinsGivenToBeginStepRouteEveryFetchOfTheStepPastTheGate) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 12);
  StreamingEngine engine(backend, config_for(model.blocks(), 3), model.blocks());
  engine.policy_bridge().set_transfer_gate(TransferGate{});
  for (const Precision pinned : {Precision::int8, Precision::nf4}) {
    RuntimeLimitHints pins;
    for (std::uint32_t b = 0; b < kBlocks; ++b) pins.block_precision_map[b] = pinned;
    engine.begin_step(pinned == Precision::int8 ? 0 : 1, pins);
    EXPECT_EQ(engine.issued_fetches(), 3u);
    for (const BlockUse &use : engine.schedule().uses()) {
      const BlockView &view = engine.acquire(use.block);
      EXPECT_EQ(view.precision, pinned) << "block " << use.block;
      testing::expect_view_holds(backend, view, model.blocks()[use.block], 0);
      engine.release(use.block);
    }
    const StepTransferMetrics metrics = engine.end_step();
    const auto fetches = static_cast<std::uint32_t>(engine.schedule().fetches().size());
    EXPECT_EQ(metrics.fetches_pinned, fetches);
    EXPECT_EQ(pinned == Precision::int8 ? metrics.fetches[sp::Precision::int8] : metrics.fetches[sp::Precision::nf4], fetches);
    EXPECT_EQ(metrics.h2d_bytes[sp::Precision::bf16], 0u);
  }
  // The pins held for their step only: the gate routes the next one.
  engine.begin_step(2);
  EXPECT_EQ(engine.policy_bridge().limits().block_precision_map.size(), 0u);
  EXPECT_EQ(engine.policy_bridge().route(0), Precision::bf16);
  for (const BlockUse &use : engine.schedule().uses()) {
    EXPECT_EQ(engine.acquire(use.block).precision, Precision::bf16);
    engine.release(use.block);
  }
  engine.end_step();
  // A pin for a block that does not exist is refused before the step begins.
  RuntimeLimitHints bad;
  bad.block_precision_map[kBlocks] = Precision::int8;
  EXPECT_THAT([&] { engine.begin_step(3, bad); },
              ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr("block id 6 is out of range")));
  engine.begin_step(3);
  engine.end_step();
}

TEST(StreamingEngine, SuppressSpeculativeStopsPrefetchAtThePhaseBoundary) {
  HostBackend backend;
  SyntheticModel model(4, 10);
  StreamingEngine engine(backend, config_for(model.blocks(), 2), model.blocks());
  engine.begin_step(0);
  RuntimeLimitHints limits;
  limits.suppress_speculative = true;
  engine.policy_bridge().tighten(limits);
  for (std::uint32_t b = 0; b < 4; ++b) {
    engine.acquire(b);
    engine.release(b);
  }
  EXPECT_EQ(engine.issued_fetches(), 4u);  // nothing of the backward yet
  for (std::uint32_t use = 4; use < engine.schedule().uses().size(); ++use) {
    const std::uint32_t block = engine.schedule().uses()[use].block;
    engine.acquire(block);
    engine.release(block);
  }
  const StepTransferMetrics metrics = engine.end_step();
  EXPECT_EQ(metrics.prefetch_misses, 1u);  // the first backward-only block
}

TEST(StreamingEngine, ForwardOnlyStepLeavesUnusedPrefetchesSafe) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 11);
  StreamingEngine engine(backend, config_for(model.blocks(), 2), model.blocks());
  engine.begin_step(0);
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    engine.acquire(b);
    engine.release(b);
  }
  EXPECT_EQ(engine.end_step().prefetch_unused, 2u);
  set_routes(engine, std::vector<Precision>(kBlocks, Precision::int8));
  run_checked_step(engine, backend, model.blocks(), 1, 0);
}

TEST(StreamingEngine, BlockLargerThanASlotIsAStartupErrorNamingBothSizes) {
  HostBackend backend;
  SyntheticModel model(3, 12);
  StreamingConfig config = config_for(model.blocks(), 1);
  config.device_slot_bytes = 4096;
  try {
    StreamingEngine engine(backend, config, model.blocks());
    FAIL() << "a block larger than its slot was accepted";
  } catch (const std::invalid_argument &error) {
    EXPECT_THAT(error.what(),
                AllOf(HasSubstr("block 'layer0' (id 0)"), HasSubstr("4096"), HasSubstr("device_slot_bytes")));
  }
  config = config_for(model.blocks(), 1);
  config.host_slab_bytes = 1024;
  EXPECT_THAT([&] { StreamingEngine engine(backend, config, model.blocks()); },
              ::testing::ThrowsMessage<std::invalid_argument>(
                  AllOf(HasSubstr("layer0"), HasSubstr("host_slab_bytes is 1024"))));
}

TEST(StreamingEngine, BlockSizeInTheErrorIsTheRealImageSize) {
  HostBackend backend;
  SyntheticModel model(1, 13);
  StreamingConfig config = config_for(model.blocks(), 0);
  StreamingEngine sized(backend, config, model.blocks());
  const std::uint64_t bf16_bytes = sized.image_bytes(0, Precision::bf16);
  config.device_slot_bytes = bf16_bytes - 1;
  EXPECT_THAT(
      [&] { StreamingEngine engine(backend, config, model.blocks()); },
      ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr("needs " + std::to_string(bf16_bytes) + " bytes")));
  config.device_slot_bytes = bf16_bytes;
  EXPECT_NO_THROW(StreamingEngine(backend, config, model.blocks()));
}

TEST(StreamingEngine, ExhaustedSlabPoolIsAClearError) {
  HostBackend backend;
  SyntheticModel model(4, 14);
  StreamingConfig config = config_for(model.blocks(), 1);
  config.host_slab_count = 3;
  EXPECT_THAT([&] { StreamingEngine engine(backend, config, model.blocks()); },
              ::testing::ThrowsMessage<std::runtime_error>(
                  AllOf(HasSubstr("pool exhausted"), HasSubstr("block 'layer3' (id 3)"), HasSubstr("all 3 slabs"))));
}

TEST(StreamingEngine, SteadyStateMakesNoHostSynchronization) {
  HostBackend host;
  InstrumentedBackend backend(host);
  SyntheticModel model(kBlocks, 15);
  StreamingEngine engine(backend, config_for(model.blocks(), 2, /*spare_slabs=*/2), model.blocks());
  auto run_step = [&](std::int64_t step) {
    engine.begin_step(step);
    for (const BlockUse &use : engine.schedule().uses()) {
      engine.acquire(use.block);
      engine.release(use.block);
    }
    return engine.end_step();
  };
  run_step(0);
  backend.reset_counts();
  for (std::int64_t step = 1; step <= 6; ++step) {
    // Switches and optimizer updates between steps are part of the steady state.
    std::vector<Precision> routes(kBlocks, Precision::bf16);
    routes[static_cast<std::size_t>(step) % kBlocks] = Precision::int8;
    set_routes(engine, routes);
    model.update_weights(static_cast<std::uint32_t>(step % 3), 1e-4f);
    engine.on_weights_updated(static_cast<std::uint32_t>(step % 3));
    const StepTransferMetrics metrics = run_step(step);
    EXPECT_EQ(metrics.stalls, 0u);
  }
  EXPECT_EQ(backend.counts().host_syncs, 0u);
  EXPECT_EQ(backend.counts().allocations, 0u);
  EXPECT_GT(backend.counts().copies, 0u);
  EXPECT_GT(backend.counts().dequants, 0u);
}

TEST(StreamingEngine, OutOfOrderAcquireNamesTheExpectedUse) {
  HostBackend backend;
  SyntheticModel model(3, 16);
  StreamingEngine engine(backend, config_for(model.blocks(), 1), model.blocks());
  EXPECT_THROW(engine.acquire(0), std::logic_error);
  engine.begin_step(0);
  EXPECT_THAT([&] { engine.acquire(2); },
              ::testing::ThrowsMessage<std::logic_error>(HasSubstr("expected block 0 (forward) at use 0")));
  engine.acquire(0);
  EXPECT_THROW(engine.end_step(), std::logic_error);
  engine.release(0);
}

// A host that recomputes a block itself (checkpointing) asks for the use it just released
// again: the same fetch serves it, with no transfer, and the schedule goes on.
TEST(StreamingEngine, TheUseJustReleasedMayBeAcquiredAgain) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 17);
  StreamingEngine engine(backend, config_for(model.blocks(), 1), model.blocks());
  set_routes(engine, std::vector<Precision>(kBlocks, Precision::int8));
  engine.begin_step(0);
  const auto &uses = engine.schedule().uses();
  for (std::uint32_t use = 0; use < uses.size(); ++use) {
    for (int time = 0; time < (use >= kBlocks ? 2 : 1); ++time) {
      const BlockView &view = engine.acquire(uses[use].block);
      EXPECT_EQ(view.phase, uses[use].phase);
      testing::expect_view_holds(backend, view, model.blocks()[uses[use].block], 0);
      engine.release(uses[use].block);
    }
  }
  engine.acquire(0);  // after the step's last use, that one again
  engine.release(0);
  EXPECT_THROW(engine.acquire(1), std::logic_error);
  const StepTransferMetrics metrics = engine.end_step();
  EXPECT_EQ(metrics.fetches[Precision::int8], engine.schedule().fetches().size());
  EXPECT_EQ(metrics.prefetch_misses, 0u);
}

// A host whose forward ended in an earlier step (two forwards before the backwards) begins a
// step at the first backward use: it fetches the backward's blocks alone, ahead as usual.
TEST(StreamingEngine, AStepMayBeginAtTheBackward) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 18);
  StreamingEngine engine(backend, config_for(model.blocks(), 2), model.blocks());
  set_routes(engine, {Precision::int8, Precision::bf16, Precision::nf4, Precision::int8, Precision::bf16,
                      Precision::int8});
  for (std::int64_t step = 0; step < 3; ++step) {  // both event generations, twice
    engine.begin_step(step, {}, kBlocks);
    const auto &uses = engine.schedule().uses();
    for (std::uint32_t use = kBlocks; use < uses.size(); ++use) {
      const BlockView &view = engine.acquire(uses[use].block);
      EXPECT_EQ(view.phase, Phase::backward);
      testing::expect_view_holds(backend, view, model.blocks()[uses[use].block], 0);
      engine.release(uses[use].block);
    }
    const StepTransferMetrics metrics = engine.end_step();
    EXPECT_EQ(metrics.fetches.total(), kBlocks);
    EXPECT_EQ(metrics.prefetch_misses, 0u);
    EXPECT_EQ(metrics.prefetch_unused, 0u);
  }
  engine.flush_metrics();
  EXPECT_THROW(engine.begin_step(3, {}, 2 * kBlocks), std::invalid_argument);
  EXPECT_THROW(engine.acquire(0), std::logic_error);  // no step began
}

TEST(StreamingEngine, WritesOneMetricsRecordPerStep) {
  const auto path =
      std::filesystem::temp_directory_path() / ("sp_adapters_metrics_" + std::to_string(::getpid()) + ".jsonl");
  std::filesystem::remove(path);
  HostBackend backend;
  SyntheticModel model(kBlocks, 17);
  StreamingConfig config = config_for(model.blocks(), 1);
  config.metrics_path = path.string();
  {
    StreamingEngine engine(backend, config, model.blocks());
    set_routes(engine,
               {Precision::int8, Precision::bf16, Precision::int8, Precision::bf16, Precision::bf16, Precision::bf16});
    for (int step = 0; step < 3; ++step) {
      run_checked_step(engine, backend, model.blocks(), step, 0);
    }
  }
  std::ifstream in(path);
  std::string line;
  int records = 0;
  while (std::getline(in, line)) {
    const nlohmann::json record = nlohmann::json::parse(line);
    EXPECT_EQ(record.at("step").get<int>(), records);
    EXPECT_GT(record.at("h2d_bytes").at("int8").get<std::uint64_t>(), 0u);
    EXPECT_TRUE(record.at("copy_seconds").is_number());
    EXPECT_TRUE(record.at("dequant_seconds").is_number());
    ++records;
  }
  EXPECT_EQ(records, 3);
  std::filesystem::remove(path);
}

// A full disk (here: the file size limit) loses the records that do not fit, never a torn
// line, and the log goes on once there is room again, counting what it lost.
TEST(MetricsJsonlWriter, AFullDiskLosesRecordsNotTheLog) {
  const std::filesystem::path path = std::filesystem::temp_directory_path() / "sp_metrics_full_disk.jsonl";
  std::filesystem::remove(path);
  std::signal(SIGXFSZ, SIG_IGN);  // over the limit, write() fails with EFBIG instead
  rlimit previous{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &previous), 0);
  MetricsJsonlWriter writer(path);
  rlimit small = previous;
  small.rlim_cur = 100;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  for (int step = 0; step < 6; ++step) writer.append(nlohmann::json{{"step", step}, {"padding", "0123456789"}});
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &previous), 0);
  EXPECT_FALSE(writer.healthy());
  const std::uint64_t lost = writer.lost();
  EXPECT_GT(lost, 0u);
  EXPECT_LT(lost, 6u);
  for (int step = 6; step < 8; ++step) writer.append(nlohmann::json{{"step", step}, {"padding", "0123456789"}});
  EXPECT_EQ(writer.lost(), lost) << "once there is room, every record is written";
  std::ifstream in(path);
  std::vector<int> steps;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(record.is_object()) << "a torn line: " << line;
    steps.push_back(record["step"]);
  }
  EXPECT_EQ(steps.size(), 8u - lost);
  EXPECT_EQ(steps.back(), 7);
  std::filesystem::remove(path);
}

TEST(MetricsJsonlWriter, AnUnwritablePathIsLoggedNotFatal) {
  MetricsJsonlWriter writer("/nonexistent-directory/sp/metrics.jsonl");
  EXPECT_FALSE(writer.healthy());
  writer.append(nlohmann::json{{"step", 0}});
  EXPECT_FALSE(writer.healthy());
}

TEST(StepTransferMetrics, FeedbackCarriesTheMeasuredBytes) {
  StepTransferMetrics metrics;
  metrics.h2d_bytes[sp::Precision::bf16] = 10;
  metrics.h2d_bytes[sp::Precision::int8] = 20;
  metrics.h2d_bytes_all_bf16 = 50;
  const sp_step_feedback_v1 feedback = metrics.to_feedback();
  EXPECT_EQ(feedback.struct_size, sizeof(sp_step_feedback_v1));
  EXPECT_EQ(feedback.h2d_bytes_bf16, 10u);
  EXPECT_EQ(feedback.h2d_bytes_int8, 20u);
  EXPECT_EQ(feedback.h2d_bytes_all_bf16, 50u);
}

}  // namespace
}  // namespace sp::adapters
