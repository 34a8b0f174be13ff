// The benchmark-driven transfer policy, end to end through the PolicyBridge on the host
// backend, with fixed reports so that nothing depends on timing: where the report measured
// INT8 slower for a size, blocks of that size stay BF16 even though the plugin says INT8.
#include <gtest/gtest.h>

#include "engine_test_support.h"
#include "sp/adapters/host_backend.h"
#include "sp/adapters/streaming_engine.h"
#include "sp/adapters/transfer_policy.h"

namespace sp::adapters {
namespace {

// Two tensors per block: blocks 0-1 small, blocks 2-3 large.
class TwoSizeModel {
 public:
  TwoSizeModel() {
    for (uint32_t b = 0; b < 4; ++b) {
      const uint64_t rows = b < 2 ? 8 : 96;  // the shared test config has 64 KiB slots
      auto values = std::make_unique<std::vector<float>>(rows * 256);
      for (size_t i = 0; i < values->size(); ++i)
        values->at(i) = 0.01f * static_cast<float>((i * 7919 + b) % 201) - 1.0f;
      blocks_.push_back({"block" + std::to_string(b), {{"weight", values->data(), rows, 256}}});
      storage_.push_back(std::move(values));
    }
  }
  const std::vector<adapters::BlockSpec>& blocks() const { return blocks_; }

 private:
  std::vector<std::unique_ptr<std::vector<float>>> storage_;
  std::vector<adapters::BlockSpec> blocks_;
};

TransferPoint measured(uint64_t bf16_bytes, double int8_speedup) {
  TransferPoint p;
  p.bf16_bytes = bf16_bytes;
  p.int8_bytes = bf16_bytes / 2;
  p.bf16_copy = p.int8_copy = p.int8_dequant = p.bf16_rebuild = p.int8_rebuild = {1e-4, 1e-4, 1e-4, 5};
  p.raw_copy_s = 9e-5;
  p.bf16_path_s = p.bf16_trained_path_s = 1e-4;
  p.int8_frozen_path_s = p.int8_trained_path_s = 1e-4 / int8_speedup;
  return p;
}

TEST(TransferGateEndToEnd, Int8OnlyWhereBothPoliciesSayIt) {
  TwoSizeModel model;
  adapters::HostBackend backend;
  adapters::StreamingEngine engine(backend, adapters::testing::config_for(model.blocks(), 1), model.blocks());
  std::vector<uint64_t> sizes;
  for (uint32_t b = 0; b < 4; ++b) sizes.push_back(engine.image_bytes(b, Precision::bf16));
  ASSERT_LT(sizes[0], sizes[2]);

  TransferReport report;
  report.machine = "fixed";
  report.backend = "host";
  report.device = "fixture";
  report.reference_h2d_gbps = 10;
  report.points = {measured(sizes[0], 0.7), measured(sizes[2], 1.6)};
  const TransferPolicy policy = TransferPolicy::merge({report}, 1.0);
  engine.policy_bridge().set_transfer_gate(transfer_gate(policy, BlockWeights::kFrozen, sizes));
  // The plugin wants INT8 for blocks 0, 2 and 3, BF16 for block 1.
  adapters::testing::set_routes(engine, {Precision::int8, Precision::bf16, Precision::int8, Precision::int8});

  engine.begin_step(0);
  for (const adapters::BlockUse& use : engine.schedule().uses()) {
    const adapters::BlockView& view = engine.acquire(use.block);
    EXPECT_EQ(view.precision, use.block >= 2 ? Precision::int8 : Precision::bf16) << "block " << use.block;
    adapters::testing::expect_view_holds(backend, view, model.blocks()[use.block], 0);
    engine.release(use.block);
  }
  const adapters::StepTransferMetrics metrics = engine.end_step();
  const uint32_t fetches_of_block0 =
      static_cast<uint32_t>(std::count_if(engine.schedule().fetches().begin(), engine.schedule().fetches().end(),
                                          [](const auto& f) { return f.block == 0; }));
  EXPECT_EQ(metrics.fetches_by_transfer_policy[sp::Precision::bf16], fetches_of_block0)
      << "only block 0 was held back by the transfer policy; block 1 was BF16 by the plugin";
  EXPECT_GT(metrics.fetches[sp::Precision::int8], 0u);
  EXPECT_GT(metrics.h2d_bytes[sp::Precision::int8], 0u);
}

// The plugin wants NF4 for every block. Small blocks: neither route pays, so BF16. Large
// blocks: INT8 pays, NF4 only for frozen weights; trained blocks therefore fall back to INT8.
TEST(TransferGateEndToEnd, Nf4WherePaysElseInt8WhereThatPaysElseBf16) {
  TwoSizeModel model;
  adapters::HostBackend backend;
  std::vector<uint64_t> sizes;
  {
    adapters::StreamingEngine sizing(backend, adapters::testing::config_for(model.blocks(), 1), model.blocks());
    for (uint32_t b = 0; b < 4; ++b) sizes.push_back(sizing.image_bytes(b, Precision::bf16));
  }
  TransferPoint small = measured(sizes[0], 0.7);
  TransferPoint large = measured(sizes[2], 1.6);
  for (TransferPoint* p : {&small, &large}) {
    Nf4Measurement m;
    m.nf4_bytes = p->bf16_bytes / 4;
    m.copy = m.dequant = m.rebuild = p->bf16_copy;
    m.frozen_path_s = p == &large ? 1e-4 / 2.0 : 1e-4 / 0.6;
    m.trained_path_s = 1e-4 / 0.8;  // the NF4 rebuild never pays here
    p->nf4 = m;
  }
  TransferReport report;
  report.machine = "fixed";
  report.backend = "host";
  report.device = "fixture";
  report.reference_h2d_gbps = 10;
  report.points = {small, large};
  const TransferPolicy policy = TransferPolicy::merge({report}, 1.0);

  for (BlockWeights weights : {BlockWeights::kFrozen, BlockWeights::kTrained}) {
    adapters::StreamingEngine engine(backend, adapters::testing::config_for(model.blocks(), 1), model.blocks());
    engine.policy_bridge().set_transfer_gate(transfer_gate(policy, weights, sizes));
    adapters::testing::set_routes(engine, std::vector<Precision>(4, Precision::nf4));
    const Precision large_route = weights == BlockWeights::kFrozen ? Precision::nf4 : Precision::int8;
    engine.begin_step(0);
    for (const adapters::BlockUse& use : engine.schedule().uses()) {
      const adapters::BlockView& view = engine.acquire(use.block);
      EXPECT_EQ(view.precision, use.block >= 2 ? large_route : Precision::bf16) << "block " << use.block;
      adapters::testing::expect_view_holds(backend, view, model.blocks()[use.block], 0);
      engine.release(use.block);
    }
    const adapters::StepTransferMetrics metrics = engine.end_step();
    EXPECT_GT(metrics.fetches_by_transfer_policy[sp::Precision::bf16], 0u);
    if (weights == BlockWeights::kFrozen) {
      EXPECT_GT(metrics.h2d_bytes[sp::Precision::nf4], 0u);
      EXPECT_EQ(metrics.fetches[sp::Precision::int8], 0u);
    } else {
      EXPECT_EQ(metrics.h2d_bytes[sp::Precision::nf4], 0u);
      EXPECT_EQ(metrics.fetches_by_transfer_policy[sp::Precision::int8], metrics.fetches[sp::Precision::int8]);
      EXPECT_GT(metrics.fetches[sp::Precision::int8], 0u);
    }
  }
}

TEST(TransferGateEndToEnd, UnreadablePolicyFileKeepsEveryBlockBf16AndWarnsOnce) {
  int warnings = 0;
  std::string message;
  const TransferPolicy policy = load_transfer_policy_or_bf16("/nonexistent/policy.json", [&](const std::string& m) {
    ++warnings;
    message = m;
  });
  EXPECT_EQ(warnings, 1);
  EXPECT_NE(message.find("/nonexistent/policy.json"), std::string::npos) << message;
  EXPECT_NE(message.find("every block stays BF16"), std::string::npos) << message;
  for (const BlockWeights weights : {BlockWeights::kFrozen, BlockWeights::kTrained}) {
    const adapters::TransferGate gate = transfer_gate(policy, weights, {1, 1ull << 20, 1ull << 40});
    EXPECT_EQ(gate.pays[Precision::int8], (std::vector<bool>{false, false, false}));
    EXPECT_EQ(gate.pays[Precision::nf4], (std::vector<bool>{false, false, false}));
  }
}

}  // namespace
}  // namespace sp::adapters
