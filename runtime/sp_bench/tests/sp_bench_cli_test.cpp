// A smoke run of the sp-bench binary on the host backend with a low bandwidth cap: it must
// produce a valid report and a valid policy file. Structure is asserted, never speed.
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "sp/adapters/transfer_policy.h"
#include "sp/runtime/run_command.h"

namespace sp::bench {
namespace {

namespace fs = std::filesystem;
using adapters::load_report;
using adapters::TransferPoint;
using adapters::TransferPolicy;
using adapters::TransferReport;
using ::testing::HasSubstr;

runtime::CommandResult run(const std::string& args) {
  return runtime::run_command(std::string(SP_BENCH_BINARY) + " " + args + " 2>&1");
}

class SpBenchCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("sp-bench-" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(SpBenchCli, HostSmokeRunWritesAValidReportAndPolicy) {
  const runtime::CommandResult transfer =
      run("transfer --backend host --bandwidth-cap-gbps 1 --min-kib 64 --max-kib 128 --gpt-d-model 32 "
          "--blocks 2 --warmup 1 --repeats 2 --machine smoke --out " +
          path("report.json"));
  ASSERT_EQ(transfer.exit_code, 0) << transfer.output;
  const TransferReport report = load_report(path("report.json"));
  EXPECT_EQ(report.machine, "smoke");
  EXPECT_EQ(report.backend, "host");
  EXPECT_EQ(report.bandwidth_cap_gbps, std::optional<double>(1.0));
  ASSERT_EQ(report.points.size(), 3u) << "64 KiB, 128 KiB and one GPT block";
  for (const TransferPoint& p : report.points) {
    EXPECT_GT(p.bf16_bytes, p.int8_bytes);
    EXPECT_EQ(p.int8_copy.samples, 2u);
    EXPECT_EQ(p.bf16_rebuild.samples, 4u) << "every block, every repeat";
    EXPECT_GT(p.raw_copy_s, 0.0);
    ASSERT_TRUE(p.nf4.has_value()) << "every point measures NF4 too";
    EXPECT_EQ(p.nf4->group_size, 64u);
    EXPECT_LT(p.nf4->nf4_bytes, p.int8_bytes);
    EXPECT_EQ(p.nf4->dequant.samples, 2u);
    EXPECT_EQ(p.nf4->rebuild.samples, 4u);
    EXPECT_GT(p.speedup(adapters::transfer_path(sp::Precision::nf4, adapters::BlockWeights::kFrozen)), 0.0);
  }
  EXPECT_GT(report.reference_h2d_gbps, 0.0);

  const runtime::CommandResult merge = run("merge-policy --reports " + path("report.json") + " " + path("report.json") +
                                           " --output " + path("policy.json"));
  ASSERT_EQ(merge.exit_code, 0) << merge.output;
  EXPECT_THAT(merge.output, HasSubstr("nf4_frozen: NF4"));
  const TransferPolicy policy = TransferPolicy::load(path("policy.json"));
  EXPECT_EQ(policy.sources().size(), 2u);
  EXPECT_DOUBLE_EQ(policy.speedup_threshold(), 1.0);
}

TEST_F(SpBenchCli, BadArgumentsAndFilesAreExitCodeTwo) {
  EXPECT_EQ(run("").exit_code, 2);
  EXPECT_EQ(run("transfer --backend tpu --out " + path("r.json")).exit_code, 2);
  // Group sizes are checked by the kernels' own rules before anything runs.
  for (const char* group : {"48", "0", "4294967328", "64x"}) {
    const runtime::CommandResult nf4 =
        run(std::string("transfer --backend host --nf4-group-size ") + group + " --out " + path("r.json"));
    EXPECT_EQ(nf4.exit_code, 2) << group;
    EXPECT_THAT(nf4.output, HasSubstr(std::string("expected 32, 64, 128 or 256, found ") + group));
  }
  const runtime::CommandResult int8 = run("transfer --backend host --int8-group-size 48 --out " + path("r.json"));
  EXPECT_EQ(int8.exit_code, 2);
  EXPECT_THAT(int8.output, HasSubstr("expected 0 (one scale per row), 32, 64, 128 or 256, found 48"));
  const runtime::CommandResult inverted =
      run("transfer --backend host --min-kib 512 --max-kib 64 --out " + path("r.json"));
  EXPECT_EQ(inverted.exit_code, 2);
  EXPECT_THAT(inverted.output, HasSubstr("--min-kib 512 is above --max-kib 64"));
  EXPECT_FALSE(fs::exists(dir_ / "r.json"));
  std::ofstream(dir_ / "bad.json") << "{\"format\":\"sp-transfer-report\",\"version\":7}";
  const runtime::CommandResult bad = run("merge-policy --reports " + path("bad.json") + " --output " + path("p.json"));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.output, HasSubstr("bad.json: version: unsupported version 7"));
  EXPECT_FALSE(fs::exists(dir_ / "p.json"));
  // Output paths are judged at parse time, before a benchmark runs for minutes.
  const runtime::CommandResult out_dir = run("transfer --backend host --out " + dir_.string());
  EXPECT_EQ(out_dir.exit_code, 2);
  EXPECT_THAT(out_dir.output, HasSubstr("--out: " + dir_.string() + " is a directory"));
  const runtime::CommandResult no_parent =
      run("merge-policy --reports " + path("bad.json") + " --output " + path("absent/p.json"));
  EXPECT_EQ(no_parent.exit_code, 2);
  EXPECT_THAT(no_parent.output, HasSubstr("--output: the directory " + path("absent") + " of"));
  const runtime::CommandResult over_input =
      run("merge-policy --reports " + path("bad.json") + " --output " + path("bad.json"));
  EXPECT_EQ(over_input.exit_code, 2);
  EXPECT_THAT(over_input.output, HasSubstr("is also one of the --reports"));
}

}  // namespace
}  // namespace sp::bench
