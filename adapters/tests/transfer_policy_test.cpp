#include "sp/adapters/transfer_policy.h"

#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace sp::adapters {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t MiB = 1ull << 20;
const TransferPath kInt8Frozen = transfer_path(Precision::int8, BlockWeights::kFrozen);
const TransferPath kInt8Trained = transfer_path(Precision::int8, BlockWeights::kTrained);
const TransferPath kNf4Frozen = transfer_path(Precision::nf4, BlockWeights::kFrozen);
const TransferPath kNf4Trained = transfer_path(Precision::nf4, BlockWeights::kTrained);

TransferPoint point(uint64_t bf16_bytes, double frozen_speedup, double trained_speedup) {
  TransferPoint p;
  p.bf16_bytes = bf16_bytes;
  p.int8_bytes = bf16_bytes / 2 + 4096;
  p.bf16_copy = {1e-3, 9e-4, 1.2e-3, 10};
  p.int8_copy = p.int8_dequant = p.bf16_rebuild = p.int8_rebuild = p.bf16_copy;
  p.raw_copy_s = 9e-4;
  p.bf16_path_s = p.bf16_trained_path_s = 1e-3;
  p.int8_frozen_path_s = 1e-3 / frozen_speedup;
  p.int8_trained_path_s = 1e-3 / trained_speedup;
  return p;
}

TransferPoint with_nf4(TransferPoint p, double frozen_speedup, double trained_speedup) {
  Nf4Measurement m;
  m.nf4_bytes = p.bf16_bytes / 4 + 4096;
  m.copy = m.dequant = m.rebuild = p.bf16_copy;
  m.frozen_path_s = 1e-3 / frozen_speedup;
  m.trained_path_s = 1e-3 / trained_speedup;
  p.nf4 = m;
  return p;
}

TransferReport report(const std::string& machine, std::vector<TransferPoint> points) {
  TransferReport r;
  r.machine = machine;
  r.backend = "cuda";
  r.device = "test GPU";
  r.reference_h2d_gbps = 25.0;
  r.points = std::move(points);
  return r;
}

TEST(TransferPolicyMerge, AllowsFromTheFirstGoodSizeUpwards) {
  const auto policy = TransferPolicy::merge({report("a", {point(1 * MiB, 0.6, 0.3), point(4 * MiB, 1.2, 0.8),
                                                          point(16 * MiB, 1.8, 1.1), point(64 * MiB, 1.9, 1.3)})},
                                            1.0);
  ASSERT_EQ(policy.rules(kInt8Frozen).size(), 1u);
  const TransferRule& frozen = policy.rules(kInt8Frozen)[0];
  EXPECT_EQ(frozen.min_bytes, 4 * MiB);
  EXPECT_FALSE(frozen.max_bytes.has_value());
  EXPECT_DOUBLE_EQ(frozen.measured_speedup, 1.2);
  EXPECT_FALSE(policy.pays(kInt8Frozen, 4 * MiB - 1));
  EXPECT_TRUE(policy.pays(kInt8Frozen, 4 * MiB));
  EXPECT_TRUE(policy.pays(kInt8Frozen, 1024 * MiB));
  // The trained path pays the image rebuild too, so it starts later.
  EXPECT_FALSE(policy.pays(kInt8Trained, 8 * MiB));
  EXPECT_TRUE(policy.pays(kInt8Trained, 16 * MiB));
}

TEST(TransferPolicyMerge, ThresholdIsInclusiveAndRaisingItNarrowsTheRules) {
  const auto r = report("a", {point(1 * MiB, 1.0, 1.0), point(8 * MiB, 1.5, 1.5)});
  EXPECT_TRUE(TransferPolicy::merge({r}, 1.0).pays(kInt8Frozen, 1 * MiB));
  const auto strict = TransferPolicy::merge({r}, 1.4);
  EXPECT_FALSE(strict.pays(kInt8Frozen, 1 * MiB));
  EXPECT_TRUE(strict.pays(kInt8Frozen, 8 * MiB));
  EXPECT_TRUE(TransferPolicy::merge({r}, 2.0).rules(kInt8Frozen).empty());
}

TEST(TransferPolicyMerge, AGoodSizeBetweenBadOnesIsNotExtrapolated) {
  // INT8 pays only in a middle band (a fast link makes large copies cheap); a lone good size
  // with bad neighbours gives no rule, because nothing was measured around it.
  const auto policy = TransferPolicy::merge({report("a", {point(1 * MiB, 0.7, 0.7), point(4 * MiB, 1.3, 1.3),
                                                          point(8 * MiB, 1.2, 0.9), point(32 * MiB, 0.95, 0.9)})},
                                            1.0);
  ASSERT_EQ(policy.rules(kInt8Frozen).size(), 1u);
  const TransferRule& band = policy.rules(kInt8Frozen)[0];
  EXPECT_EQ(band.min_bytes, 4 * MiB);
  EXPECT_EQ(band.max_bytes, std::optional<uint64_t>(8 * MiB));
  EXPECT_DOUBLE_EQ(band.measured_speedup, 1.2);
  EXPECT_TRUE(policy.rules(kInt8Trained).empty());
}

TEST(TransferPolicyMerge, ConflictingMachinesKeepTheConservativeRule) {
  // Machine b only gains from 16 MiB on, and less; its verdict wins where they disagree.
  const auto a = report("a", {point(2 * MiB, 1.3, 1.1), point(16 * MiB, 1.9, 1.6), point(64 * MiB, 1.9, 1.7)});
  const auto b = report("b", {point(4 * MiB, 0.8, 0.7), point(16 * MiB, 1.1, 1.05), point(128 * MiB, 1.2, 1.1)});
  const auto policy = TransferPolicy::merge({a, b}, 1.0);
  ASSERT_EQ(policy.rules(kInt8Frozen).size(), 1u);
  const TransferRule& rule = policy.rules(kInt8Frozen)[0];
  EXPECT_EQ(rule.min_bytes, 16 * MiB);
  EXPECT_FALSE(rule.max_bytes.has_value());
  EXPECT_DOUBLE_EQ(rule.measured_speedup, 1.1);
  EXPECT_FALSE(policy.pays(kInt8Frozen, 8 * MiB));
  // The order of the reports does not matter.
  const auto swapped = TransferPolicy::merge({b, a}, 1.0);
  for (TransferPath path : {kInt8Frozen, kInt8Trained}) {
    ASSERT_EQ(swapped.rules(path).size(), policy.rules(path).size());
    for (size_t i = 0; i < policy.rules(path).size(); ++i) {
      EXPECT_EQ(swapped.rules(path)[i].min_bytes, policy.rules(path)[i].min_bytes);
      EXPECT_EQ(swapped.rules(path)[i].max_bytes, policy.rules(path)[i].max_bytes);
      EXPECT_DOUBLE_EQ(swapped.rules(path)[i].measured_speedup, policy.rules(path)[i].measured_speedup);
    }
  }
  ASSERT_EQ(policy.sources().size(), 2u);
  EXPECT_EQ(policy.sources()[1].machine, "b");
}

TEST(TransferPolicyMerge, OverlappingRangesFromSeveralReportsIntersect) {
  const auto a = report("a", {point(1 * MiB, 1.5, 1.5), point(8 * MiB, 1.5, 1.5), point(32 * MiB, 0.5, 0.5)});
  const auto b = report("b", {point(4 * MiB, 1.4, 1.4), point(64 * MiB, 1.6, 1.6)});
  const auto policy = TransferPolicy::merge({a, b}, 1.0);
  ASSERT_EQ(policy.rules(kInt8Frozen).size(), 1u);
  EXPECT_EQ(policy.rules(kInt8Frozen)[0].min_bytes, 4 * MiB);
  EXPECT_EQ(policy.rules(kInt8Frozen)[0].max_bytes, std::optional<uint64_t>(8 * MiB));
}

TEST(TransferPolicyMerge, RepeatedSizeKeepsItsWorseMeasurement) {
  const auto policy = TransferPolicy::merge({report("a", {point(8 * MiB, 1.4, 1.4), point(8 * MiB, 0.9, 0.9)})}, 1.0);
  EXPECT_TRUE(policy.rules(kInt8Frozen).empty());
}

TEST(TransferPolicyMerge, RejectsUnusableInput) {
  EXPECT_THROW(TransferPolicy::merge({}, 1.0), TransferPolicyError);
  EXPECT_THROW(TransferPolicy::merge({report("a", {})}, 1.0), TransferPolicyError);
  EXPECT_THROW(TransferPolicy::merge({report("a", {point(MiB, 1, 1)})}, 0.0), TransferPolicyError);
  EXPECT_THROW(TransferPolicy::merge({report("a", {point(MiB, 1, 1)})}, std::nan("")), TransferPolicyError);
}

TEST(TransferPolicyMerge, Nf4RulesComeFromTheNf4Measurements) {
  // NF4 pays for frozen blocks from 4 MiB, for trained blocks nowhere (its rebuild costs more).
  const auto policy = TransferPolicy::merge(
      {report("a", {with_nf4(point(1 * MiB, 1.2, 1.1), 0.8, 0.5), with_nf4(point(4 * MiB, 1.4, 1.2), 1.7, 0.9),
                    with_nf4(point(16 * MiB, 1.6, 1.3), 2.1, 0.95)})},
      1.0);
  ASSERT_EQ(policy.rules(kNf4Frozen).size(), 1u);
  EXPECT_EQ(policy.rules(kNf4Frozen)[0].min_bytes, 4 * MiB);
  EXPECT_DOUBLE_EQ(policy.rules(kNf4Frozen)[0].measured_speedup, 1.7);
  EXPECT_TRUE(policy.rules(kNf4Trained).empty());
  EXPECT_TRUE(policy.pays(kInt8Frozen, 1 * MiB));
  EXPECT_FALSE(policy.pays(kNf4Frozen, 1 * MiB));

  // The gate for the PolicyBridge: both routes, per block size.
  const TransferGate frozen = transfer_gate(policy, BlockWeights::kFrozen, {1 * MiB, 8 * MiB});
  EXPECT_EQ(frozen.pays[Precision::int8], (std::vector<bool>{true, true}));
  EXPECT_EQ(frozen.pays[Precision::nf4], (std::vector<bool>{false, true}));
  const TransferGate trained = transfer_gate(policy, BlockWeights::kTrained, {1 * MiB, 8 * MiB});
  EXPECT_EQ(trained.pays[Precision::int8], (std::vector<bool>{true, true}));
  EXPECT_EQ(trained.pays[Precision::nf4], (std::vector<bool>{false, false}));
}

// A report from before NF4 measured nothing about it: NF4 pays nowhere, alone or merged with
// a report that did measure it (every report must allow a size).
TEST(TransferPolicyMerge, AReportWithoutNf4AllowsNf4Nowhere) {
  const auto old = report("old", {point(1 * MiB, 1.5, 1.5), point(64 * MiB, 1.5, 1.5)});
  const auto fresh =
      report("new", {with_nf4(point(1 * MiB, 1.5, 1.5), 2.0, 2.0), with_nf4(point(64 * MiB, 1.5, 1.5), 2.0, 2.0)});
  EXPECT_EQ(old.points[0].speedup(kNf4Frozen), 0.0);
  EXPECT_TRUE(TransferPolicy::merge({old}, 1.0).rules(kNf4Frozen).empty());
  EXPECT_EQ(TransferPolicy::merge({fresh}, 1.0).rules(kNf4Frozen).size(), 1u);
  const auto merged = TransferPolicy::merge({old, fresh}, 1.0);
  EXPECT_TRUE(merged.rules(kNf4Frozen).empty());
  EXPECT_TRUE(merged.rules(kNf4Trained).empty());
  EXPECT_EQ(merged.rules(kInt8Frozen).size(), 1u);
}

TEST(TransferPolicyFile, APolicyFromBeforeNf4LoadsAndAllowsNf4Nowhere) {
  const std::string old = R"({"format":"sp-transfer-policy","version":1,"speedup_threshold":1.0,"sources":[],)"
                          R"("rules":{"int8_frozen":[{"min_bytes":1024,"max_bytes":null,"measured_speedup":1.3}],)"
                          R"("int8_trained":[]}})";
  const TransferPolicy policy = TransferPolicy::from_json(old, "old-policy.json");
  EXPECT_TRUE(policy.pays(kInt8Frozen, 4096));
  EXPECT_FALSE(policy.pays(kNf4Frozen, 4096));
  const TransferGate gate = transfer_gate(policy, BlockWeights::kFrozen, {4096, 512});
  EXPECT_EQ(gate.pays[Precision::int8], (std::vector<bool>{true, false}));
  EXPECT_EQ(gate.pays[Precision::nf4], (std::vector<bool>{false, false}));
  // Written back, it names all four paths.
  EXPECT_THAT(policy.to_json(), HasSubstr("\"nf4_trained\": []"));
}

TEST(TransferReportFile, AReportFromBeforeNf4LoadsWithoutNf4) {
  auto r = report("a", {point(1 * MiB, 1.1, 0.9)});
  std::string text = report_to_json(r);
  ASSERT_EQ(text.find("nf4"), std::string::npos) << "a point without NF4 writes no NF4 keys";
  const TransferReport back = report_from_json(text, "old.json");
  EXPECT_FALSE(back.points[0].nf4.has_value());
}

TEST(TransferReportFile, Nf4MeasurementsRoundTripAndAreValidated) {
  auto r = report("a", {with_nf4(point(1 * MiB, 1.1, 0.9), 1.4, 0.7)});
  r.points[0].nf4->group_size = 128;
  const std::string text = report_to_json(r);
  const TransferReport back = report_from_json(text, "r.json");
  ASSERT_TRUE(back.points[0].nf4.has_value());
  EXPECT_EQ(back.points[0].nf4->group_size, 128u);
  EXPECT_EQ(back.points[0].nf4->nf4_bytes, r.points[0].nf4->nf4_bytes);
  EXPECT_DOUBLE_EQ(back.points[0].speedup(kNf4Frozen), 1.4);
  EXPECT_EQ(report_to_json(back), text);
  std::string bad = text;
  bad.replace(bad.find("\"group_size\": 128"), 17, "\"group_size\": 48");
  try {
    report_from_json(bad, "r.json");
    FAIL() << "a bad NF4 group size was accepted";
  } catch (const TransferPolicyError& e) {
    EXPECT_THAT(e.what(), HasSubstr("points[0].nf4.group_size: expected 32, 64, 128 or 256, got 48"));
  }
  // The kernels' rule decides (is_supported_nf4_group_size), on the full 64-bit value: 2^32 + 64
  // must not pass as 64.
  for (const char* group : {"32", "256"}) {
    std::string good = text;
    good.replace(good.find("\"group_size\": 128"), 17, std::string("\"group_size\": ") + group);
    EXPECT_EQ(report_from_json(good, "r.json").points[0].nf4->group_size, std::stoul(group));
  }
  for (const char* group : {"0", "16", "512", "4294967360"}) {
    std::string wrong = text;
    wrong.replace(wrong.find("\"group_size\": 128"), 17, std::string("\"group_size\": ") + group);
    EXPECT_THROW(report_from_json(wrong, "r.json"), TransferPolicyError) << group;
  }
}

TEST(TransferPolicyFile, RoundTripsThroughJson) {
  const auto policy = TransferPolicy::merge(
      {report("a", {point(1 * MiB, 1.1, 0.9), point(4 * MiB, 1.3, 1.2), point(32 * MiB, 0.9, 0.8)})}, 1.0);
  const auto back = TransferPolicy::from_json(policy.to_json(), "p.json");
  EXPECT_EQ(back.to_json(), policy.to_json());
  EXPECT_TRUE(back.pays(kInt8Frozen, 2 * MiB));
  EXPECT_FALSE(back.pays(kInt8Frozen, 4 * MiB));
}

TEST(TransferReportFile, RoundTripsThroughJson) {
  auto r = report("a", {point(1 * MiB, 1.1, 0.9)});
  r.backend = "host";
  r.bandwidth_cap_gbps = 25.0;
  const auto back = report_from_json(report_to_json(r), "r.json");
  EXPECT_EQ(report_to_json(back), report_to_json(r));
  EXPECT_EQ(back.bandwidth_cap_gbps, std::optional<double>(25.0));
}

// How the trained paths' rebuild was measured travels with the report; a report from before the
// fused optimizer has no key and measured the unfused rebuild.
TEST(TransferReportFile, SaysHowTheRebuildWasMeasured) {
  auto r = report("a", {point(1 * MiB, 1.1, 0.9)});
  r.rebuild = "fused";
  const std::string text = report_to_json(r);
  EXPECT_EQ(report_from_json(text, "r.json").rebuild, "fused");
  std::string old = text;
  old.erase(old.find("\"rebuild\": \"fused\","), std::string("\"rebuild\": \"fused\",").size());
  EXPECT_EQ(report_from_json(old, "old.json").rebuild, "unfused");
  std::string bad = text;
  bad.replace(bad.find("\"fused\""), 7, "\"later\"");
  try {
    report_from_json(bad, "r.json");
    FAIL() << "an unknown rebuild was accepted";
  } catch (const TransferPolicyError& e) {
    EXPECT_THAT(e.what(), HasSubstr("rebuild"));
    EXPECT_THAT(e.what(), HasSubstr("later"));
  }
}

std::string policy_error(const std::string& text) {
  try {
    TransferPolicy::from_json(text, "policy.json");
  } catch (const TransferPolicyError& e) {
    return e.what();
  }
  return "no error";
}

TEST(TransferPolicyFile, RefusesCorruptFilesWithTheField) {
  const std::string head = R"({"format":"sp-transfer-policy","version":1,"speedup_threshold":1.0,"sources":[],)";
  EXPECT_THAT(policy_error("{\"format\":"), HasSubstr("policy.json: document: not valid JSON"));
  EXPECT_THAT(policy_error("{\"format\": 1e400}"), HasSubstr("policy.json: document: not valid JSON"));
  EXPECT_THAT(policy_error(R"({"format":"sp-transfer-report","version":1})"),
              HasSubstr("policy.json: format: expected \"sp-transfer-policy\", got \"sp-transfer-report\""));
  EXPECT_THAT(policy_error(R"({"format":"sp-transfer-policy","version":2})"),
              HasSubstr("policy.json: version: unsupported version 2; this build reads version 1"));
  EXPECT_THAT(policy_error(head + R"("rules":{"fp8":[]}})"), HasSubstr("rules.fp8: unknown path"));
  EXPECT_THAT(policy_error(head + R"("rules":{"int8_frozen":[{"min_bytes":8,"max_bytes":4,"measured_speedup":1.2}]}})"),
              HasSubstr("rules.int8_frozen[0].max_bytes: expected a size > min_bytes (8), got 4"));
  EXPECT_THAT(policy_error(head + R"("rules":{"int8_frozen":[{"min_bytes":8,"max_bytes":null,"measured_speedup":1.2},)"
                                  R"({"min_bytes":16,"max_bytes":null,"measured_speedup":1.3}]}})"),
              HasSubstr("rules.int8_frozen[1].min_bytes: rules must be sorted by size and must not overlap"));
  EXPECT_THAT(
      policy_error(head + R"("rules":{"int8_frozen":[{"min_bytes":-1,"max_bytes":null,"measured_speedup":1}]}})"),
      HasSubstr("rules.int8_frozen[0].min_bytes: expected an integer >= 0, got -1"));
  EXPECT_THAT(
      policy_error(head + R"("rules":{"int8_frozen":[{"min_bytes":1,"max_bytes":null,"measured_speedup":0}]}})"),
      HasSubstr("rules.int8_frozen[0].measured_speedup: expected a number > 0"));
  EXPECT_THAT(policy_error(head + R"("rules":{}, "extra": 1})"), HasSubstr("extra: unknown key"));
}

TEST(TransferPolicyFile, MissingFileIsAClearError) {
  try {
    TransferPolicy::load("/nonexistent/policy.json");
    FAIL();
  } catch (const TransferPolicyError& e) {
    EXPECT_THAT(e.what(), HasSubstr("/nonexistent/policy.json: cannot open the transfer policy file"));
  }
}

TEST(TransferPolicyFile, DefaultPolicyAllowsInt8AndNf4Nowhere) {
  const TransferPolicy none;
  EXPECT_FALSE(none.pays(kInt8Frozen, 1ull << 40));
  EXPECT_FALSE(none.pays(kInt8Trained, 1ull << 40));
  EXPECT_FALSE(none.pays(kNf4Frozen, 1ull << 40));
  EXPECT_FALSE(none.pays(kNf4Trained, 1ull << 40));
}

TEST(TransferPath, NamesRoundTrip) {
  for (const TransferPath path : transfer_paths()) {
    EXPECT_EQ(parse_transfer_path(transfer_path_name(path)), std::optional<TransferPath>(path));
  }
  std::vector<std::string> names;
  for (const TransferPath path : transfer_paths()) names.push_back(transfer_path_name(path));
  // Two per quantized route, in the table's order: "int8_frozen", "int8_trained", "nf4_frozen", ...
  std::vector<std::string> expected;
  for (const Precision route : sp::kQuantizedPrecisions) {
    for (const char* weights : {"_frozen", "_trained"})
      expected.push_back(sp::precision_name(route) + std::string(weights));
  }
  EXPECT_EQ(names, expected);
  EXPECT_EQ(names.front(), "int8_frozen");
  EXPECT_EQ(names.back(), "nf4_trained");
  EXPECT_EQ(parse_transfer_path("bf16_frozen"), std::nullopt);
  EXPECT_THROW(transfer_path(Precision::bf16, BlockWeights::kFrozen), std::invalid_argument);
}

}  // namespace
}  // namespace sp::adapters
