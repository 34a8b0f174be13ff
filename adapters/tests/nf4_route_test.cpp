// The NF4 route through the streaming engine on the host backend: bit-exact slots, exact
// bytes, prefetch in both directions with all three routes mixed, precision switches, the
// transfer gate's fallback, and no host synchronization in steady state.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine_test_support.h"
#include "sp/adapters/host_backend.h"
#include "sp/adapters/instrumented_backend.h"
#include "sp/adapters/route_encoding.h"
#include "sp/adapters/streaming_engine.h"
#include "sp/kernels/nf4.h"
#include "sp/kernels/quantize.h"
#include "sp/kernels/slab.h"

namespace sp::adapters {
namespace {

namespace kn = sp::kernels;
using testing::config_for;
using testing::expect_view_holds;
using testing::gate_of;
using ::testing::HasSubstr;
using testing::run_checked_step;
using testing::set_routes;
using testing::SyntheticModel;

constexpr std::uint32_t kBlocks = 6;

// The CPU decode of the block's NF4 slab, built by the kernels from the same masters.
std::vector<std::vector<std::uint16_t>> decoded_nf4_slab(const BlockSpec &block, std::uint32_t group_size,
                                                         std::uint64_t *image_bytes) {
  kn::SlabEncoding encoding;
  encoding.precision = kn::SlabPrecision::kNf4;
  encoding.group_size = group_size;
  std::vector<kn::SlabTensorSource> sources;
  std::vector<kn::TensorShape> shapes;
  for (const TensorSpec &t : block.tensors) {
    sources.push_back({t.master, {t.rows, t.cols}});
    shapes.push_back({t.rows, t.cols});
  }
  const std::uint64_t size = kn::slab_image_bytes(encoding, shapes.data(), shapes.size());
  std::vector<std::uint8_t> image(size);
  const kn::CpuExec reference{kn::CpuImpl::kReference, 1};
  EXPECT_EQ(kn::build_slab(encoding, sources.data(), sources.size(), image.data(), size, reference), size);
  const kn::SlabReadResult read = kn::read_slab(image.data(), size);
  EXPECT_TRUE(read.ok) << read.error;
  std::vector<std::vector<std::uint16_t>> tensors;
  for (std::size_t t = 0; t < block.tensors.size(); ++t) {
    tensors.emplace_back(block.tensors[t].rows * block.tensors[t].cols);
    kn::decode_slab_tensor_to_bf16(image.data(), read.view, t, tensors.back().data(), reference);
  }
  *image_bytes = size;
  return tensors;
}

std::vector<std::uint16_t> read_back(TransferBackend &backend, const TensorView &view) {
  std::vector<std::uint16_t> out(view.rows * view.cols);
  backend.read_device(reinterpret_cast<std::byte *>(out.data()), reinterpret_cast<const std::byte *>(view.bf16),
                      out.size() * 2);
  return out;
}

class Nf4Groups : public ::testing::TestWithParam<std::uint32_t> {};

TEST_P(Nf4Groups, SlotsHoldTheCpuDequantOfTheNf4SlabBitForBit) {
  const std::uint32_t group = GetParam();
  HostBackend backend;
  SyntheticModel model(kBlocks, 31);
  StreamingConfig config = config_for(model.blocks(), 2);
  config.nf4_group_size = group;
  StreamingEngine engine(backend, config, model.blocks());
  set_routes(engine, std::vector<Precision>(kBlocks, Precision::nf4));

  engine.begin_step(0);
  for (const BlockUse &use : engine.schedule().uses()) {
    const BlockView &view = engine.acquire(use.block);
    EXPECT_EQ(view.precision, Precision::nf4);
    std::uint64_t slab_bytes = 0;
    const auto expected = decoded_nf4_slab(model.blocks()[use.block], group, &slab_bytes);
    EXPECT_EQ(engine.image_bytes(use.block, Precision::nf4), slab_bytes);
    EXPECT_EQ(engine.image_bytes(use.block, Precision::nf4), slab_bytes);
    for (std::size_t t = 0; t < view.tensors.size(); ++t) {
      EXPECT_EQ(read_back(backend, view.tensors[t]), expected[t])
          << "block " << use.block << " tensor " << *view.tensors[t].name;
    }
    // And the same against quantize_nf4 + dequantize_nf4_to_bf16 of each tensor alone.
    expect_view_holds(backend, view, model.blocks()[use.block], 0, group);
    engine.release(use.block);
  }
  const StepTransferMetrics metrics = engine.end_step();

  std::uint64_t nf4_bytes = 0;
  std::uint64_t all_bf16 = 0;
  std::uint64_t int8_bytes = 0;
  for (const BlockFetch &fetch : engine.schedule().fetches()) {
    nf4_bytes += engine.image_bytes(fetch.block, Precision::nf4);
    int8_bytes += engine.image_bytes(fetch.block, Precision::int8);
    all_bf16 += engine.image_bytes(fetch.block, Precision::bf16);
  }
  EXPECT_EQ(metrics.fetches[sp::Precision::nf4], engine.schedule().fetches().size());
  EXPECT_EQ(metrics.fetches[sp::Precision::int8] + metrics.fetches[sp::Precision::bf16], 0u);
  EXPECT_EQ(metrics.h2d_bytes[sp::Precision::nf4], nf4_bytes);
  EXPECT_EQ(metrics.h2d_bytes[sp::Precision::int8] + metrics.h2d_bytes[sp::Precision::bf16], 0u);
  EXPECT_EQ(metrics.h2d_bytes_all_bf16, all_bf16);
  EXPECT_LT(nf4_bytes, int8_bytes);
  EXPECT_EQ(metrics.to_feedback().h2d_bytes_nf4, nf4_bytes);
}

INSTANTIATE_TEST_SUITE_P(Groups, Nf4Groups, ::testing::Values(32u, 64u, 256u));

struct MixedCase {
  std::uint32_t window;
  bool backward;
};

class MixedRoutes : public ::testing::TestWithParam<MixedCase> {};

// All three routes interleaved, prefetched exactly `window` ahead forward, across the turn and
// backward; every use bit for bit, every byte counted on its route.
TEST_P(MixedRoutes, PrefetchDeliversEveryRouteInBothDirections) {
  const MixedCase param = GetParam();
  HostBackend backend;
  SyntheticModel model(kBlocks, 32);
  StreamingConfig config = config_for(model.blocks(), param.window);
  config.backward = param.backward;
  config.int8_group_size = 128;
  StreamingEngine engine(backend, config, model.blocks());
  const std::vector<Precision> routes = {Precision::nf4, Precision::bf16, Precision::int8,
                                         Precision::nf4, Precision::int8, Precision::bf16};
  set_routes(engine, routes);
  const auto fetches = static_cast<std::uint32_t>(engine.schedule().fetches().size());

  for (std::int64_t step = 0; step < 2; ++step) {
    engine.begin_step(step);
    EXPECT_EQ(engine.issued_fetches(), std::min(param.window, fetches));
    for (const BlockUse &use : engine.schedule().uses()) {
      const BlockView &view = engine.acquire(use.block);
      EXPECT_EQ(engine.issued_fetches(), std::min(use.fetch + 1 + param.window, fetches));
      EXPECT_EQ(view.precision, routes[use.block]) << "block " << use.block;
      expect_view_holds(backend, view, model.blocks()[use.block], 128);
      engine.release(use.block);
    }
    const StepTransferMetrics metrics = engine.end_step();
    sp::PerPrecision<std::uint64_t> bytes{};
    sp::PerPrecision<std::uint32_t> counts{};
    for (const BlockFetch &fetch : engine.schedule().fetches()) {
      const Precision route = routes[fetch.block];
      bytes[route] += engine.image_bytes(fetch.block, route);
      ++counts[route];
    }
    for (const Precision route : sp::kPrecisions) {
      EXPECT_EQ(metrics.h2d_bytes[route], bytes[route]) << sp::precision_name(route);
      EXPECT_EQ(metrics.fetches[route], counts[route]) << sp::precision_name(route);
    }
    EXPECT_EQ(metrics.prefetch_misses, param.window == 0 ? fetches : 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Windows, MixedRoutes,
                         ::testing::Values(MixedCase{0, true}, MixedCase{1, true}, MixedCase{2, true},
                                           MixedCase{kBlocks, true}, MixedCase{2, false}));

TEST(Nf4Route, PrecisionSwitchesThroughAllThreeRoutes) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 33);
  StreamingEngine engine(backend, config_for(model.blocks(), 1, /*spare_slabs=*/1), model.blocks());
  run_checked_step(engine, backend, model.blocks(), 0, 0);
  const std::vector<std::vector<Precision>> plans = {
      {Precision::nf4, Precision::nf4, Precision::bf16, Precision::int8, Precision::nf4, Precision::bf16},
      {Precision::int8, Precision::nf4, Precision::nf4, Precision::nf4, Precision::bf16, Precision::bf16},
      {Precision::bf16, Precision::nf4, Precision::int8, Precision::nf4, Precision::nf4, Precision::int8},
  };
  std::vector<Precision> previous(kBlocks, Precision::bf16);
  for (std::size_t i = 0; i < plans.size(); ++i) {
    set_routes(engine, plans[i]);
    // An optimizer update of one block between steps, on top of the switch.
    model.update_weights(static_cast<std::uint32_t>(i), 2e-3f);
    engine.on_weights_updated(static_cast<std::uint32_t>(i));
    const StepTransferMetrics metrics =
        run_checked_step(engine, backend, model.blocks(), static_cast<std::int64_t>(i) + 1, 0);
    std::uint32_t switched = 0;
    for (std::uint32_t b = 0; b < kBlocks; ++b) {
      switched += plans[i][b] != previous[b] || b == i;
    }
    EXPECT_EQ(metrics.image_rebuilds, switched) << "plan " << i;
    EXPECT_GT(metrics.fetches[sp::Precision::nf4], 0u);
    previous = plans[i];
  }
}

TEST(Nf4Route, UnsupportedGroupSizeIsANamedStartupError) {
  HostBackend backend;
  SyntheticModel model(2, 34);
  for (std::uint32_t group : {0u, 48u, 512u}) {
    StreamingConfig config = config_for(model.blocks(), 1);
    config.nf4_group_size = group;
    EXPECT_THAT([&] { StreamingEngine engine(backend, config, model.blocks()); },
                ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr(
                    "StreamingConfig.nf4_group_size is " + std::to_string(group) + "; expected 32, 64, 128 or 256")));
  }
  EXPECT_EQ(StreamingConfig{}.nf4_group_size, 64u);
}

// A plugin that asks for NF4 everywhere, and a transfer policy that says NF4 pays only for
// blocks 0-1 and INT8 for blocks 0-3: blocks 2-3 fall back to INT8, 4-5 to BF16.
TEST(Nf4Route, TransferGateFallsBackToInt8ThenBf16) {
  HostBackend backend;
  SyntheticModel model(kBlocks, 35);
  StreamingEngine engine(backend, config_for(model.blocks(), 2), model.blocks());
  set_routes(engine, std::vector<Precision>(kBlocks, Precision::nf4));
  engine.policy_bridge().set_transfer_gate(
      gate_of({true, true, true, true, false, false}, {true, true, false, false, false, false}));
  const std::vector<Precision> delivered = {Precision::nf4,  Precision::nf4,  Precision::int8,
                                            Precision::int8, Precision::bf16, Precision::bf16};
  engine.begin_step(0);
  for (const BlockUse &use : engine.schedule().uses()) {
    const BlockView &view = engine.acquire(use.block);
    EXPECT_EQ(view.precision, delivered[use.block]) << "block " << use.block;
    expect_view_holds(backend, view, model.blocks()[use.block], 0);
    engine.release(use.block);
  }
  const StepTransferMetrics metrics = engine.end_step();
  sp::PerPrecision<std::uint32_t> per_route{};
  for (const BlockFetch &fetch : engine.schedule().fetches()) ++per_route[delivered[fetch.block]];
  EXPECT_EQ(metrics.fetches_by_transfer_policy[sp::Precision::int8], per_route[sp::Precision::int8]);
  EXPECT_EQ(metrics.fetches_by_transfer_policy[sp::Precision::bf16], per_route[sp::Precision::bf16]);
  EXPECT_EQ(metrics.fetches[sp::Precision::nf4], per_route[sp::Precision::nf4]);
  const nlohmann::json record = metrics.to_json();
  EXPECT_EQ(record.at("fetches").at("nf4").get<std::uint32_t>(), per_route[sp::Precision::nf4]);
  EXPECT_EQ(record.at("fetches").at("int8_by_transfer_policy").get<std::uint32_t>(), per_route[sp::Precision::int8]);
  EXPECT_EQ(record.at("fetches").at("bf16_by_transfer_policy").get<std::uint32_t>(), per_route[sp::Precision::bf16]);
  EXPECT_FALSE(record.at("fetches").contains("nf4_by_transfer_policy"));  // never a fallback's route
  EXPECT_EQ(record.at("h2d_bytes").at("nf4").get<std::uint64_t>(), metrics.h2d_bytes[sp::Precision::nf4]);
}

TEST(Nf4Route, SteadyStateMakesNoHostSynchronization) {
  HostBackend host;
  InstrumentedBackend backend(host);
  SyntheticModel model(kBlocks, 36);
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
    std::vector<Precision> routes(kBlocks, Precision::nf4);
    routes[static_cast<std::size_t>(step) % kBlocks] = Precision::int8;
    routes[static_cast<std::size_t>(step + 3) % kBlocks] = Precision::bf16;
    set_routes(engine, routes);
    model.update_weights(static_cast<std::uint32_t>(step % 3), 1e-4f);
    engine.on_weights_updated(static_cast<std::uint32_t>(step % 3));
    EXPECT_EQ(run_step(step).stalls, 0u);
  }
  EXPECT_EQ(backend.counts().host_syncs, 0u);
  EXPECT_EQ(backend.counts().allocations, 0u);
  EXPECT_GT(backend.counts().dequants, 0u);
}

TEST(RouteTable, AgreesWithTheKernelsOnGroupSizesAndSlabCodes) {
  for (const RouteTraits &route : kRouteTraits) {
    const sp::kernels::SlabEncoding encoding = slab_encoding(route.precision, route.default_group_size);
    EXPECT_EQ(static_cast<std::uint32_t>(encoding.precision), route.slab_code) << route.name;
    EXPECT_EQ(encoding.group_size, route.default_group_size) << route.name;
    for (std::uint32_t group = 0; group <= 512; ++group) {
      // By the slab format the route's images take: routes over one format share its sizes.
      bool kernels_take_it = group == 0;
      if (encoding.precision == sp::kernels::SlabPrecision::kInt8) {
        kernels_take_it = sp::kernels::is_supported_group_size(group);
      }
      if (encoding.precision == sp::kernels::SlabPrecision::kNf4) {
        kernels_take_it = sp::kernels::is_supported_nf4_group_size(group);
      }
      EXPECT_EQ(is_supported_group_size(route.precision, group), kernels_take_it) << route.name << " " << group;
    }
  }
  EXPECT_EQ(kRouteTraits[static_cast<std::size_t>(Precision::nf4)].default_group_size,
            sp::kernels::kNf4DefaultGroupSize);
}

TEST(Nf4Route, BlockDescriptionsStayFrozenAndEveryRouteHasItsSizeAndEncoding) {
  HostBackend backend;
  SyntheticModel model(3, 37);
  StreamingEngine engine(backend, config_for(model.blocks(), 1), model.blocks());
  const std::vector<sp_block_desc_v1> descs = engine.block_descs();
  ASSERT_EQ(descs.size(), 3u);
  for (std::uint32_t b = 0; b < 3; ++b) {
    EXPECT_EQ(descs[b].struct_size, 40u);
    EXPECT_EQ(descs[b].bf16_bytes, engine.image_bytes(b, Precision::bf16));
    EXPECT_EQ(descs[b].int8_bytes, engine.image_bytes(b, Precision::int8));
    EXPECT_LT(engine.image_bytes(b, Precision::nf4), descs[b].int8_bytes);
    EXPECT_GT(engine.image_bytes(b, Precision::nf4), 0u);
  }
  for (const RouteTraits &route : kRouteTraits) {
    EXPECT_EQ(static_cast<std::uint32_t>(engine.image_encoding(route.precision).precision), route.slab_code);
  }
  EXPECT_EQ(engine.image_encoding(Precision::nf4).group_size, config_for(model.blocks(), 1).nf4_group_size);
}

}  // namespace
}  // namespace sp::adapters
