// The sp-train command line: every bad argument or input gets its own message and exit code.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "train_test_support.hpp"

namespace {

namespace fs = std::filesystem;

struct Result {
  int exit_code = -1;
  std::string output;
};

Result run_sp_train(const std::string& args) {
  const std::string command = std::string(SP_TRAIN_BINARY) + " " + args + " 2>&1";
  Result result;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> buffer{};
  while (const std::size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe)) result.output.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
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

TEST_F(Cli, CorruptCheckpointInTheRunDirectoryIsReported) {
  fs::create_directories(dir_ / "run");
  sp::train::testing::write_text(dir_ / "run" / "checkpoint.bin", "SPTRCKPT but not really a checkpoint");
  const Result r = run_sp_train(base());
  EXPECT_EQ(r.exit_code, 4);
  EXPECT_NE(r.output.find("checkpoint.bin: checksum mismatch"), std::string::npos) << r.output;
}

TEST_F(Cli, ShortRunWritesTheRunDirectory) {
  const Result r = run_sp_train(base() + " --steps 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* file : {"summary.json", "config.yaml", "train_metrics.jsonl", "transfer_metrics.jsonl", "checkpoint.bin"}) {
    EXPECT_TRUE(fs::exists(dir_ / "run" / file)) << file;
  }
  EXPECT_NE(r.output.find("step 3/3"), std::string::npos) << r.output;
}

}  // namespace
