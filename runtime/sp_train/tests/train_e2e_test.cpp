// Short CPU trainings through the real plugin, the host backend and the streaming engine.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <spdlog/sinks/null_sink.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "calibration_cache.h"
#include "sp/plugin_abi_v1.h"
#include "sp/precision.h"
#include "checkpoint_file.h"
#include "checkpoint_meta.h"
#include "sp/kernels/slab.h"
#include "sp/testing/gpu_gate.h"
#include "train_config.h"
#include "train_test_support.h"
#include "crash_marker.h"
#include "trainer.h"

namespace sp::train {
namespace {

namespace fs = std::filesystem;
using testing::make_scratch_dir;

class TrainE2E : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = make_scratch_dir("e2e");
    corpus_ = testing::write_corpus(dir_);
    cache_ = dir_ / "calibration-cache";
    plugin_dir_ = dir_ / "plugins";
    fs::create_directories(plugin_dir_);
    fs::copy_file(SP_PLUGIN_FILE, plugin_dir_ / "libsp_selective_precision.so");
    logger_ = std::make_shared<spdlog::logger>("e2e", std::make_shared<spdlog::sinks::null_sink_mt>());
  }
  void TearDown() override { fs::remove_all(dir_); }

  TrainConfig config(std::vector<Override> overrides = {}) const {
    return parse_train_config(testing::tiny_config(corpus_, cache_), "tiny.yaml", overrides);
  }
  RunOptions options(const std::string& run) const {
    RunOptions o;
    o.out_dir = dir_ / run;
    o.plugin_dir = plugin_dir_;
    o.logger = logger_;
    return o;
  }
  RunSummary train(const std::string& run, std::vector<Override> overrides = {},
                   std::function<void(const StepRecord&)> on_step = {}, const std::atomic<bool>* stop = nullptr) {
    RunOptions o = options(run);
    o.on_step = std::move(on_step);
    o.stop_requested = stop;
    Trainer trainer(config(std::move(overrides)), o);
    return trainer.run();
  }

  fs::path dir_, corpus_, cache_, plugin_dir_;
  std::shared_ptr<spdlog::logger> logger_;
};

double mean_loss(const std::vector<StepRecord>& steps, std::size_t begin, std::size_t end) {
  double sum = 0.0;
  for (std::size_t i = begin; i < end; ++i) sum += steps[i].loss;
  return sum / static_cast<double>(end - begin);
}

std::uint64_t image_bytes(const ModelConfig& m, kernels::SlabPrecision precision, std::uint32_t group) {
  const std::uint64_t c = m.d_model, h = c * m.mlp_ratio;
  const kernels::TensorShape shapes[] = {{3 * c, c}, {c, c}, {h, c}, {c, h}};
  kernels::SlabEncoding encoding;
  encoding.precision = precision;
  encoding.group_size = group;
  return kernels::slab_image_bytes(encoding, shapes, 4);
}

struct QuantizedFetchSteps {
  std::size_t int8 = 0;
  std::size_t nf4 = 0;
};

// Each step's fetches take the routes decided after the previous step (step 0's: the policy's
// forced routes, `forced`, BF16 elsewhere), and its INT8 and NF4 bytes are those routes'
// images. Counts the steps that moved INT8 and NF4 bytes.
QuantizedFetchSteps expect_bytes_follow_decisions(const RunSummary& run, const TrainConfig& c,
                                                  std::vector<std::uint8_t> forced = {}) {
  const std::uint32_t n = c.model.n_blocks;
  const std::uint64_t int8_bytes = image_bytes(c.model, kernels::SlabPrecision::kInt8, c.streaming.int8_group_size);
  const std::uint64_t nf4_bytes = image_bytes(c.model, kernels::SlabPrecision::kNf4, c.policy_keys.nf4_group_size);
  QuantizedFetchSteps steps;
  for (std::size_t s = 0; s < run.steps.size(); ++s) {
    const StepRecord& r = run.steps[s];
    if (forced.empty()) forced.assign(n, SP_PRECISION_BF16);
    const std::vector<std::uint8_t> expected = s == 0 ? forced : run.steps[s - 1].decisions;
    EXPECT_EQ(r.routes, expected) << "step " << s;
    // Every block is fetched for forward and for backward, except the last, whose slot is
    // reused across the turn.
    std::uint64_t expected_int8 = 0, expected_nf4 = 0;
    for (std::uint32_t b = 0; b < n; ++b) {
      const std::uint64_t fetches = b + 1 == n ? 1 : 2;
      expected_int8 += r.routes[b] == SP_PRECISION_INT8 ? int8_bytes * fetches : 0;
      expected_nf4 += r.routes[b] == SP_PRECISION_NF4 ? nf4_bytes * fetches : 0;
    }
    EXPECT_EQ(r.h2d_bytes[sp::Precision::int8], expected_int8) << "step " << s;
    EXPECT_EQ(r.h2d_bytes[sp::Precision::nf4], expected_nf4) << "step " << s;
    EXPECT_EQ(r.h2d_bytes[sp::Precision::bf16] + r.h2d_bytes[sp::Precision::int8] + r.h2d_bytes[sp::Precision::nf4] < r.h2d_bytes_all_bf16,
              expected_int8 + expected_nf4 != 0)
        << "step " << s;
    steps.int8 += expected_int8 != 0;
    steps.nf4 += expected_nf4 != 0;
  }
  return steps;
}

TEST_F(TrainE2E, LearnsDecidesAndMovesTheBytesItDecided) {
  const RunSummary run = train("plain");
  ASSERT_EQ(run.steps.size(), 24u);
  EXPECT_LT(mean_loss(run.steps, 19, 24), mean_loss(run.steps, 0, 5) - 0.3);
  ASSERT_TRUE(run.json["final_val_loss"].is_number());
  EXPECT_GT(expect_bytes_follow_decisions(run, config()).int8, 0u) << "the plugin never sent a block to INT8";
  const std::uint64_t saved = run.json["h2d_bytes"]["saved"];
  EXPECT_GT(saved, 0u);
  EXPECT_EQ(run.json["device"], "cpu");
  EXPECT_TRUE(fs::exists(dir_ / "plain" / "summary.json"));
  EXPECT_TRUE(fs::exists(dir_ / "plain" / "selective_precision_telemetry.jsonl"));
}

// The fixed all-NF4 format: every block crosses as NF4 from the first step (the plugin's initial
// hints), the bytes are the NF4 images, and the model still learns.
TEST_F(TrainE2E, AllNf4StreamsNf4ImagesAndStillLearns) {
  const std::vector<Override> all_nf4 = {{"memory.stagehand.selective_precision.mode", "static"},
                                         {"memory.stagehand.selective_precision.force_nf4_blocks", "[0, 1, 2, 3]"}};
  const RunSummary run = train("nf4", all_nf4);
  ASSERT_EQ(run.steps.size(), 24u);
  EXPECT_EQ(expect_bytes_follow_decisions(run, config(all_nf4), std::vector<std::uint8_t>(4, SP_PRECISION_NF4)).nf4, 24u);
  EXPECT_LT(mean_loss(run.steps, 19, 24), mean_loss(run.steps, 0, 5) - 0.3);
  const double saved = run.json["h2d_bytes"]["saved_fraction"];
  EXPECT_GT(saved, 0.65) << "an NF4 image is about 0.28x the BF16 one";
  EXPECT_EQ(run.json["block_steps"]["nf4"], 24u * 4u);
}

// Policy v2 with three tiers, scored on the calibration errors alone: a block whose NF4 error
// is small goes to NF4, and the routes and bytes follow the plugin's decisions.
TEST_F(TrainE2E, ThreeTierPolicySendsTolerantBlocksToNf4) {
  const std::string p = "memory.stagehand.selective_precision.";
  const std::vector<Override> v2 = {{p + "tiers", "[bf16, int8, nf4]"},
                                    {p + "grad_weight", "0"},
                                    {p + "error_weight", "1"},
                                    {p + "nf4_threshold", "0.45"},
                                    {p + "nf4_quant_error_threshold", "1.0"}};
  const RunSummary run = train("v2", v2);
  EXPECT_GT(expect_bytes_follow_decisions(run, config(v2)).nf4, 0u) << "no block ever went to NF4";
  EXPECT_EQ(run.json["plugin"]["version"], "4.0.0");
}

// With an outlier channel planted, which a fresh run does and a resumed one must not redo.
// Policy v3 under a bytes budget: the first step is a calibration step (its update skipped),
// whose gradients the policy allocates from, so from step 1 on every step's fetches take the
// allocation and move at most the budget.
TEST_F(TrainE2E, PolicyV3CalibratesInTheFirstStepAndKeepsItsBudgetFromTheSecond) {
  const std::string p = "memory.stagehand.selective_precision.";
  const std::vector<Override> v3 = {{p + "mode", "budget"}, {p + "budget", "{bytes: 0.5}"}, {p + "tiers", "[bf16, int8, nf4]"}};
  const RunSummary run = train("v3", v3);
  ASSERT_EQ(run.steps.size(), 24u);
  EXPECT_TRUE(run.steps[0].calibration_step);
  expect_bytes_follow_decisions(run, config(v3));
  for (std::size_t s = 1; s < run.steps.size(); ++s) {
    const StepRecord& r = run.steps[s];
    EXPECT_FALSE(r.calibration_step) << "step " << s;
    const std::uint64_t moved = r.h2d_bytes[sp::Precision::bf16] + r.h2d_bytes[sp::Precision::int8] + r.h2d_bytes[sp::Precision::nf4];
    EXPECT_LE(static_cast<double>(moved), 0.5 * static_cast<double>(r.h2d_bytes_all_bf16)) << "step " << s;
  }
  EXPECT_LT(mean_loss(run.steps, 19, 24), mean_loss(run.steps, 0, 5) - 0.3);
  const std::string metrics = testing::read_text(dir_ / "v3" / kRunTrainMetricsFile);
  EXPECT_EQ(metrics.find("\"calibration_step\":true"), metrics.rfind("\"calibration_step\":true"));
  EXPECT_NE(metrics.find("\"calibration_step\":true"), std::string::npos);
}

TEST_F(TrainE2E, InterruptedRunResumesBitwiseIdentically) {
  const std::vector<Override> outliers = {{"model.outliers.blocks", "[1]"}};
  const RunSummary straight = train("straight", outliers);
  // What SIGINT does: the flag is seen at the next step boundary, a checkpoint is written.
  std::atomic<bool> stop{false};
  const RunSummary first_half = train(
      "resumed", outliers, [&](const StepRecord& r) { stop = r.step == 9; }, &stop);
  EXPECT_EQ(first_half.outcome, RunOutcome::interrupted);
  ASSERT_EQ(first_half.steps.size(), 10u);
  Trainer resumed_trainer(config(outliers), options("resumed"));
  EXPECT_EQ(resumed_trainer.next_step(), 10);
  const RunSummary second_half = resumed_trainer.run();
  ASSERT_EQ(second_half.steps.size(), 14u);
  for (std::size_t i = 0; i < second_half.steps.size(); ++i) {
    const StepRecord& a = straight.steps[10 + i];
    const StepRecord& b = second_half.steps[i];
    ASSERT_EQ(a.step, b.step);
    EXPECT_EQ(std::memcmp(&a.loss, &b.loss, sizeof a.loss), 0)
        << "step " << a.step << ": " << a.loss << " vs " << b.loss;
    EXPECT_EQ(a.routes, b.routes) << "step " << a.step;
    EXPECT_EQ(a.decisions, b.decisions) << "step " << a.step;
  }
  EXPECT_EQ(straight.json["final_val_loss"], second_half.json["final_val_loss"]);
  EXPECT_EQ(straight.json["h2d_bytes"], second_half.json["h2d_bytes"]);
}

// Block 0 BF16, block 1 INT8, blocks 2 and 3 NF4, from the plugin's first hints on.
std::vector<Override> blocks_on_three_routes() {
  const std::string p = "memory.stagehand.selective_precision.";
  return {{p + "mode", "static"},
          {p + "tiers", "[bf16, int8, nf4]"},
          {p + "force_int8_blocks", "[1]"},
          {p + "force_nf4_blocks", "[2, 3]"}};
}

// Two runs whose every step has the same loss and gradient norm bit for bit, and the same routes.
void expect_bitwise_same_steps(const RunSummary& a, const RunSummary& b) {
  ASSERT_EQ(a.steps.size(), b.steps.size());
  for (std::size_t s = 0; s < a.steps.size(); ++s) {
    EXPECT_EQ(std::memcmp(&a.steps[s].loss, &b.steps[s].loss, sizeof(double)), 0) << "step " << s;
    EXPECT_EQ(std::memcmp(&a.steps[s].grad_norm, &b.steps[s].grad_norm, sizeof(double)), 0) << "step " << s;
    EXPECT_EQ(a.steps[s].routes, b.steps[s].routes) << "step " << s;
  }
}

// train.host_optimizer: the fused pass (AdamW and the image rebuild in one sweep) and the
// unfused reference give the same run bit for bit, with blocks on each of the three routes.
TEST_F(TrainE2E, FusedAndUnfusedHostOptimizersTrainBitwiseIdentically) {
  const std::vector<Override> three_routes = blocks_on_three_routes();
  std::vector<Override> unfused = three_routes;
  unfused.push_back({"train.host_optimizer", "unfused"});
  const RunSummary a = train("fused", three_routes);
  const RunSummary b = train("unfused", unfused);
  expect_bitwise_same_steps(a, b);
  EXPECT_EQ(a.steps.back().routes, (std::vector<std::uint8_t>{0, 1, 2, 2}));
  EXPECT_EQ(a.json["final_val_loss"], b.json["final_val_loss"]);
  EXPECT_EQ(a.json["h2d_bytes"], b.json["h2d_bytes"]);
  EXPECT_EQ(a.json["host_optimizer"], "fused");
  EXPECT_EQ(b.json["host_optimizer"], "unfused");
}

// train.host_optimizer: overlapped updates each block during the backward. Without clipping,
// where the previous step's norm changes nothing, it is the fused run bit for bit, with blocks on
// each route (the images written in the backward are those the fused sweep writes after it).
TEST_F(TrainE2E, OverlappedUpdateWithoutClippingTrainsAsTheFusedOne) {
  std::vector<Override> fused = blocks_on_three_routes();
  fused.push_back({"train.grad_clip", "0"});
  std::vector<Override> overlapped = fused;
  overlapped.push_back({"train.host_optimizer", "overlapped"});
  const RunSummary a = train("fused", fused);
  const RunSummary b = train("overlapped", overlapped);
  expect_bitwise_same_steps(a, b);
  EXPECT_EQ(a.json["final_val_loss"], b.json["final_val_loss"]);
  EXPECT_EQ(b.json["host_optimizer"], "overlapped");
}

// With clipping, the overlapped update clips by the previous step's norm, which the checkpoint
// keeps: an interrupted run resumes bit for bit, and the run is not the exact one (the default
// clip of 1.0 binds at this scale's early steps).
TEST_F(TrainE2E, OverlappedUpdateClipsByThePreviousNormAndResumesBitwise) {
  const std::vector<Override> overlapped = {{"train.host_optimizer", "overlapped"}};
  const RunSummary straight = train("straight", overlapped);
  const RunSummary exact = train("exact", {});
  std::atomic<bool> stop{false};
  const RunSummary first_half = train(
      "resumed", overlapped, [&](const StepRecord& r) { stop = r.step == 9; }, &stop);
  ASSERT_EQ(first_half.steps.size(), 10u);
  Trainer resumed_trainer(config(overlapped), options("resumed"));
  const RunSummary second_half = resumed_trainer.run();
  ASSERT_EQ(second_half.steps.size(), straight.steps.size() - 10);
  for (std::size_t i = 0; i < second_half.steps.size(); ++i) {
    const StepRecord& a = straight.steps[10 + i];
    const StepRecord& b = second_half.steps[i];
    EXPECT_EQ(std::memcmp(&a.loss, &b.loss, sizeof a.loss), 0) << "step " << a.step;
    EXPECT_EQ(a.routes, b.routes) << "step " << a.step;
  }
  EXPECT_EQ(straight.json["final_val_loss"], second_half.json["final_val_loss"]);
  // Step 0 runs exact (no previous norm), so step 1's loss is the exact run's; later ones part.
  EXPECT_EQ(std::memcmp(&straight.steps[1].loss, &exact.steps[1].loss, sizeof(double)), 0);
  bool parted = false;
  for (std::size_t s = 2; s < exact.steps.size(); ++s) parted |= straight.steps[s].loss != exact.steps[s].loss;
  EXPECT_TRUE(parted) << "clipping by the previous norm changed nothing: does the clip bind?";
  EXPECT_LT(mean_loss(straight.steps, 19, 24), mean_loss(straight.steps, 0, 5) - 0.3);
  // The host optimizer is full mode's: LoRA takes the key and trains as before.
  const RunSummary lora = train("lora", {{"train.mode", "lora"}, {"train.host_optimizer", "overlapped"}});
  EXPECT_EQ(lora.outcome, RunOutcome::completed);
  EXPECT_EQ(lora.steps.size(), straight.steps.size());
}

// model.streaming_unit: sublayer gives the plugin one unit per attention and per MLP sublayer.
// With every unit BF16 the math is the whole-block run's, to rounding; with the MLP halves
// forced to NF4, those cross as NF4 and the attention halves as BF16.
TEST_F(TrainE2E, SublayerUnitsAreDecidedAndStreamedHalfABlockEach) {
  const std::vector<Override> bf16_only = {{"memory.stagehand.selective_precision.mode", "off"}};
  std::vector<Override> sublayer_bf16 = bf16_only;
  sublayer_bf16.push_back({"model.streaming_unit", "sublayer"});
  const RunSummary blocks = train("blocks", bf16_only);
  const RunSummary halves = train("halves", sublayer_bf16);
  ASSERT_EQ(halves.steps.size(), blocks.steps.size());
  for (std::size_t s = 0; s < blocks.steps.size(); ++s) {
    EXPECT_NEAR(halves.steps[s].loss, blocks.steps[s].loss, 1e-5 * blocks.steps[s].loss) << "step " << s;
    EXPECT_EQ(halves.steps[s].routes.size(), 8u);
  }
  EXPECT_EQ(halves.json["model"]["streaming_unit"], "sublayer");

  const std::vector<Override> mlp_nf4 = {{"model.streaming_unit", "sublayer"},
                                         {"memory.stagehand.selective_precision.mode", "static"},
                                         {"memory.stagehand.selective_precision.force_nf4_blocks", "[1, 3, 5, 7]"}};
  const RunSummary run = train("mlp-nf4", mlp_nf4);
  const std::vector<std::uint8_t> expected = {0, 2, 0, 2, 0, 2, 0, 2};
  EXPECT_EQ(run.steps.back().routes, expected);
  EXPECT_EQ(run.json["block_steps"]["nf4"], 24u * 4u);  // forced from the first step
  EXPECT_EQ(run.json["block_steps"]["bf16"], 24u * 4u);
  EXPECT_LT(mean_loss(run.steps, 19, 24), mean_loss(run.steps, 0, 5) - 0.3);
  const double saved = run.json["h2d_bytes"]["saved_fraction"];
  // At mlp_ratio 2 the MLP half holds half a block's weights (fc + proj: 4c^2, as qkv + proj):
  // NF4 on it saves about half of NF4's 72%.
  EXPECT_GT(saved, 0.3);
  EXPECT_LT(saved, 0.5);
}

// train.recalibrate_every: the errors are measured again on the trained weights, reported on
// the steps that did it, and a run interrupted between re-calibrations resumes bitwise.
TEST_F(TrainE2E, OnlineRecalibrationFollowsTheWeightsAndResumesBitwise) {
  const std::vector<Override> every4 = {{"train.recalibrate_every", "4"}};
  const RunSummary straight = train("recal", every4);
  std::vector<double> first_int8;
  for (const StepRecord& r : straight.steps) {
    ASSERT_EQ(r.recalibration.has_value(), (r.step + 1) % 4 == 0) << "step " << r.step;
    if (!r.recalibration) continue;
    const std::vector<double> int8 = (*r.recalibration)["int8"].get<std::vector<double>>();
    ASSERT_EQ(int8.size(), 4u);
    if (first_int8.empty()) first_int8 = int8;
  }
  const std::vector<double> last_int8 = straight.json["calibration"]["errors"].get<std::vector<double>>();
  EXPECT_NE(last_int8, first_int8) << "the errors follow the trained weights";
  EXPECT_EQ(straight.json["calibration"]["status"], "re-calibrated at step 23");

  std::atomic<bool> stop{false};
  train(
      "recal-resumed", every4, [&](const StepRecord& r) { stop = r.step == 9; }, &stop);
  Trainer resumed(config(every4), options("recal-resumed"));
  const RunSummary second_half = resumed.run();
  ASSERT_EQ(second_half.steps.size(), 14u);
  for (std::size_t i = 0; i < second_half.steps.size(); ++i) {
    const StepRecord& a = straight.steps[10 + i];
    const StepRecord& b = second_half.steps[i];
    EXPECT_EQ(std::memcmp(&a.loss, &b.loss, sizeof a.loss), 0) << "step " << a.step;
    EXPECT_EQ(a.decisions, b.decisions) << "step " << a.step;
  }
  EXPECT_EQ(straight.json["calibration"]["errors"], second_half.json["calibration"]["errors"]);
}

// The live upgrade: a run that started on policy 1.0.0 moves to the shipped plugin (4.0.0) at a
// step boundary, its state migrated through export/import; with a v1 config, it takes 1.0.0's
// decisions.
TEST_F(TrainE2E, HotSwapMidRunKeepsTheDecisions) {
  const fs::path plugin = plugin_dir_ / "libsp_selective_precision.so";
  fs::copy_file(SP_PLUGIN_V1_FILE, plugin, fs::copy_options::overwrite_existing);
  const RunSummary reference = train("noswap");
  const RunSummary swapped = train("swap", {}, [&](const StepRecord& r) {
    if (r.step != 9) return;
    // A new version lands the way a deployment would put it there: written aside, renamed in.
    fs::copy_file(SP_PLUGIN_FILE, plugin_dir_ / "incoming.so");
    fs::rename(plugin_dir_ / "incoming.so", plugin);
  });
  ASSERT_EQ(swapped.steps.size(), reference.steps.size());
  for (std::size_t s = 0; s < reference.steps.size(); ++s) {
    EXPECT_EQ(reference.steps[s].decisions, swapped.steps[s].decisions) << "step " << s;
    EXPECT_EQ(reference.steps[s].plugin_version, "1.0.0");
    EXPECT_EQ(swapped.steps[s].plugin_version, s < 10 ? "1.0.0" : "4.0.0") << "step " << s;
  }
  EXPECT_EQ(swapped.steps[10].swap_note, "swapped 1.0.0 -> 4.0.0");
  ASSERT_EQ(swapped.json["plugin_swaps"].size(), 1u);
  EXPECT_EQ(swapped.json["plugin_swaps"][0]["step"], 10);
}

TEST_F(TrainE2E, CorruptCalibrationCacheIsDetectedAndRebuilt) {
  const TrainConfig c = config({{"train.steps", "1"}});
  CalibrationErrors measured;
  {
    Trainer first(c, options("cal1"));
    EXPECT_EQ(first.calibration_status(), "computed (missing)");
    measured = first.calibration_errors();
  }
  ASSERT_EQ(measured[sp::Precision::int8].size(), 4u);
  ASSERT_EQ(measured[sp::Precision::nf4].size(), 4u);
  for (std::size_t b = 0; b < 4; ++b) {
    EXPECT_GT(measured[sp::Precision::int8][b], 0.0);
    EXPECT_LT(measured[sp::Precision::int8][b], 0.5);
    // Four bits per weight cost more output error than eight, block by block.
    EXPECT_GT(measured[sp::Precision::nf4][b], measured[sp::Precision::int8][b]) << "block " << b;
    EXPECT_LT(measured[sp::Precision::nf4][b], 1.0);
  }
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(cache_)) files.push_back(entry.path());
  ASSERT_EQ(files.size(), 1u);
  {
    Trainer second(c, options("cal2"));
    EXPECT_EQ(second.calibration_status(), "hit");
    EXPECT_EQ(second.calibration_errors()[sp::Precision::int8], measured[sp::Precision::int8]);
    EXPECT_EQ(second.calibration_errors()[sp::Precision::nf4], measured[sp::Precision::nf4]);
  }
  // Truncate the file in the middle of its JSON.
  const auto size = fs::file_size(files[0]);
  fs::resize_file(files[0], size / 2);
  {
    Trainer third(c, options("cal3"));
    EXPECT_EQ(third.calibration_status(), "computed (corrupt)");
    EXPECT_EQ(third.calibration_errors()[sp::Precision::int8], measured[sp::Precision::int8]);
    EXPECT_EQ(third.calibration_errors()[sp::Precision::nf4], measured[sp::Precision::nf4]);
  }
  EXPECT_EQ(read_calibration_cache(files[0], files[0].stem().string().substr(12), 4).status, CacheStatus::hit);
}

// Calibration bytes are reported apart from the evaluation's, so a cache hit and a miss report
// the same evaluation bytes.
TEST_F(TrainE2E, CalibrationBytesAreReportedApartFromEvaluation) {
  const std::vector<Override> two_steps = {{"train.steps", "2"}, {"train.eval_interval", "1"}};
  const RunSummary miss = train("miss", two_steps);
  const RunSummary hit = train("hit", two_steps);
  EXPECT_EQ(miss.json["calibration"]["status"], "computed (missing)");
  EXPECT_EQ(hit.json["calibration"]["status"], "hit");
  EXPECT_EQ(miss.json["eval_h2d_bytes"], hit.json["eval_h2d_bytes"]);
  EXPECT_GT(miss.json["eval_h2d_bytes"].get<std::uint64_t>(), 0u);
  EXPECT_GT(miss.json["calibration_h2d_bytes"].get<std::uint64_t>(), 0u);
  EXPECT_EQ(hit.json["calibration_h2d_bytes"], 0u);
}

// A model far larger than this machine's memory is refused by name before anything is
// allocated, not left to the OOM killer.
TEST_F(TrainE2E, AModelFarLargerThanMemoryIsRefusedBeforeAllocation) {
  try {
    Trainer trainer(config({{"model.d_model", "8192"}, {"model.n_heads", "64"}, {"model.n_blocks", "48"}}),
                    options("huge"));
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("model.d_model 8192 x model.n_blocks 48"), std::string::npos) << what;
    EXPECT_NE(what.find("GiB of host memory"), std::string::npos) << what;
    EXPECT_NE(what.find("MemAvailable"), std::string::npos) << what;
  }
  // The estimate of the tiny model fits, and is reported beside the measured peak.
  const RunSummary run = train("tiny", {{"train.steps", "1"}});
  EXPECT_GT(run.json["resident_before_model_bytes"].get<std::uint64_t>(), 0u);
  EXPECT_GT(run.json["estimated_host_bytes"].get<std::uint64_t>(),
            run.json["resident_before_model_bytes"].get<std::uint64_t>());
  EXPECT_GT(run.json["peak_rss_bytes"].get<std::uint64_t>(), 0u);
}

// Temporary files that killed checkpoint writes left behind are removed when the next run
// takes the directory.
TEST_F(TrainE2E, StaleTemporariesOfKilledWritesAreRemovedAtStart) {
  const fs::path run = dir_ / "stale";
  fs::create_directories(run);
  const fs::path stale = run / ".checkpoint.bin.tmp-Ab12Cd";
  const fs::path stale_shard = run / ".checkpoint.shard-step40.bin.tmp-Zz99Yy";  // a sharded rank's
  const fs::path unrelated = run / ".notes.tmp-Ab12Cd";
  testing::write_text(stale, "half a checkpoint");
  testing::write_text(stale_shard, "half a shard");
  testing::write_text(unrelated, "not ours");
  train("stale", {{"train.steps", "1"}});
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_FALSE(fs::exists(stale_shard));
  EXPECT_TRUE(fs::exists(unrelated));
}

// A crash marker left by the run before (crash_marker_test.cpp makes real ones) is reported in
// the log and the summary, and removed.
TEST_F(TrainE2E, ACrashMarkerOfThePreviousRunIsReportedAndRemoved) {
  const fs::path run = dir_ / "crashed";
  fs::create_directories(run);
  const std::string text =
      "sp-train died of SIGSEGV inside policy plugin some_plugin 1.2.3 in compute_hints at step 4";
  testing::write_text(run / kCrashMarkerFile, text + "\n");
  const RunSummary summary = train("crashed", {{"train.steps", "1"}});
  EXPECT_EQ(summary.json["previous_crash"], text);
  EXPECT_FALSE(fs::exists(run / kCrashMarkerFile));
  EXPECT_TRUE(train("crashed", {{"train.steps", "2"}}).json["previous_crash"].is_null());
}

TEST_F(TrainE2E, LoraTrainsAdaptersOverFrozenStreamedWeights) {
  const RunSummary run = train("lora", {{"train.mode", "lora"}, {"train.lora.rank", "4"}});
  ASSERT_EQ(run.steps.size(), 24u);
  EXPECT_LT(mean_loss(run.steps, 19, 24), mean_loss(run.steps, 0, 5) - 0.3);
  EXPECT_EQ(run.json["mode"], "lora");
  std::size_t int8_steps = 0;
  for (const StepRecord& r : run.steps) int8_steps += r.h2d_bytes[sp::Precision::int8] != 0;
  EXPECT_GT(int8_steps, 0u);
}

TEST_F(TrainE2E, LoraStartsFromTheWeightsOfAFullModeRun) {
  const RunSummary base = train("base");
  const std::string base_checkpoint = checkpoint_path(dir_ / "base").string();
  const RunSummary lora = train("lora-on-base", {{"train.mode", "lora"}, {"train.init_checkpoint", base_checkpoint}});
  // Adapters start at B = 0: the first LoRA step computes with the trained base.
  EXPECT_LT(lora.steps[0].loss, mean_loss(base.steps, 19, 24) + 0.1);
  EXPECT_LT(lora.steps[0].loss, base.steps[0].loss - 1.0);
  try {
    Trainer other(config({{"model.mlp_ratio", "3"}, {"train.init_checkpoint", base_checkpoint}}), options("other"));
    FAIL() << "expected a ResumeError";
  } catch (const ResumeError& e) {
    EXPECT_NE(std::string(e.what()).find("made for model.mlp_ratio = 2, this config has 3"), std::string::npos)
        << e.what();
  }
}

// train.adam_moments: bf16 moments (stochastically rounded) still learn, resume bitwise, and a
// checkpoint resumes only with the moment storage it was written with.
TEST_F(TrainE2E, Bf16MomentsLearnResumeBitwiseAndAreCheckedOnResume) {
  const std::vector<Override> bf16 = {{"train.adam_moments", "bf16_stochastic"}};
  const RunSummary straight = train("bf16-straight", bf16);
  EXPECT_LT(mean_loss(straight.steps, 19, 24), mean_loss(straight.steps, 0, 5) - 0.3);
  EXPECT_EQ(straight.json["adam_moments"], "bf16_stochastic");
  std::atomic<bool> stop{false};
  train(
      "bf16-resumed", bf16, [&](const StepRecord& r) { stop = r.step == 9; }, &stop);
  Trainer resumed(config(bf16), options("bf16-resumed"));
  const RunSummary second_half = resumed.run();
  ASSERT_EQ(second_half.steps.size(), 14u);
  for (std::size_t i = 0; i < second_half.steps.size(); ++i) {
    EXPECT_EQ(std::memcmp(&straight.steps[10 + i].loss, &second_half.steps[i].loss, sizeof(double)), 0)
        << "step " << second_half.steps[i].step;
  }
  stop = false;
  train("bf16-other", bf16, [&](const StepRecord& r) { stop = r.step == 3; }, &stop);
  try {
    Trainer fp32(config({}), options("bf16-other"));
    FAIL() << "expected a ResumeError";
  } catch (const ResumeError& e) {
    EXPECT_NE(std::string(e.what()).find("adam_moments bf16_stochastic"), std::string::npos) << e.what();
  }
}

TEST_F(TrainE2E, CheckpointOfAnotherModelIsRefusedByName) {
  train("shape", {{"train.steps", "2"}});
  try {
    Trainer other(config({{"model.n_blocks", "3"}}), options("shape"));
    FAIL() << "expected a ResumeError";
  } catch (const ResumeError& e) {
    EXPECT_NE(std::string(e.what()).find("n_blocks"), std::string::npos) << e.what();
  }
}

// Checkpoints are checksummed, so these edits stand for a writer with a bug, not a bad disk:
// each field the resume trusts is range-checked and named.
TEST_F(TrainE2E, ACheckpointWithOutOfRangeFieldsIsRefusedByName) {
  train("edited", {{"train.steps", "2"}});
  const fs::path file = checkpoint_path(dir_ / "edited");
  const CheckpointSections original = CheckpointSections::read(file);
  const Bytes& meta_bytes = original.get("meta");
  const nlohmann::json meta = nlohmann::json::parse(meta_bytes.begin(), meta_bytes.end());
  const auto resume_error = [&](const std::string& section, const std::string& text, std::vector<Override> overrides) {
    CheckpointSections edited = original;
    edited.put(section, text.data(), text.size());
    edited.write_atomically(file);
    try {
      Trainer resumed(config(std::move(overrides)), options("edited"));
    } catch (const ResumeError& e) {
      return std::string(e.what());
    }
    return std::string("resumed");
  };
  nlohmann::json edited = meta;
  edited["next_step"] = -5;
  EXPECT_NE(resume_error("meta", edited.dump(), {}).find("next_step in [0, "), std::string::npos);
  edited = meta;
  edited["calibration_errors"] = {0.1};
  EXPECT_NE(resume_error("meta", edited.dump(), {}).find("calibration_errors holds 1 values"), std::string::npos);
  EXPECT_NE(resume_error("rng/torch", "not a generator", {}).find("section 'rng/torch' (15 bytes)"), std::string::npos);
  EXPECT_NE(resume_error("meta", meta.dump(), {{"train.mode", "lora"}}).find("made for mode = \"full\""),
            std::string::npos);
  const std::int64_t negative_steps = -1;
  EXPECT_NE(
      resume_error("adam/steps", std::string(reinterpret_cast<const char*>(&negative_steps), sizeof negative_steps), {})
          .find("'adam/steps' holds -1"),
      std::string::npos);
  edited = meta;
  edited.erase("model");
  EXPECT_NE(resume_error("meta", edited.dump(), {}).find("and a model object"), std::string::npos);
  // A meta from before versions (1), without the keys its release did not write, resumes;
  // one from a newer sp-train is refused by its version.
  ASSERT_EQ(meta.at("version"), kCheckpointMetaVersion);
  edited = meta;
  edited.erase("version");
  for (const char* key : {"world_size", "adam_moments", "data_parallel", "nf4_calibration_errors"}) edited.erase(key);
  edited["model"].erase("streaming_unit");
  for (const char* key : {"h2d_nf4", "nf4_block_steps", "calibration_h2d", "update_seconds"}) edited["totals"].erase(key);
  EXPECT_EQ(resume_error("meta", edited.dump(), {}), "resumed");
  edited = meta;
  edited["version"] = kCheckpointMetaVersion + 1;
  EXPECT_NE(resume_error("meta", edited.dump(), {}).find("written by a newer sp-train"), std::string::npos);
  // The plugin's state and the routes in force are the checkpoint's too: a state the plugin
  // rejects and a hint the bridge refuses stop the resume (exit code 4), naming the section.
  EXPECT_NE(resume_error("policy/state", "not a policy state", {}).find("rejected the checkpoint's policy state"),
            std::string::npos);
  std::vector<sp_hint_v1> hints(4);
  for (std::uint32_t b = 0; b < 4; ++b) hints[b] = sp_hint_v1{b, SP_PRECISION_BF16, 0.0f, SP_REASON_MODE, 0};
  hints[2].precision = 7;
  EXPECT_NE(
      resume_error("policy/hints", std::string(reinterpret_cast<const char*>(hints.data()), 4 * sizeof(sp_hint_v1)), {})
          .find("section 'policy/hints': hints[2].precision is 7; expected SP_PRECISION_BF16 (0)"),
      std::string::npos);
  EXPECT_NE(
      resume_error("policy/hints", "abc", {}).find("section 'policy/hints' holds 3 bytes; expected none or 4 hints"),
      std::string::npos);
  // The same checks guard a checkpoint named as initial weights, and a checkpoint without meta.
  const fs::path other = dir_ / "init.bin";
  CheckpointSections no_meta;
  no_meta.put("master/none", "x", 1);
  no_meta.write_atomically(other);
  try {
    Trainer from(config({{"train.init_checkpoint", other.string()}}), options("from-init"));
    ADD_FAILURE() << "expected a ResumeError";
  } catch (const ResumeError& e) {
    EXPECT_NE(std::string(e.what()).find("section 'meta' is missing"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace sp::train

namespace sp::train {
namespace {

// The benchmark-driven transfer policy through a real training run: where it says INT8 does
// not pay for a block's size, the block stays BF16 even though the plugin chose INT8.
class TrainWithTransferPolicy : public TrainE2E {
 protected:
  fs::path write_policy(const std::string& name, const std::string& trained_rules) const {
    const fs::path file = dir_ / name;
    testing::write_text(file, R"({"format": "sp-transfer-policy", "version": 1, "speedup_threshold": 1.0,
      "sources": [{"machine": "fixture", "backend": "host", "device": "fixed report"}],
      "rules": {"int8_frozen": [], "int8_trained": )" +
                                  trained_rules + "}}");
    return file;
  }
};

TEST_F(TrainWithTransferPolicy, BlocksStayBf16WhereInt8DoesNotPay) {
  const fs::path never = write_policy("never.json", "[]");
  const RunSummary run = train("gated", {{"memory.stagehand.streaming.transfer_policy_path", never.string()}});
  bool plugin_chose_int8 = false;
  for (const StepRecord& r : run.steps) {
    plugin_chose_int8 = plugin_chose_int8 || std::count(r.decisions.begin(), r.decisions.end(), 1) > 0;
    EXPECT_EQ(std::count(r.routes.begin(), r.routes.end(), 1), 0) << "step " << r.step;
    EXPECT_EQ(r.h2d_bytes[sp::Precision::int8], 0u) << "step " << r.step;
  }
  EXPECT_TRUE(plugin_chose_int8) << "the plugin must want INT8 somewhere for the gate to matter";
  // Calibration measures each route as it is, whatever the gate lets through (this run is the
  // first with this cache, so it measured them, with the gate already set).
  const nlohmann::json& calibration = run.json["calibration"];
  ASSERT_EQ(calibration["errors"].size(), 4u);
  for (std::size_t b = 0; b < 4; ++b) {
    EXPECT_GT(calibration["errors"][b].get<double>(), 0.0) << "block " << b;
    EXPECT_GT(calibration["nf4_errors"][b].get<double>(), calibration["errors"][b].get<double>()) << "block " << b;
  }
}

TEST_F(TrainWithTransferPolicy, WhereInt8PaysThePluginDecides) {
  const fs::path always =
      write_policy("always.json", R"([{"min_bytes": 0, "max_bytes": null, "measured_speedup": 1.5}])");
  const RunSummary gated = train("always", {{"memory.stagehand.streaming.transfer_policy_path", always.string()}});
  const RunSummary plain = train("plain");
  ASSERT_EQ(gated.steps.size(), plain.steps.size());
  for (std::size_t s = 0; s < plain.steps.size(); ++s) {
    EXPECT_EQ(gated.steps[s].routes, plain.steps[s].routes) << "step " << s;
    EXPECT_EQ(gated.steps[s].h2d_bytes[sp::Precision::int8], plain.steps[s].h2d_bytes[sp::Precision::int8]) << "step " << s;
  }
}

TEST_F(TrainWithTransferPolicy, AnUnreadablePolicyFileMeansBf16AndTrainingGoesOn) {
  const RunSummary run =
      train("missing", {{"memory.stagehand.streaming.transfer_policy_path", (dir_ / "nope.json").string()}});
  ASSERT_EQ(run.steps.size(), 24u);
  for (const StepRecord& r : run.steps) EXPECT_EQ(r.h2d_bytes[sp::Precision::int8], 0u) << "step " << r.step;
}

// The reported bug: calibration forced its routes through plugin hints, which the transfer gate
// filters, so under a gate where nothing pays every block was "calibrated" BF16 against BF16:
// errors of 0.0000 in the log, the checkpoint and the cache, under the fingerprint of a run
// without a gate. Here the gate is in force before calibration runs, in both modes (frozen and
// trained blocks have their own rules; none pays), and every error must be a real one.
TEST_F(TrainWithTransferPolicy, CalibrationUnderAGateWhereNothingPaysMeasuresEveryRoute) {
  const fs::path never = write_policy("never.json", "[]");
  const auto between = [](const std::string& text, const std::string& from) {
    const std::size_t start = text.find(from);
    if (start == std::string::npos) return std::string();
    return text.substr(start + from.size(), text.find('\n', start) - start - from.size());
  };
  for (const char* mode : {"full", "lora"}) {
    SCOPED_TRACE(mode);
    const std::vector<Override> base = {{"train.steps", "2"}, {"train.mode", mode}};
    std::vector<Override> gated = base;
    gated.push_back({"memory.stagehand.streaming.transfer_policy_path", never.string()});
    auto log = std::make_shared<std::ostringstream>();
    RunOptions o = options(std::string("gated-") + mode);
    o.logger = std::make_shared<spdlog::logger>("gated", std::make_shared<spdlog::sinks::ostream_sink_mt>(*log));
    CalibrationErrors measured;
    {
      Trainer trainer(config(gated), o);
      EXPECT_EQ(trainer.calibration_status(), "computed (missing)");
      measured = trainer.calibration_errors();
      trainer.run();
    }
    o.logger->flush();
    const std::string text = log->str();
    // The gate was in force when calibration ran, and let nothing through on any route ("INT8
    // pays for 0, NF4 pays for 0 of 4 blocks").
    const std::size_t gate_line = text.find(" pays for 0 of 4 blocks");
    for (const sp::Precision route : sp::kQuantizedPrecisions) {
      EXPECT_NE(text.find(std::string(sp::route_traits(route).label) + " pays for 0"), std::string::npos) << text;
    }
    const std::size_t calibration_line = text.find("calibration: INT8 relative output error per block: ");
    ASSERT_NE(gate_line, std::string::npos) << text;
    ASSERT_NE(calibration_line, std::string::npos) << text;
    EXPECT_LT(gate_line, calibration_line) << "the gate must be set before calibration for this test to mean anything";

    // What the checkpoint keeps for a resume.
    const CheckpointSections checkpoint = CheckpointSections::read(checkpoint_path(o.out_dir));
    const Bytes& meta_bytes = checkpoint.get("meta");
    const nlohmann::json meta = nlohmann::json::parse(meta_bytes.begin(), meta_bytes.end());
    const std::vector<double> int8 = meta.at("calibration_errors").get<std::vector<double>>();
    const std::vector<double> nf4 = meta.at("nf4_calibration_errors").get<std::vector<double>>();
    ASSERT_EQ(int8.size(), 4u);
    ASSERT_EQ(nf4.size(), 4u);
    EXPECT_EQ(int8, measured[sp::Precision::int8]);
    EXPECT_EQ(nf4, measured[sp::Precision::nf4]);
    for (std::size_t b = 0; b < 4; ++b) {
      EXPECT_GT(int8[b], 1e-4) << "block " << b;
      EXPECT_GT(nf4[b], int8[b]) << "block " << b;
    }
    // What the log says, as printed (four decimals).
    for (const char* route : {"INT8", "NF4"}) {
      std::istringstream listing(
          between(text, fmt::format("calibration: {} relative output error per block: ", route)));
      std::vector<std::string> printed{std::istream_iterator<std::string>(listing), {}};
      ASSERT_EQ(printed.size(), 4u) << route << ": " << text;
      for (const std::string& value : printed) EXPECT_NE(value, "0.0000") << route;
    }
    // The gate cannot change the errors, so a run without it shares the cached ones.
    Trainer plain(config(base), options(std::string("plain-") + mode));
    EXPECT_EQ(plain.calibration_status(), "hit");
    EXPECT_EQ(plain.calibration_errors()[sp::Precision::int8], measured[sp::Precision::int8]);
    EXPECT_EQ(plain.calibration_errors()[sp::Precision::nf4], measured[sp::Precision::nf4]);
  }
}

// The GPU's bf16 path, run on the host: a config file cannot ask for bf16 on the CPU (slow
// there, and not the design), but the trainer's library API can. Then everything the GPU run
// depends on besides CUDA runs here: compute weights that alias the slots (gpt_model_test),
// resident compute copies refreshed after each update, gradients returned to fp32 masters.
TEST_F(TrainE2E, Bf16ComputeOnTheHostLearnsAndMovesWhatItDecided) {
  TrainConfig c = config();
  c.train.compute_dtype = ComputeDtype::bf16;
  Trainer trainer(c, options("bf16-on-host"));
  const RunSummary run = trainer.run();
  ASSERT_EQ(run.steps.size(), 24u);
  EXPECT_EQ(run.json["compute_dtype"], "bf16");
  EXPECT_LT(mean_loss(run.steps, 19, 24), mean_loss(run.steps, 0, 5) - 0.3);
  expect_bytes_follow_decisions(run, c);
}

// train.device: cuda. Where no GPU is usable (no CUDA in this build or in LibTorch, or no
// device), it is refused at startup by name; on a GPU machine the same trainer computes there.
class TrainOnCuda : public TrainE2E {
 protected:
  // Why this machine cannot train on CUDA, or nothing when it can.
  std::optional<std::string> refusal() {
    try {
      Trainer probe(config({{"train.device", "cuda"}}), options("probe"));
      return std::nullopt;
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
  }
};

TEST_F(TrainOnCuda, IsRefusedByNameWhereNoGpuIsUsable) {
  const std::optional<std::string> why = refusal();
  if (!why) GTEST_SKIP() << "a CUDA device is usable here";
  EXPECT_EQ(why->rfind("tiny.yaml: train.device: cuda, but ", 0), 0u) << *why;
  EXPECT_NE(why->find("use train.device: cpu"), std::string::npos) << *why;
  EXPECT_FALSE(fs::exists(dir_ / "probe" / "checkpoint.bin"));
}

// fp32 on the GPU is the CPU run's math over the same delivered bf16 weights, in another
// summation order: the losses agree closely, and the bytes still follow the decisions.
TEST_F(TrainOnCuda, Fp32TracksTheCpuRun) {
  const std::optional<std::string> why = refusal();
  SP_SKIP_UNLESS_GPU(!why, why.value_or(""));
  const RunSummary gpu = train("gpu-fp32", {{"train.device", "cuda"}});
  const RunSummary cpu = train("cpu-fp32");
  ASSERT_EQ(gpu.steps.size(), cpu.steps.size());
  EXPECT_EQ(gpu.json["device"], "cuda");
  EXPECT_NEAR(gpu.steps[0].loss, cpu.steps[0].loss, 1e-4 * cpu.steps[0].loss);
  const double gpu_val = gpu.json["final_val_loss"], cpu_val = cpu.json["final_val_loss"];
  EXPECT_NEAR(gpu_val, cpu_val, 0.02 * cpu_val);
  expect_bytes_follow_decisions(gpu, config());
}

// bf16 compute reads the slots in place; the run still learns and moves what it decided.
TEST_F(TrainOnCuda, Bf16ComputeLearnsFromTheSlotsInPlace) {
  const std::optional<std::string> why = refusal();
  SP_SKIP_UNLESS_GPU(!why, why.value_or(""));
  const RunSummary run = train("gpu-bf16", {{"train.device", "cuda"}, {"train.compute_dtype", "bf16"}});
  ASSERT_EQ(run.steps.size(), 24u);
  EXPECT_LT(mean_loss(run.steps, 19, 24), mean_loss(run.steps, 0, 5) - 0.3);
  EXPECT_EQ(run.json["compute_dtype"], "bf16");
  expect_bytes_follow_decisions(run, config());
}

}  // namespace
}  // namespace sp::train
