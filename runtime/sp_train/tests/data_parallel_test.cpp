// sp-train as N processes on c10d (Gloo over the loopback), started as torchrun would start
// them: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in each one's environment.
#include <signal.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "process_support.h"
#include "train_test_support.h"

namespace {

namespace fs = std::filesystem;
namespace t = sp::train::testing;

std::vector<nlohmann::json> records(const fs::path& file) {
  std::vector<nlohmann::json> out;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::string text_of(const fs::path& file) {
  std::ifstream in(file);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

class DataParallel : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = t::make_scratch_dir("dp");
    corpus_ = t::write_corpus(dir_);
    config_ = dir_ / "tiny.yaml";
    t::write_text(config_, t::tiny_config(corpus_, dir_ / "cache"));
    port_ = t::free_port();
    ASSERT_GT(port_, 0);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::vector<std::string> args(const fs::path& out, std::vector<std::string> extra) const {
    std::vector<std::string> a{"--config", config_.string(), "--out", out.string(),
                               "--set",    "train.collective_timeout_seconds=20",
                               "--set",    "train.checkpoint_timeout_seconds=20"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  pid_t spawn_rank(int rank, int world, const fs::path& out, const std::vector<std::string>& extra) const {
    return t::spawn_sp_train(args(out, extra), dir_ / ("rank" + std::to_string(rank) + ".log"),
                             {{"RANK", std::to_string(rank)},
                              {"WORLD_SIZE", std::to_string(world)},
                              {"MASTER_ADDR", "127.0.0.1"},
                              {"MASTER_PORT", std::to_string(port_)}});
  }
  // Both ranks to the end; their exit codes.
  std::vector<int> run_two_ranks(const fs::path& out, const std::vector<std::string>& extra) const {
    const pid_t r0 = spawn_rank(0, 2, out, extra), r1 = spawn_rank(1, 2, out, extra);
    return {t::wait_exit_code(r0), t::wait_exit_code(r1)};
  }
  std::string log_of(int rank) const { return text_of(dir_ / ("rank" + std::to_string(rank) + ".log")); }

  fs::path dir_, corpus_, config_;
  int port_ = 0;
};

// Every step's decisions agree on both ranks, and two ranks of batch 4 train as one process
// with batch 8: the same rows, the gradients averaged, the same decisions, the losses equal to
// rounding (the sums run in another order).
TEST_F(DataParallel, TwoRanksDecideAlikeAndTrainAsOneRankWithTheDoubleBatch) {
  const fs::path two = dir_ / "two", one = dir_ / "one";
  ASSERT_EQ(run_two_ranks(two, {"--set", "train.batch_size=4"}), (std::vector<int>{0, 0})) << log_of(0) << log_of(1);
  const pid_t single = t::spawn_sp_train(args(one, {"--set", "train.batch_size=8"}), dir_ / "one.log");
  ASSERT_EQ(t::wait_exit_code(single), 0) << text_of(dir_ / "one.log");

  const auto rank0 = records(two / "train_metrics.jsonl"), rank1 = records(two / "rank1" / "train_metrics.jsonl");
  const auto alone = records(one / "train_metrics.jsonl");
  ASSERT_EQ(rank0.size(), 24u);
  ASSERT_EQ(rank1.size(), 24u);
  ASSERT_EQ(alone.size(), 24u);
  std::size_t quantized_steps = 0;
  for (std::size_t s = 0; s < alone.size(); ++s) {
    EXPECT_EQ(rank0[s]["decisions"], rank1[s]["decisions"]) << "step " << s;
    EXPECT_EQ(rank0[s]["routes"], rank1[s]["routes"]) << "step " << s;
    EXPECT_EQ(rank0[s]["loss"], rank1[s]["loss"]) << "step " << s << ": every rank records the mean";
    EXPECT_EQ(rank0[s]["decisions"], alone[s]["decisions"]) << "step " << s;
    const double two_ranks = rank0[s]["loss"], one_rank = alone[s]["loss"];
    EXPECT_NEAR(two_ranks, one_rank, 1e-4 * one_rank) << "step " << s;
    quantized_steps += rank0[s]["h2d_bytes_int8"].get<std::uint64_t>() != 0;
  }
  EXPECT_GT(quantized_steps, 0u) << "the decisions compared never left BF16";
  const auto summary0 = nlohmann::json::parse(text_of(two / "summary.json"));
  const auto summary_alone = nlohmann::json::parse(text_of(one / "summary.json"));
  EXPECT_EQ(summary0["data_parallel"]["world_size"], 2);
  EXPECT_EQ(summary0["data_parallel"]["gradients_reduced_on"], "cpu");
  const double val_two = summary0["final_val_loss"], val_one = summary_alone["final_val_loss"];
  EXPECT_NEAR(val_two, val_one, 1e-4 * val_one) << "validation is split across the ranks the same way";
  EXPECT_TRUE(fs::exists(two / "checkpoint.bin"));
  EXPECT_FALSE(fs::exists(two / "rank1" / "checkpoint.bin")) << "rank 0 alone writes the replicated state";

  // The checkpoint holds the world size: a resume on another one is refused by name.
  const pid_t other = t::spawn_sp_train(args(two, {"--set", "train.steps=30"}), dir_ / "resume.log");
  EXPECT_EQ(t::wait_exit_code(other), 4);
  EXPECT_NE(text_of(dir_ / "resume.log").find("made with 2 data-parallel rank(s), this run has 1"), std::string::npos)
      << text_of(dir_ / "resume.log");
}

// Sharded masters (each rank keeps, reduces and updates the masters of every other block and
// sends their images): the same arithmetic as the replicated run (a two-way sum is exact in
// either order, the moments are the owner's), so the same losses, gradient norms and decisions
// bit for bit; each rank's checkpoint shard beside the main file, and less host memory
// estimated per rank.
TEST_F(DataParallel, ShardedMastersTrainExactlyAsReplicatedOnes) {
  const fs::path replicated = dir_ / "replicated", sharded = dir_ / "sharded";
  ASSERT_EQ(run_two_ranks(replicated, {"--set", "train.batch_size=4"}), (std::vector<int>{0, 0}))
      << log_of(0) << log_of(1);
  for (const char* optimizer : {"fused", "overlapped"}) {
    SCOPED_TRACE(optimizer);
    fs::remove_all(sharded);
    ASSERT_EQ(run_two_ranks(sharded, {"--set", "train.batch_size=4", "--set", "train.data_parallel=sharded", "--set",
                                      std::string("train.host_optimizer=") + optimizer}),
              (std::vector<int>{0, 0}))
        << log_of(0) << log_of(1);
    if (std::string(optimizer) == "overlapped") {
      ASSERT_EQ(run_two_ranks(replicated, {"--set", "train.batch_size=4", "--set", "train.resume=never", "--set",
                                           "train.host_optimizer=overlapped"}),
                (std::vector<int>{0, 0}))
          << log_of(0) << log_of(1);
    }
    const auto expected = records(replicated / "train_metrics.jsonl");
    for (const fs::path& run : {sharded, sharded / "rank1"}) {
      const auto got = records(run / "train_metrics.jsonl");
      ASSERT_EQ(got.size(), expected.size()) << run;
      std::size_t quantized_steps = 0;
      for (std::size_t s = 0; s < expected.size(); ++s) {
        EXPECT_EQ(got[s]["loss"], expected[s]["loss"]) << run << " step " << s;
        EXPECT_EQ(got[s]["grad_norm"], expected[s]["grad_norm"]) << run << " step " << s;
        EXPECT_EQ(got[s]["decisions"], expected[s]["decisions"]) << run << " step " << s;
        EXPECT_EQ(got[s]["routes"], expected[s]["routes"]) << run << " step " << s;
        quantized_steps += got[s]["h2d_bytes_int8"].get<std::uint64_t>() != 0;
      }
      EXPECT_GT(quantized_steps, 0u) << "the images shared never left BF16";
    }
    const auto summary = nlohmann::json::parse(text_of(sharded / "summary.json"));
    const auto summary_replicated = nlohmann::json::parse(text_of(replicated / "summary.json"));
    EXPECT_EQ(summary["final_val_loss"], summary_replicated["final_val_loss"]);
    EXPECT_EQ(summary["data_parallel"]["mode"], "sharded");
    // What each estimates beyond what its process held before the model (which varies by run).
    const auto model_estimate = [](const nlohmann::json& s) {
      return s["estimated_host_bytes"].get<std::uint64_t>() - s["resident_before_model_bytes"].get<std::uint64_t>();
    };
    EXPECT_LT(model_estimate(summary), model_estimate(summary_replicated));
    EXPECT_TRUE(fs::exists(sharded / "checkpoint.bin"));
    EXPECT_TRUE(fs::exists(sharded / "checkpoint.shard-step24.bin"));
    EXPECT_TRUE(fs::exists(sharded / "rank1" / "checkpoint.shard-step24.bin"));
  }
}

// A sharded run stopped at step 12 resumes from its checkpoint and its shards with the same
// steps as one that never stopped (a constant learning rate after the warm-up, so that the
// run's length does not change it); the shards of the older checkpoint go once the new one is
// whole. A resume in the other mode, or one whose shard is missing, is refused by name on
// every rank (none waits for the other).
TEST_F(DataParallel, AShardedRunResumesFromItsShardsAndRefusesWhatDoesNotFit) {
  const fs::path whole = dir_ / "whole", resumed = dir_ / "resumed";
  const std::vector<std::string> sharded = {"--set", "train.batch_size=4",         "--set", "train.data_parallel=sharded",
                                            "--set", "train.checkpoint_interval=8", "--set", "train.min_lr_ratio=1"};
  ASSERT_EQ(run_two_ranks(whole, sharded), (std::vector<int>{0, 0})) << log_of(0) << log_of(1);
  std::vector<std::string> first_half = sharded;
  first_half.insert(first_half.end(), {"--set", "train.steps=12"});
  ASSERT_EQ(run_two_ranks(resumed, first_half), (std::vector<int>{0, 0})) << log_of(0) << log_of(1);
  EXPECT_FALSE(fs::exists(resumed / "checkpoint.shard-step8.bin")) << "the step-12 checkpoint replaced it";
  EXPECT_TRUE(fs::exists(resumed / "rank1" / "checkpoint.shard-step12.bin"));
  ASSERT_EQ(run_two_ranks(resumed, sharded), (std::vector<int>{0, 0})) << log_of(0) << log_of(1);
  EXPECT_NE(log_of(1).find("resumed from"), std::string::npos) << log_of(1);
  const auto expected = records(whole / "rank1" / "train_metrics.jsonl");
  const auto got = records(resumed / "rank1" / "train_metrics.jsonl");
  ASSERT_EQ(got.size(), expected.size());
  for (std::size_t s = 0; s < expected.size(); ++s) {
    EXPECT_EQ(got[s]["loss"], expected[s]["loss"]) << "step " << s;
    EXPECT_EQ(got[s]["decisions"], expected[s]["decisions"]) << "step " << s;
  }

  // The other mode: refused, the checkpoint kept.
  std::vector<std::string> longer = {"--set", "train.batch_size=4", "--set", "train.steps=30", "--set",
                                     "train.min_lr_ratio=1"};
  EXPECT_EQ(run_two_ranks(whole, longer), (std::vector<int>{4, 4}));
  for (int rank : {0, 1}) {
    EXPECT_NE(log_of(rank).find("made with its masters sharded, this run keeps them replicated"), std::string::npos)
        << log_of(rank);
  }
  // A shard missing on rank 1: rank 1 names the file, rank 0 names rank 1.
  fs::remove(whole / "rank1" / "checkpoint.shard-step24.bin");
  longer.insert(longer.end(), {"--set", "train.data_parallel=sharded"});
  EXPECT_EQ(run_two_ranks(whole, longer), (std::vector<int>{4, 4}));
  EXPECT_NE(log_of(1).find("rank1/checkpoint.shard-step24.bin: missing"), std::string::npos) << log_of(1);
  EXPECT_NE(log_of(0).find("rank 1 could not read its checkpoint shard"), std::string::npos) << log_of(0);
  EXPECT_TRUE(fs::exists(whole / "checkpoint.bin"));
  EXPECT_TRUE(fs::exists(whole / "checkpoint.shard-step24.bin"));
}

// A checkpoint write that fails on one rank stops every rank by name (exit code 4), not only
// that one: here rank 1's shard, where a directory stands in the way (rank 0 then writes no
// main file naming it). Rank 0's main file goes through the same agreement, in both modes.
TEST_F(DataParallel, ACheckpointWriteThatFailsOnOneRankStopsEveryRankByName) {
  const fs::path sharded = dir_ / "sharded-fail";
  fs::create_directories(sharded / "rank1" / "checkpoint.shard-step24.bin");
  EXPECT_EQ(run_two_ranks(sharded, {"--set", "train.batch_size=4", "--set", "train.data_parallel=sharded"}),
            (std::vector<int>{4, 4}));
  EXPECT_NE(log_of(0).find("rank 1 could not write its shard"), std::string::npos) << log_of(0);
  EXPECT_FALSE(fs::exists(sharded / "checkpoint.bin")) << "no main file names a shard that is not there";
}

// Ranks started with different arguments are refused before anything is built, by name: which
// rank, and the first config line where it parts from rank 0.
TEST_F(DataParallel, RanksWithAnotherConfigAreRefusedUpFront) {
  const fs::path out = dir_ / "mismatch";
  const pid_t r0 = spawn_rank(0, 2, out, {"--set", "train.batch_size=4"});
  const pid_t r1 = spawn_rank(1, 2, out, {"--set", "train.batch_size=8"});
  EXPECT_EQ(t::wait_exit_code(r0), 2) << log_of(0);
  EXPECT_EQ(t::wait_exit_code(r1), 2) << log_of(1);
  EXPECT_NE(log_of(0).find("data parallel: rank(s) 1 run another config, plugin file or resume step than rank 0"),
            std::string::npos)
      << log_of(0);
  EXPECT_NE(log_of(1).find("this rank (1) differs from rank 0 in: config (config line"), std::string::npos) << log_of(1);
  EXPECT_NE(log_of(1).find("rank 0 '  batch_size: 4', this rank '  batch_size: 8'"), std::string::npos) << log_of(1);
  EXPECT_FALSE(fs::exists(out / "train_metrics.jsonl"));
}

// The overlapped update on two ranks: each block is updated on its worker once its all-reduce
// is done, during the backward. Without clipping it trains as the fused update, bit for bit.
TEST_F(DataParallel, OverlappedUpdateOnTwoRanksTrainsAsTheFusedOne) {
  const fs::path fused = dir_ / "fused", overlapped = dir_ / "overlapped";
  const std::vector<std::string> common = {"--set", "train.batch_size=4", "--set", "train.grad_clip=0"};
  ASSERT_EQ(run_two_ranks(fused, common), (std::vector<int>{0, 0})) << log_of(0) << log_of(1);
  port_ = t::free_port();
  std::vector<std::string> overlap = common;
  overlap.insert(overlap.end(), {"--set", "train.host_optimizer=overlapped"});
  ASSERT_EQ(run_two_ranks(overlapped, overlap), (std::vector<int>{0, 0})) << log_of(0) << log_of(1);
  const auto a = records(fused / "train_metrics.jsonl"), b = records(overlapped / "train_metrics.jsonl");
  const auto b1 = records(overlapped / "rank1" / "train_metrics.jsonl");
  ASSERT_EQ(a.size(), 24u);
  ASSERT_EQ(b.size(), 24u);
  for (std::size_t s = 0; s < a.size(); ++s) {
    EXPECT_EQ(a[s]["loss"], b[s]["loss"]) << "step " << s;
    EXPECT_EQ(a[s]["grad_norm"], b[s]["grad_norm"]) << "step " << s;
    EXPECT_EQ(a[s]["decisions"], b[s]["decisions"]) << "step " << s;
    EXPECT_EQ(b[s]["routes"], b1[s]["routes"]) << "step " << s;
  }
}

// A rank killed mid-run: the other stops with exit code 6 and a message naming the failed
// collective, within the collective timeout, not a hang; the checkpoint is intact.
TEST_F(DataParallel, AKilledRankStopsTheOtherByName) {
  const fs::path out = dir_ / "killed";
  const std::vector<std::string> extra = {"--set", "train.steps=100000", "--set", "train.checkpoint_interval=2"};
  const pid_t r0 = spawn_rank(0, 2, out, extra), r1 = spawn_rank(1, 2, out, extra);
  t::wait_for_steps(r1, out / "rank1" / "train_metrics.jsonl", 3);
  if (HasFatalFailure()) {
    ::kill(r0, SIGKILL);
    return;
  }
  ASSERT_EQ(::kill(r1, SIGKILL), 0);
  t::wait_exit_code(r1);
  EXPECT_EQ(t::wait_exit_code(r0), 6) << log_of(0);
  EXPECT_NE(log_of(0).find("rank 0 of 2: the collective"), std::string::npos) << log_of(0);
  // Rank 0 wrote its checkpoints whole (atomically): a single process cannot take them (world
  // size 2), and says so rather than reporting a damaged file.
  const pid_t reader = t::spawn_sp_train(args(out, {}), dir_ / "reader.log");
  EXPECT_EQ(t::wait_exit_code(reader), 4);
  EXPECT_NE(text_of(dir_ / "reader.log").find("made with 2 data-parallel rank(s)"), std::string::npos)
      << text_of(dir_ / "reader.log");
}

// A new plugin version lands mid-run: rank 0 sees it, every rank swaps at the same step
// boundary, and the decisions stay identical across the ranks.
TEST_F(DataParallel, HotSwapHappensOnEveryRankAtTheSameStep) {
  const fs::path plugins = dir_ / "plugins";
  fs::create_directories(plugins);
  fs::copy_file(SP_PLUGIN_V1_FILE, plugins / "libsp_selective_precision.so");
  const fs::path out = dir_ / "swap";
  const std::vector<std::string> extra = {"--plugin-dir", plugins.string(), "--set", "train.steps=40"};
  const pid_t r0 = spawn_rank(0, 2, out, extra), r1 = spawn_rank(1, 2, out, extra);
  t::wait_for_steps(r0, out / "train_metrics.jsonl", 2);
  if (HasFatalFailure()) {
    ::kill(r1, SIGKILL);
    return;
  }
  fs::copy_file(SP_PLUGIN_FILE, plugins / "incoming.so");
  fs::rename(plugins / "incoming.so", plugins / "libsp_selective_precision.so");
  ASSERT_EQ(t::wait_exit_code(r0), 0) << log_of(0);
  ASSERT_EQ(t::wait_exit_code(r1), 0) << log_of(1);
  const auto rank0 = records(out / "train_metrics.jsonl"), rank1 = records(out / "rank1" / "train_metrics.jsonl");
  ASSERT_EQ(rank0.size(), rank1.size());
  int swapped_at = -1;
  for (std::size_t s = 0; s < rank0.size(); ++s) {
    EXPECT_EQ(rank0[s]["plugin_version"], rank1[s]["plugin_version"]) << "step " << s;
    EXPECT_EQ(rank0[s].value("plugin_swap", ""), rank1[s].value("plugin_swap", "")) << "step " << s;
    EXPECT_EQ(rank0[s]["decisions"], rank1[s]["decisions"]) << "step " << s;
    if (rank0[s].value("plugin_swap", "") == "swapped 1.0.0 -> 4.0.0") swapped_at = static_cast<int>(s);
  }
  EXPECT_GE(swapped_at, 2) << "the swap happened on both ranks at one step";
  EXPECT_EQ(rank0.back()["plugin_version"], "4.0.0");
}

// All or nothing: when one rank cannot load the new version, no rank switches. Each rank
// reads its own plugin directory here, so that only rank 1's copy can be broken.
TEST_F(DataParallel, ASwapThatOneRankCannotLoadIsDroppedOnEveryRank) {
  std::vector<fs::path> plugins{dir_ / "plugins0", dir_ / "plugins1"};
  for (const fs::path& p : plugins) {
    fs::create_directories(p);
    fs::copy_file(SP_PLUGIN_V1_FILE, p / "libsp_selective_precision.so");
  }
  const fs::path out = dir_ / "half-swap";
  const auto extra = [&](int rank) {
    return std::vector<std::string>{"--plugin-dir", plugins[rank].string(), "--set", "train.steps=40"};
  };
  const pid_t r0 = spawn_rank(0, 2, out, extra(0)), r1 = spawn_rank(1, 2, out, extra(1));
  t::wait_for_steps(r0, out / "train_metrics.jsonl", 2);
  if (HasFatalFailure()) {
    ::kill(r1, SIGKILL);
    return;
  }
  t::write_text(plugins[1] / "incoming.so", "not a shared library");
  fs::rename(plugins[1] / "incoming.so", plugins[1] / "libsp_selective_precision.so");
  fs::copy_file(SP_PLUGIN_FILE, plugins[0] / "incoming.so");
  fs::rename(plugins[0] / "incoming.so", plugins[0] / "libsp_selective_precision.so");
  ASSERT_EQ(t::wait_exit_code(r0), 0) << log_of(0);
  ASSERT_EQ(t::wait_exit_code(r1), 0) << log_of(1);
  for (const fs::path& run : {out, out / "rank1"}) {
    const auto steps = records(run / "train_metrics.jsonl");
    ASSERT_EQ(steps.size(), 40u);
    for (const auto& r : steps) EXPECT_EQ(r["plugin_version"], "1.0.0") << run;
    const auto summary = nlohmann::json::parse(text_of(run / "summary.json"));
    ASSERT_FALSE(summary["plugin_swaps"].empty()) << run;
    EXPECT_EQ(summary["plugin_swaps"][0]["outcome"], "failed");
    EXPECT_NE(
        summary["plugin_swaps"][0]["message"].get<std::string>().find("rank 1 of 2 could not load the new version"),
        std::string::npos)
        << summary["plugin_swaps"];
  }
}

}  // namespace
