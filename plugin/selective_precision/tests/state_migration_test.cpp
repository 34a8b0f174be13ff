// State migration 1.0.0 -> 2.0.0, and compatibility of v2 with v1 configs.
//
// tests/data/ holds state blobs that the real 1.0.0 plugin exported, with the hints 1.0.0
// returned after each export (state_fixture_writer.cpp). 2.0.0 imports each blob and must
// return the same hints for the same inputs. The randomized test runs v2 with v1 configs
// against the 1.0.0 edition fixture (the same sources built as 1.0.0).
#include "loaded_plugin.h"
#include "policy_test_support.h"

#include "sp/policy/errors.h"
#include "sp/policy/state_codec.h"

#include <sp/plugin_abi_v1.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace sp::policy::testing {
namespace {

double from_hex(const std::string &text) {
  const std::uint64_t bits = std::stoull(text, nullptr, 16);
  double value = 0.0;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

std::uint64_t bits_of(double value) {
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

std::vector<std::uint8_t> read_file(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

class StateMigration : public ::testing::TestWithParam<std::string> {};

TEST_P(StateMigration, TwoDotZeroContinuesAOneDotZeroBlobWithIdenticalHints) {
  const nlohmann::json fixture =
      nlohmann::json::parse(std::ifstream(std::string(SP_POLICY_TEST_DATA_DIR) + "/policy-1.0.0-continuation.json"));
  ASSERT_EQ(fixture["written_by"]["version"], "1.0.0");
  const nlohmann::json *scenario = nullptr;
  for (const auto &candidate : fixture["scenarios"]) {
    if (candidate["name"] == GetParam()) scenario = &candidate;
  }
  ASSERT_NE(scenario, nullptr);

  const LoadedPlugin plugin(SP_POLICY_PLUGIN_PATH);
  ASSERT_TRUE(plugin.loaded()) << dlerror();
  ASSERT_STREQ(plugin->plugin_version, "4.0.0");
  const sp_host_api_v1 host = all_routes_host();
  std::vector<sp_block_desc_v1> blocks;
  for (const auto &block : fixture["blocks"]) {
    const auto id = static_cast<std::uint32_t>(blocks.size());
    blocks.push_back(sp_block_desc_v1{sizeof(sp_block_desc_v1), id, block[0].get<std::uint64_t>(),
                                      block[1].get<std::uint64_t>(), block[2].get<std::uint64_t>(), nullptr});
  }
  const auto n = static_cast<std::uint32_t>(blocks.size());
  const std::string config = fixture["config_yaml"];
  sp_policy_ctx *ctx = nullptr;
  ASSERT_EQ(plugin->create(&host, config.c_str(), blocks.data(), n, &ctx), SP_OK) << plugin->last_error(nullptr);
  const std::vector<std::uint8_t> blob =
      read_file(std::string(SP_POLICY_TEST_DATA_DIR) + "/" + (*scenario)["state_file"].get<std::string>());
  ASSERT_EQ(blob[8], 1u) << "the fixture is a format-1 blob";
  ASSERT_EQ(plugin->import_state(ctx, blob.data(), blob.size()), SP_OK) << plugin->last_error(ctx);

  std::vector<sp_hint_v1> hints(n);
  std::size_t compared = 0;
  for (const auto &step_record : (*scenario)["steps"]) {
    const std::int64_t step = step_record["step"];
    std::vector<sp_grad_moments_v1> moments;
    for (const auto &m : step_record["moments"]) {
      moments.push_back(sp_grad_moments_v1{m[0].get<std::uint32_t>(), 0, from_hex(m[1]), from_hex(m[2]), from_hex(m[3]),
                                           m[4].get<std::uint64_t>(), m[5].get<std::uint64_t>()});
    }
    ASSERT_EQ(plugin->begin_step(ctx, step), SP_OK) << plugin->last_error(ctx);
    ASSERT_EQ(plugin->post_backward(ctx, step, moments.data(), static_cast<std::uint32_t>(moments.size())), SP_OK)
        << plugin->last_error(ctx);
    ASSERT_EQ(plugin->compute_hints(ctx, step, hints.data(), n), SP_OK) << plugin->last_error(ctx);
    ASSERT_EQ(plugin->end_step(ctx, step, nullptr), SP_OK) << plugin->last_error(ctx);
    for (std::uint32_t b = 0; b < n; ++b) {
      const auto &expected = step_record["hints"][b];
      EXPECT_EQ(hints[b].precision, expected[0].get<sp_precision>()) << "step " << step << " block " << b;
      EXPECT_EQ(hints[b].reason, expected[1].get<sp_reason>()) << "step " << step << " block " << b;
      EXPECT_EQ(bits_of(hints[b].sensitivity), bits_of(from_hex(expected[2]))) << "step " << step << " block " << b;
      ++compared;
    }
  }
  EXPECT_GT(compared, 200u);
  // What 2.0.0 exports afterwards is format 2 and round-trips.
  std::uint64_t size = 0;
  plugin->export_state(ctx, nullptr, 0, &size);
  std::vector<std::uint8_t> exported(size);
  ASSERT_EQ(plugin->export_state(ctx, exported.data(), size, &size), SP_OK);
  EXPECT_EQ(exported[8], 2u);
  plugin->destroy(ctx);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, StateMigration, ::testing::Values("fresh", "mid_run"));

TEST(StateMigration, AOneDotZeroBlobImportsWithAnEmptyLossWindowAndNoMoves) {
  const std::vector<std::uint8_t> blob =
      read_file(std::string(SP_POLICY_TEST_DATA_DIR) + "/policy-1.0.0-mid_run.state");
  const PolicyState state = decode_state(blob.data(), blob.size(), 6, 3);
  EXPECT_TRUE(state.loss_window.losses.empty());
  for (const BlockState &block : state.blocks) {
    EXPECT_FALSE(block.last_down_move);
    EXPECT_FALSE(block.pending_revert);
    EXPECT_FALSE(block.penalty_until);
    EXPECT_FALSE(block.nf4_calibration_error);
    EXPECT_TRUE(std::isnan(block.score.nf4_sensitivity));
  }
}

// ---- Corrupt v2 blobs ----

class V2Blob : public ::testing::Test {
 protected:
  V2Blob()
      : source(
            standalone(immediate_settings() + "  tiers: [bf16, int8, nf4]\n  loss_guard: {enabled: true, window: 3}\n"),
            3),
        target(standalone(immediate_settings() + "  tiers: [bf16, int8, nf4]\n"), 3) {
    for (int step = 0; step < 6; ++step) {
      sp_step_feedback_v1 feedback{};
      feedback.struct_size = sizeof feedback;
      feedback.loss = 1.0 + 0.1 * step;
      source.step(step, {moments_with_l2(0, 1.0), moments_with_l2(1, 0.1), moments_with_l2(2, 3.0)}, &feedback);
    }
    blob = source.engine().export_state();
    target.step_l2(0, {1.0, 1.0, 1.0});
    before = target.engine().export_state();
  }
  void expect_rejected(const std::vector<std::uint8_t> &bad, const std::string &part) {
    try {
      target.engine().import_state(bad.data(), bad.size());
      ADD_FAILURE() << "accepted a blob that should say: " << part;
    } catch (const StateError &error) {
      EXPECT_NE(std::string(error.what()).find(part), std::string::npos) << error.what();
    }
    EXPECT_EQ(target.engine().export_state(), before);
  }
  Driver source;
  Driver target;
  std::vector<std::uint8_t> blob;
  std::vector<std::uint8_t> before;
};

TEST_F(V2Blob, IsFormatTwoWithTheLossWindow) {
  EXPECT_EQ(blob[8], 2u);
  target.engine().import_state(blob.data(), blob.size());
  EXPECT_EQ(target.engine().state().loss_window.losses.size(), 3u);
}

TEST_F(V2Blob, EveryTruncationIsRejectedAndLeavesStateUnchanged) {
  for (std::size_t size = 0; size < blob.size(); ++size) {
    const std::vector<std::uint8_t> cut(blob.begin(), blob.begin() + static_cast<std::ptrdiff_t>(size));
    expect_rejected(cut, "state blob");
  }
}

TEST_F(V2Blob, AFlippedByteInTheV2SectionsIsRejected) {
  for (std::size_t offset = blob.size() - 60; offset < blob.size(); ++offset) {
    std::vector<std::uint8_t> bad = blob;
    bad[offset] ^= 0x01;
    expect_rejected(bad, "state blob");
  }
}

TEST_F(V2Blob, AFormatOneBlobWithV2SectionsIsRejected) {
  std::vector<std::uint8_t> bad = blob;
  bad[8] = 1;
  // Without resealing, the checksum names it.
  expect_rejected(bad, "checksum");
}

// ---- Compatibility ----

// A random v1 config (only v1 keys).
std::string random_v1_config(std::mt19937_64 &rng, std::uint32_t n_blocks) {
  std::uniform_int_distribution<int> small(0, 4);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const double int8_threshold = 0.1 + 0.3 * unit(rng);
  const double bf16_threshold = int8_threshold + 0.05 + 0.4 * unit(rng);
  const double margin = int8_threshold * unit(rng);
  std::string text =
      "  warmup_steps: " + std::to_string(small(rng)) + "\n  update_interval_steps: " + std::to_string(1 + small(rng)) +
      "\n  min_steps_between_switches: " + std::to_string(small(rng) * 2) +
      "\n  history_window: " + std::to_string(1 + small(rng)) +
      "\n  int8_threshold: " + std::to_string(int8_threshold) +
      "\n  bf16_threshold: " + std::to_string(bf16_threshold) + "\n  hysteresis_margin: " + std::to_string(margin) +
      "\n  ambiguous_default: " + (unit(rng) < 0.5 ? "bf16" : "int8") +
      "\n  nonfinite_to_bf16: " + (unit(rng) < 0.8 ? "true" : "false") +
      "\n  telemetry_enabled: false\n  log_decisions: false\n";
  if (unit(rng) < 0.5) text += "  force_bf16_blocks: [" + std::to_string(n_blocks - 1) + "]\n";
  if (unit(rng) < 0.5) text += "  force_int8_blocks: [0]\n";
  if (unit(rng) < 0.2) text += "  mode: static\n";
  return standalone(text);
}

TEST(V2Rules, CompatibilityWithV1Config) {
  const LoadedPlugin edition(SP_POLICY_PLUGIN_V1_EDITION_PATH);
  ASSERT_TRUE(edition.loaded()) << dlerror();
  ASSERT_STREQ(edition->plugin_version, "1.0.0");
  constexpr std::uint32_t kBlocks = 7;
  std::mt19937_64 rng(20240601);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  sp_host_api_v1 host = all_routes_host();
  std::vector<sp_block_desc_v1> descs;
  for (std::uint32_t b = 0; b < kBlocks; ++b) descs.push_back({sizeof(sp_block_desc_v1), b, 1000, 2000, 1000, nullptr});
  std::size_t compared = 0;
  for (int run = 0; run < 40; ++run) {
    const std::string config = random_v1_config(rng, kBlocks);
    Driver v2(config, kBlocks);
    sp_policy_ctx *ctx = nullptr;
    ASSERT_EQ(edition->create(&host, config.c_str(), descs.data(), kBlocks, &ctx), SP_OK)
        << edition->last_error(nullptr) << "\n"
        << config;
    std::vector<sp_hint_v1> hints(kBlocks);
    for (std::int64_t step = 0; step < 60; ++step) {
      if (unit(rng) < 0.1) {
        std::vector<std::uint32_t> ids;
        std::vector<double> errors;
        for (std::uint32_t b = 0; b < kBlocks; ++b) {
          if (unit(rng) < 0.5) {
            ids.push_back(b);
            errors.push_back(0.1 * unit(rng));
          }
        }
        const auto n = static_cast<std::uint32_t>(ids.size());
        v2.engine().set_calibration_errors(ids.data(), errors.data(), n);
        ASSERT_EQ(edition->set_calibration_errors(ctx, ids.data(), errors.data(), n), SP_OK);
      }
      std::vector<sp_grad_moments_v1> moments;
      for (std::uint32_t b = 0; b < kBlocks; ++b) {
        const double r = unit(rng);
        if (r < 0.1) continue;
        if (r < 0.15) {
          moments.push_back(nonfinite_moments(b));
        } else {
          moments.push_back(moments_with_l2(b, 0.01 + 3.0 * unit(rng) * unit(rng)));
        }
      }
      sp_step_feedback_v1 feedback{};
      feedback.struct_size = sizeof feedback;
      feedback.loss = unit(rng) < 0.1 ? 50.0 : 1.0 + 0.01 * unit(rng);  // spikes: the guard is off
      const std::vector<sp_hint_v1> mine = v2.step(step, moments, &feedback);
      ASSERT_EQ(edition->begin_step(ctx, step), SP_OK);
      ASSERT_EQ(edition->post_backward(ctx, step, moments.data(), static_cast<std::uint32_t>(moments.size())), SP_OK);
      ASSERT_EQ(edition->compute_hints(ctx, step, hints.data(), kBlocks), SP_OK);
      sp_step_feedback_v1 old_feedback = feedback;
      old_feedback.struct_size = SP_STEP_FEEDBACK_V1_0_SIZE;
      ASSERT_EQ(edition->end_step(ctx, step, &old_feedback), SP_OK);
      for (std::uint32_t b = 0; b < kBlocks; ++b) {
        ASSERT_EQ(mine[b].precision, hints[b].precision) << config << "step " << step << " block " << b;
        ASSERT_EQ(mine[b].reason, hints[b].reason) << config << "step " << step << " block " << b;
        ASSERT_EQ(bits_of(mine[b].sensitivity), bits_of(hints[b].sensitivity)) << "step " << step;
        ++compared;
      }
    }
    edition->destroy(ctx);
  }
  EXPECT_EQ(compared, 40u * 60u * kBlocks);
}

}  // namespace
}  // namespace sp::policy::testing
