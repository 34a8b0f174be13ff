// Runs the sp-replay binary as a user would, on small traces, and checks its output files,
// its exit codes and its messages.
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "sp/runtime/run_command.h"

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using RunResult = sp::runtime::CommandResult;

class SpReplayCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("sp-replay-" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    write("policy.yaml",
          "selective_precision:\n  warmup_steps: 2\n  update_interval_steps: 1\n  history_window: 2\n"
          "  min_steps_between_switches: 2\n");
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
    return dir_ / name;
  }

  // Run in the test's own directory, where a file written to a relative path would land.
  RunResult run(const std::string& args) {
    return sp::runtime::run_command("cd '" + dir_.string() + "' && " + SP_REPLAY_BINARY + " --plugin-dir " +
                                    SP_PLUGIN_DIR + " " + args + " 2>&1");
  }

  // Two blocks: block 0 has a tenth of block 1's gradient norm, so it goes INT8 at the
  // first decision step (step 2) and block 1 stays BF16.
  static std::string trace(int steps) {
    std::string text;
    for (int s = 0; s < steps; ++s) {
      text += "{\"step\":" + std::to_string(s) +
              ",\"blocks\":[{\"id\":0,\"sum_sq\":0.01,\"sum\":0,\"max_abs\":0.01,\"count\":1000,\"nonfinite\":0},"
              "{\"id\":1,\"sum_sq\":1.0,\"sum\":0,\"max_abs\":0.1,\"count\":1000,\"nonfinite\":0}]}\n";
    }
    return text;
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

TEST_F(SpReplayCli, WritesOneDecisionLinePerStepAndTelemetry) {
  write("t.jsonl", trace(4));
  const RunResult r = run("--config " + path("policy.yaml") + " --blocks 2 --trace " + path("t.jsonl") + " --out " +
                          path("d.jsonl") + " --telemetry " + path("tel.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream decisions(dir_ / "d.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(decisions, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0], (nlohmann::json{{"step", 0}, {"precision", {"bf16", "bf16"}}}));
  EXPECT_EQ(lines[1]["precision"], (nlohmann::json{"bf16", "bf16"})) << "warm-up lasts two steps";
  EXPECT_EQ(lines[2], (nlohmann::json{{"step", 2}, {"precision", {"int8", "bf16"}}}));
  EXPECT_EQ(lines[3]["precision"], (nlohmann::json{"int8", "bf16"}));
  EXPECT_TRUE(fs::exists(dir_ / "tel.jsonl"));
  EXPECT_THAT(r.output, HasSubstr("4 steps of 2 blocks: 1 precision changes"));
}

// Policy v2 through the replay: NF4 calibration errors let the tolerant block go to NF4, and
// a loss spike from the trace sends it back to BF16 (the loss guard), where its penalty holds it.
TEST_F(SpReplayCli, ThreeTiersAndTheLossGuardFromTraceLosses) {
  write("v2.yaml",
        "selective_precision:\n  warmup_steps: 2\n  update_interval_steps: 1\n  history_window: 2\n"
        "  min_steps_between_switches: 2\n  tiers: [bf16, int8, nf4]\n"
        "  loss_guard: {enabled: true, window: 2, sigmas: 3, min_rise: 0.05, blame_steps: 10, penalty_steps: 50}\n");
  write("k.json", R"({"block_errors": {"0": 0.001, "1": 0.001}, "nf4_block_errors": {"0": 0.01, "1": 0.01}})");
  std::istringstream base(trace(8));
  std::string text;
  const double losses[] = {1.0, 1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0};
  int step = 0;
  for (std::string line; std::getline(base, line); ++step) {
    line.pop_back();  // the closing brace
    text += line + ",\"loss\":" + std::to_string(losses[step]) + "}\n";
  }
  write("t.jsonl", text);
  const RunResult r = run("--config " + path("v2.yaml") + " --blocks 2 --trace " + path("t.jsonl") + " --calibration " +
                          path("k.json") + " --out " + path("d.jsonl") + " --telemetry " + path("tel.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream decisions(dir_ / "d.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(decisions, line);) lines.push_back(nlohmann::json::parse(line)["precision"]);
  ASSERT_EQ(lines.size(), 8u);
  EXPECT_EQ(lines[2], (nlohmann::json{"nf4", "bf16"}));
  EXPECT_EQ(lines[4], (nlohmann::json{"nf4", "bf16"})) << "the spike is judged at step 4's end_step";
  EXPECT_EQ(lines[5], (nlohmann::json{"bf16", "bf16"})) << "reverted at the next compute_hints";
  EXPECT_EQ(lines[7], (nlohmann::json{"bf16", "bf16"})) << "the penalty keeps it up";
  std::ifstream telemetry(dir_ / "tel.jsonl");
  const std::string records((std::istreambuf_iterator<char>(telemetry)), std::istreambuf_iterator<char>());
  EXPECT_THAT(records, HasSubstr("loss_guard"));
  EXPECT_THAT(r.output, HasSubstr("N=nf4"));
}

// The plugin runs in sp-replay's process: what it prints on stdout must not land among the
// decisions, which are on stdout without --out.
TEST_F(SpReplayCli, APluginPrintingOnStdoutDoesNotMixIntoTheDecisions) {
  write("t.jsonl", trace(3));
  write("minimal.yaml", "min_samples: 1\n");
  const std::string args = std::string(SP_REPLAY_BINARY) + " --plugin-dir " + SP_FIXTURE_DIR +
                           " --plugin sp_fixture_noisy_stdout --config " + path("minimal.yaml") +
                           " --blocks 2 --trace " + path("t.jsonl");
  const RunResult decisions = sp::runtime::run_command(args + " 2>" + path("stderr.txt"));
  ASSERT_EQ(decisions.exit_code, 0) << decisions.output;
  std::istringstream lines(decisions.output);
  int count = 0;
  for (std::string line; std::getline(lines, line); ++count) {
    const nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(record.is_object() && record.contains("precision")) << "not a decision: " << line;
  }
  EXPECT_EQ(count, 3);
  std::ifstream err(dir_ / "stderr.txt");
  const std::string err_text((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  EXPECT_THAT(err_text, HasSubstr("fixture noise on stdout at step 2"));
}

TEST_F(SpReplayCli, WithoutTelemetryOptionWritesNoTelemetryFile) {
  write("t.jsonl", trace(3));
  const RunResult r = run("--config " + path("policy.yaml") + " --blocks 2 --trace " + path("t.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("{\"precision\":[\"int8\",\"bf16\"],\"step\":2}"));
  EXPECT_FALSE(fs::exists(dir_ / "selective_precision_telemetry.jsonl"));
}

TEST_F(SpReplayCli, MalformedTraceLineNamesTheLineAndWritesNothing) {
  write("t.jsonl", trace(2) + "{\"step\":2,\"blocks\":[{\"id\":5}]}\n");
  const RunResult r =
      run("--config " + path("policy.yaml") + " --blocks 2 --trace " + path("t.jsonl") + " --out " + path("d.jsonl"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("t.jsonl:3: blocks[0].id: block id 5 is out of range: --blocks is 2"));
  EXPECT_FALSE(fs::exists(dir_ / "d.jsonl")) << "a failed replay must not leave a decisions file";
}

TEST_F(SpReplayCli, BadConfigIsRejectedByThePluginWithTheFileAndKey) {
  write("t.jsonl", trace(1));
  write("bad.yaml", "selective_precision:\n  int8_treshold: 0.2\n");
  const RunResult r = run("--config " + path("bad.yaml") + " --blocks 2 --trace " + path("t.jsonl"));
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_THAT(r.output, HasSubstr("bad.yaml"));
  EXPECT_THAT(r.output, HasSubstr("int8_treshold"));
  EXPECT_THAT(r.output, HasSubstr("int8_threshold"));
}

TEST_F(SpReplayCli, MissingPluginIsExitCodeThree) {
  write("t.jsonl", trace(1));
  const RunResult r =
      run("--config " + path("policy.yaml") + " --blocks 2 --trace " + path("t.jsonl") + " --plugin no_such_plugin");
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_THAT(r.output, HasSubstr("libno_such_plugin.so"));
}

TEST_F(SpReplayCli, BadArgumentsAreExitCodeTwo) {
  EXPECT_EQ(run("--blocks 2").exit_code, 2);
  write("t.jsonl", trace(1));
  const RunResult zero = run("--config " + path("policy.yaml") + " --blocks 0 --trace " + path("t.jsonl"));
  EXPECT_EQ(zero.exit_code, 2);
  EXPECT_THAT(zero.output, HasSubstr("--blocks"));
  const RunResult missing = run("--config " + path("nope.yaml") + " --blocks 2 --trace " + path("t.jsonl"));
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_THAT(missing.output, HasSubstr("nope.yaml: cannot open the config"));
  const RunResult calib = run("--config " + path("policy.yaml") + " --blocks 2 --trace " + path("t.jsonl") +
                              " --calibration " + write("k.json", "{\"block_errors\":{\"7\":0.1}}").string());
  EXPECT_EQ(calib.exit_code, 2);
  EXPECT_THAT(calib.output, HasSubstr("k.json: block_errors.7: block id 7 is out of range"));
  const RunResult calibration_dir = run("--config " + path("policy.yaml") + " --blocks 2 --trace " + path("t.jsonl") +
                                        " --calibration " + dir_.string());
  EXPECT_EQ(calibration_dir.exit_code, 2);
  EXPECT_THAT(calibration_dir.output, HasSubstr(dir_.string() + ": is a directory"));
  const RunResult empty_trace =
      run("--config " + path("policy.yaml") + " --blocks 2 --trace " + write("empty.jsonl", "").string());
  EXPECT_EQ(empty_trace.exit_code, 2);
  EXPECT_THAT(empty_trace.output, HasSubstr("empty.jsonl: the trace holds no steps"));
  // Outputs that would overwrite an input, or land in a directory, are refused before the replay.
  const RunResult over_trace =
      run("--config " + path("policy.yaml") + " --blocks 2 --trace " + path("t.jsonl") + " --out " + path("t.jsonl"));
  EXPECT_EQ(over_trace.exit_code, 2);
  EXPECT_THAT(over_trace.output, HasSubstr("--out " + path("t.jsonl") + " is also the --trace"));
  const RunResult telemetry_dir = run("--config " + path("policy.yaml") + " --blocks 2 --trace " + path("t.jsonl") +
                                      " --telemetry " + dir_.string());
  EXPECT_EQ(telemetry_dir.exit_code, 2);
  EXPECT_THAT(telemetry_dir.output, HasSubstr("--telemetry: " + dir_.string() + " is a directory"));
  // Nesting deep enough to overflow a recursive description of the value.
  const RunResult deep = run("--config " + path("policy.yaml") + " --blocks 2 --trace " +
                             write("deep.jsonl", std::string(100000, '[') + std::string(100000, ']') + "\n").string());
  EXPECT_EQ(deep.exit_code, 2);
  EXPECT_THAT(deep.output, HasSubstr("deep.jsonl:1: line: expected a JSON object, got array of 1 element(s)"));
  const RunResult trace_dir = run("--config " + path("policy.yaml") + " --blocks 2 --trace " + dir_.string());
  EXPECT_EQ(trace_dir.exit_code, 2);
  EXPECT_THAT(trace_dir.output, HasSubstr(dir_.string() + ": is a directory; expected the trace"));
  // An output path that cannot be written is refused before the replay runs.
  const RunResult out_dir =
      run("--config " + path("policy.yaml") + " --blocks 2 --trace " + path("t.jsonl") + " --out " + dir_.string());
  EXPECT_EQ(out_dir.exit_code, 2);
  EXPECT_THAT(out_dir.output, HasSubstr("--out: " + dir_.string() + " is a directory; expected a file path"));
}

TEST_F(SpReplayCli, HelpDocumentsFormatsAndExitCodes) {
  const RunResult r = run("--help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("Exit codes"));
  EXPECT_THAT(r.output, HasSubstr("--telemetry"));
  EXPECT_THAT(r.output, HasSubstr("block_errors"));
}

}  // namespace
