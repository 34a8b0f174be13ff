// The sp-train command line: every bad argument or input gets its own message and exit code.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "sp/runtime/run_command.h"
#include "process_support.h"
#include "train_test_support.h"

namespace {

namespace fs = std::filesystem;

using Result = sp::runtime::CommandResult;
using sp::train::testing::line_count;
using sp::train::testing::spawn_sp_train;
using sp::train::testing::wait_exit_code;
using sp::train::testing::wait_for_steps;

Result run_sp_train(const std::string& args) {
  return sp::runtime::run_command(std::string(SP_TRAIN_BINARY) + " " + args + " 2>&1");
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = sp::train::testing::make_scratch_dir("cli");
    corpus_ = sp::train::testing::write_corpus(dir_);
    config_ = dir_ / "tiny.yaml";
    sp::train::testing::write_text(config_, sp::train::testing::tiny_config(corpus_, dir_ / "cache"));
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string base() const { return "--config " + config_.string() + " --out " + (dir_ / "run").string(); }

  fs::path dir_, corpus_, config_;
};

TEST_F(Cli, HelpListsEveryOptionAndTheExitCodes) {
  const Result r = run_sp_train("--help");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* text : {"--config", "--data", "--steps", "--seed", "--out", "--plugin-dir", "--set", "Exit codes",
                           "130 interrupted", "SIGHUP"}) {
    EXPECT_NE(r.output.find(text), std::string::npos) << text;
  }
}

TEST_F(Cli, BadArgumentsExitTwoWithTheirMessage) {
  Result r = run_sp_train("--steps 5");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--config is required"), std::string::npos) << r.output;
  r = run_sp_train(base() + " --steps 0");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--steps: Value 0 not in range"), std::string::npos) << r.output;
  r = run_sp_train(base() + " --bogus");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--bogus"), std::string::npos) << r.output;
  r = run_sp_train(base() + " --set train.steps");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--set train.steps: expected key.path=value"), std::string::npos) << r.output;
  // Every --set applies, not only the last one.
  r = run_sp_train(base() + " --set train.stpes=3 --set train.steps=2");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("train.stpes: unknown key"), std::string::npos) << r.output;
  r = run_sp_train("--config " + (dir_ / "absent.yaml").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("absent.yaml: cannot open the config file"), std::string::npos) << r.output;
}

TEST_F(Cli, ATorchrunVariableThatIsNotACountIsRefusedByName) {
  for (const char* value : {"two", "", "0", "3x"}) {
    const Result r = sp::runtime::run_command("LOCAL_WORLD_SIZE='" + std::string(value) + "' " +
                                              std::string(SP_TRAIN_BINARY) + " " + base() + " 2>&1");
    EXPECT_EQ(r.exit_code, 2) << value << ": " << r.output;
    EXPECT_NE(r.output.find("environment variable LOCAL_WORLD_SIZE='" + std::string(value) +
                            "': a whole number of at least 1 expected"),
              std::string::npos)
        << r.output;
  }
}

TEST_F(Cli, UnusableDataOrPluginHaveTheirOwnExitCodes) {
  Result r = run_sp_train(base() + " --data " + (dir_ / "nothing-here").string());
  EXPECT_EQ(r.exit_code, 4);
  EXPECT_NE(r.output.find("nothing-here: data path does not exist"), std::string::npos) << r.output;
  r = run_sp_train(base() + " --plugin-dir " + (dir_ / "no-plugins").string());
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_NE(r.output.find("libsp_selective_precision.so"), std::string::npos) << r.output;
  // The plugin's own validation of its section, with its key path.
  r = run_sp_train(base() + " --set memory.stagehand.selective_precision.bf16_threshold=2");
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_NE(r.output.find("memory.stagehand.selective_precision.bf16_threshold"), std::string::npos) << r.output;
}

TEST_F(Cli, PathsOfTheWrongKindAreNamed) {
  sp::train::testing::write_text(dir_ / "a-file", "x");
  const std::string args = "--config " + config_.string() + " --steps 2";
  Result r = run_sp_train(args + " --out ''");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("run directory '' (--out): cannot create it as a directory: the path is empty"),
            std::string::npos)
      << r.output;
  r = run_sp_train(args + " --out " + (dir_ / "a-file").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("a-file' (--out): cannot create it as a directory"), std::string::npos) << r.output;
  r = run_sp_train("--config " + dir_.string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find(dir_.string() + ": is a directory; expected the config file"), std::string::npos) << r.output;
  fs::create_directories(dir_ / "run" / "checkpoint.bin");
  r = run_sp_train(base());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("checkpoint.bin is not a regular file"), std::string::npos) << r.output;
  // A checkpoint named elsewhere is read through the same checks.
  r = run_sp_train("--config " + config_.string() + " --set train.init_checkpoint=" +
                   (dir_ / "run" / "checkpoint.bin").string() + " --out " + (dir_ / "other").string());
  EXPECT_EQ(r.exit_code, 4);
  EXPECT_NE(r.output.find("checkpoint.bin: is a directory; expected the checkpoint"), std::string::npos) << r.output;
}

TEST_F(Cli, CorruptCheckpointInTheRunDirectoryIsReported) {
  fs::create_directories(dir_ / "run");
  sp::train::testing::write_text(dir_ / "run" / "checkpoint.bin", "SPTRCKPT but not really a checkpoint");
  const Result r = run_sp_train(base());
  EXPECT_EQ(r.exit_code, 4);
  EXPECT_NE(r.output.find("checkpoint.bin: checksum mismatch"), std::string::npos) << r.output;
}

// A run refused for its config (here by the plugin, the last to validate) must leave an
// existing run directory as it was: its config, its logs and its telemetry.
TEST_F(Cli, ARefusedRunLeavesTheRunDirectoryAsItWas) {
  ASSERT_EQ(run_sp_train(base() + " --steps 6").exit_code, 0);
  const fs::path run = dir_ / "run";
  std::vector<std::pair<fs::path, std::string>> before;
  for (const fs::path& file : {run / "config.yaml", run / "train_metrics.jsonl", run / "transfer_metrics.jsonl",
                               run / "selective_precision_telemetry.jsonl"}) {
    before.emplace_back(file, sp::train::testing::read_text(file));
    ASSERT_FALSE(before.back().second.empty()) << file;
  }
  // Refused by the plugin at load, by its config check, and while restoring the checkpoint.
  for (const auto& [refused, code] : std::vector<std::pair<std::string, int>>{
           {" --set memory.stagehand.selective_precision.bf16_threshold=2 --set train.resume=never", 3},
           {" --set train.plugin=sp_absent --set train.resume=never", 3},
           {" --seed 99", 4},
           {" --set memory.stagehand.streaming.metrics_file=config.yaml", 2}}) {
    const Result r = run_sp_train(base() + " --steps 8" + refused);
    EXPECT_EQ(r.exit_code, code) << r.output;
    for (const auto& [file, text] : before) EXPECT_EQ(sp::train::testing::read_text(file), text) << file << refused;
  }
  // A run-directory file that is not a regular file is refused before anything is rewritten.
  fs::rename(run / "train_metrics.jsonl", dir_ / "kept.jsonl");
  fs::create_directory(run / "train_metrics.jsonl");
  const Result r = run_sp_train(base() + " --steps 8");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("train_metrics.jsonl is not a regular file"), std::string::npos) << r.output;
  EXPECT_EQ(sp::train::testing::read_text(run / "config.yaml"), before[0].second);
}

TEST_F(Cli, ShortRunWritesTheRunDirectory) {
  const Result r = run_sp_train(base() + " --steps 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* file :
       {"summary.json", "config.yaml", "train_metrics.jsonl", "transfer_metrics.jsonl", "checkpoint.bin"}) {
    EXPECT_TRUE(fs::exists(dir_ / "run" / file)) << file;
  }
  EXPECT_NE(r.output.find("step 3/3"), std::string::npos) << r.output;
}

// A real SIGINT, or the SIGTERM that schedulers and `docker stop` send, once the run has
// finished a step: the process writes a checkpoint at the next step boundary and exits with
// 130 (SIGINT) or 143 (SIGTERM); the same command then resumes and finishes.
TEST_F(Cli, SigintAndSigtermCheckpointAndTheSameCommandResumes) {
  for (const auto& [signal, code] : {std::pair{SIGINT, 130}, std::pair{SIGTERM, 143}}) {
    SCOPED_TRACE(signal == SIGINT ? "SIGINT" : "SIGTERM");
    const fs::path run = dir_ / ("run-" + std::to_string(signal));
    const pid_t child = spawn_sp_train({"--config", config_.string(), "--out", run.string(), "--steps", "400"},
                                       dir_ / "interrupted.log");
    ASSERT_GT(child, 0);
    wait_for_steps(child, run / "train_metrics.jsonl", 1);
    if (HasFatalFailure()) return;
    ASSERT_EQ(::kill(child, signal), 0);
    EXPECT_EQ(wait_exit_code(child), code);
    ASSERT_TRUE(fs::exists(run / "checkpoint.bin"));
    const std::size_t steps_done = line_count(run / "train_metrics.jsonl");
    EXPECT_LT(steps_done, 400u);

    const Result resumed = run_sp_train("--config " + config_.string() + " --out " + run.string() + " --steps " +
                                        std::to_string(steps_done + 2));
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
    EXPECT_EQ(line_count(run / "train_metrics.jsonl"), steps_done + 2);
  }
}

// A second sp-train on a run directory in use is refused before it touches anything: the
// first one's logs keep every step once.
TEST_F(Cli, ASecondRunOnTheSameDirectoryIsRefusedByName) {
  const fs::path run = dir_ / "run";
  const pid_t first =
      spawn_sp_train({"--config", config_.string(), "--out", run.string(), "--steps", "400"}, dir_ / "first.log");
  ASSERT_GT(first, 0);
  wait_for_steps(first, run / "train_metrics.jsonl", 1);
  if (HasFatalFailure()) return;
  const Result second = run_sp_train(base() + " --steps 400");
  EXPECT_EQ(second.exit_code, 2) << second.output;
  EXPECT_NE(second.output.find("is in use by another sp-train (pid " + std::to_string(first) + ")"), std::string::npos)
      << second.output;
  ASSERT_EQ(::kill(first, SIGINT), 0);
  EXPECT_EQ(wait_exit_code(first), 130);
  // Every step once, in order.
  std::ifstream in(run / "train_metrics.jsonl");
  std::size_t expected = 0;
  for (std::string line; std::getline(in, line); ++expected) {
    const std::string key = "\"step\":" + std::to_string(expected);
    const std::size_t at = line.find(key);
    ASSERT_NE(at, std::string::npos) << line;
    EXPECT_TRUE(line[at + key.size()] == ',' || line[at + key.size()] == '}') << line;
  }
}

// A run directory sp-train may not write is refused by name with the exit code of a bad --out,
// before anything resumes, and left as it was (the fault probe saw "resumed ... at step 5",
// then exit code 1). Both ways in: a lock file it cannot open, and one it can (its own, left
// by its last run) in a directory made read-only. Run as nobody when the test runs as root.
TEST_F(Cli, ARunDirectoryItMayNotWriteIsRefusedBeforeResuming) {
  const fs::path run = dir_ / "run";
  ASSERT_EQ(run_sp_train(base() + " --steps 2").exit_code, 0);
  using fs::perms;
  fs::permissions(dir_, perms::group_exec | perms::others_exec, fs::perm_options::add);
  for (const bool own_lock : {false, true}) {
    SCOPED_TRACE(own_lock ? "its own lock file" : "a lock file it cannot open");
    const fs::path lock = run / ".sp-train.lock";
    if (::geteuid() == 0) {
      if (own_lock) {
        ASSERT_EQ(::chown(lock.c_str(), 65534, 65534), 0);
      }
    } else {
      fs::permissions(lock, perms::owner_write, own_lock ? fs::perm_options::add : fs::perm_options::remove);
    }
    fs::permissions(run, perms::owner_write | perms::group_write | perms::others_write, fs::perm_options::remove);
    const pid_t child = spawn_sp_train({"--config", config_.string(), "--out", run.string(), "--steps", "4"},
                                       dir_ / "read-only.log", {}, sp::train::testing::RunAs::unprivileged);
    const int exit_code = wait_exit_code(child);
    fs::permissions(run, perms::owner_write, fs::perm_options::add);
    std::ifstream in(dir_ / "read-only.log");
    const std::string output((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(exit_code, 2) << output;
    const std::string expected = own_lock ? "(--out): cannot write in it: Permission denied"
                                          : "(--out): cannot create its lock file";
    EXPECT_NE(output.find("run directory '" + run.string() + "' " + expected), std::string::npos) << output;
    EXPECT_EQ(output.find("resumed"), std::string::npos) << output;
    EXPECT_EQ(line_count(run / "train_metrics.jsonl"), 2u);
  }
}

// With polling off, a new plugin version is picked up when SIGHUP asks for it.
TEST_F(Cli, SighupSwapsToTheNewPluginVersion) {
  const fs::path plugins = dir_ / "plugins";
  fs::create_directories(plugins);
  fs::copy_file(SP_PLUGIN_V1_FILE, plugins / "libsp_selective_precision.so");
  const fs::path run = dir_ / "run";
  const pid_t child = spawn_sp_train({"--config", config_.string(), "--out", run.string(), "--steps", "400",
                                      "--plugin-dir", plugins.string(), "--set", "train.plugin_poll_steps=0"},
                                     dir_ / "sighup.log");
  ASSERT_GT(child, 0);
  wait_for_steps(child, run / "train_metrics.jsonl", 1);
  if (HasFatalFailure()) return;
  fs::copy_file(SP_PLUGIN_FILE, plugins / "incoming.so");
  fs::rename(plugins / "incoming.so", plugins / "libsp_selective_precision.so");
  ASSERT_EQ(::kill(child, SIGHUP), 0);
  // The swap is recorded in the step that begins after it; then stop the run.
  std::size_t seen = 0;
  bool swapped = false;
  while (!swapped) {
    wait_for_steps(child, run / "train_metrics.jsonl", seen + 1);
    if (HasFatalFailure()) return;
    std::ifstream in(run / "train_metrics.jsonl");
    std::size_t index = 0;
    for (std::string line; std::getline(in, line); ++index) {
      if (index < seen) continue;
      swapped = swapped || line.find("\"plugin_swap\":\"swapped 1.0.0 -> 4.0.0\"") != std::string::npos;
      seen = index + 1;
    }
  }
  ASSERT_EQ(::kill(child, SIGINT), 0);
  EXPECT_EQ(wait_exit_code(child), 130);
  std::ifstream summary(run / "summary.json");
  const std::string text((std::istreambuf_iterator<char>(summary)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"version\": \"4.0.0\""), std::string::npos) << text;
}

}  // namespace
