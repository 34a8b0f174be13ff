// The plugin through its C table, loaded with dlopen() as a host loads it.
#include "loaded_plugin.h"
#include "policy_test_support.h"

#include <sp/plugin_abi_v1.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <vector>

namespace sp::policy::testing {
namespace {

struct HostLog {
  static void write(void *user_data, sp_log_level level, const char *message) {
    static_cast<CapturingLog *>(user_data)->write(level, message);
  }
};

constexpr std::uint32_t kBlocks = 6;

class PluginAbi : public ::testing::Test {
 protected:
  PluginAbi() : v1(SP_POLICY_PLUGIN_PATH), v2(SP_POLICY_PLUGIN_V2_PATH) {
    host.struct_size = sizeof host;
    host.abi_major = SP_PLUGIN_ABI_MAJOR;
    host.abi_minor = SP_PLUGIN_ABI_MINOR;
    host.host_name = "sp_policy_tests";
    host.host_version = "0";
    host.log = &HostLog::write;
    host.log_user_data = &log;
    host.min_log_level = SP_LOG_DEBUG;
    // PolicyHost's default: BF16 and INT8 (a host listing BF16 alone refuses INT8 configs).
    host.supported_precisions = SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8);
    for (std::uint32_t b = 0; b < kBlocks; ++b) {
      blocks.push_back(sp_block_desc_v1{sizeof(sp_block_desc_v1), b, 1000, 2000, 1016, nullptr});
    }
  }
  void SetUp() override {
    ASSERT_NE(v1.table(), nullptr) << dlerror();
    ASSERT_NE(v2.table(), nullptr) << dlerror();
  }

  sp_policy_ctx *create(const LoadedPlugin &plugin, const std::string &yaml) {
    sp_policy_ctx *ctx = nullptr;
    const sp_status status = plugin->create(&host, yaml.c_str(), blocks.data(), kBlocks, &ctx);
    EXPECT_EQ(status, SP_OK) << plugin->last_error(nullptr);
    return ctx;
  }

  std::vector<std::uint8_t> export_state(const LoadedPlugin &plugin, sp_policy_ctx *ctx) {
    std::uint64_t size = 0;
    EXPECT_EQ(plugin->export_state(ctx, nullptr, 0, &size), SP_ERR_BUFFER_TOO_SMALL);
    std::vector<std::uint8_t> blob(size);
    EXPECT_EQ(plugin->export_state(ctx, blob.data(), blob.size(), &size), SP_OK) << plugin->last_error(ctx);
    return blob;
  }

  static std::string yaml() {
    return standalone(
        "  warmup_steps: 3\n  update_interval_steps: 2\n  min_steps_between_switches: 4\n"
        "  history_window: 3\n  telemetry_enabled: false\n  force_bf16_blocks: [5]\n");
  }

  LoadedPlugin v1;
  LoadedPlugin v2;
  sp_host_api_v1 host{};
  std::vector<sp_block_desc_v1> blocks;
  CapturingLog log;
};

// Moments for one step of a deterministic, varied run (some blocks absent, some non-finite).
std::vector<sp_grad_moments_v1> moments_at(std::int64_t step) {
  std::vector<sp_grad_moments_v1> moments;
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    if ((step + b) % 7 == 3) continue;
    if ((step * 3 + b) % 17 == 5) {
      moments.push_back(nonfinite_moments(b));
    } else {
      moments.push_back(moments_with_l2(b, 0.2 + std::fabs(std::sin(0.3 * static_cast<double>(step) + b)) * b));
    }
  }
  return moments;
}

std::vector<sp_hint_v1> run_step(const LoadedPlugin &plugin, sp_policy_ctx *ctx, std::int64_t step) {
  const std::vector<sp_grad_moments_v1> moments = moments_at(step);
  std::vector<sp_hint_v1> hints(kBlocks);
  EXPECT_EQ(plugin->begin_step(ctx, step), SP_OK) << plugin->last_error(ctx);
  EXPECT_EQ(plugin->post_backward(ctx, step, moments.data(), static_cast<std::uint32_t>(moments.size())), SP_OK)
      << plugin->last_error(ctx);
  EXPECT_EQ(plugin->compute_hints(ctx, step, hints.data(), kBlocks), SP_OK) << plugin->last_error(ctx);
  EXPECT_EQ(plugin->end_step(ctx, step, nullptr), SP_OK) << plugin->last_error(ctx);
  return hints;
}

bool same_hint(const sp_hint_v1 &a, const sp_hint_v1 &b) {
  const bool same_sensitivity =
      a.sensitivity == b.sensitivity || (std::isnan(a.sensitivity) && std::isnan(b.sensitivity));
  return a.block_id == b.block_id && a.precision == b.precision && a.reason == b.reason && same_sensitivity;
}

TEST_F(PluginAbi, TableDescribesThePlugin) {
  EXPECT_EQ(v1->struct_size, sizeof(sp_policy_plugin_v1_table));
  EXPECT_EQ(v1->abi_major, static_cast<std::uint32_t>(SP_PLUGIN_ABI_MAJOR));
  EXPECT_EQ(v1->abi_minor, static_cast<std::uint32_t>(SP_PLUGIN_ABI_MINOR));
  EXPECT_STREQ(v1->plugin_name, "selective_precision");
  EXPECT_STREQ(v1->plugin_version, "4.0.0");
  EXPECT_NE(v1->set_transfer_bytes, nullptr);
  EXPECT_NE(v1->set_precision_calibration_errors, nullptr);
  EXPECT_STREQ(v2->plugin_name, "selective_precision");
  EXPECT_STREQ(v2->plugin_version, "4.0.0");
}

TEST_F(PluginAbi, TheOneDotZeroEditionDescribesItselfAsOneDotZero) {
  const LoadedPlugin edition(SP_POLICY_PLUGIN_V1_EDITION_PATH);
  ASSERT_NE(edition.table(), nullptr) << dlerror();
  EXPECT_EQ(edition->struct_size, SP_PLUGIN_TABLE_V1_0_SIZE);
  EXPECT_EQ(edition->abi_minor, 0u);
  EXPECT_STREQ(edition->plugin_version, "1.0.0");
  // v2 keys are unknown keys to 1.0.0.
  sp_policy_ctx *ctx = nullptr;
  const std::string v2_config = standalone("  tiers: [bf16, int8]\n");
  EXPECT_EQ(edition->create(&host, v2_config.c_str(), blocks.data(), kBlocks, &ctx), SP_ERR_CONFIG);
  EXPECT_NE(std::string(edition->last_error(nullptr)).find("selective_precision.tiers: unknown key"), std::string::npos)
      << edition->last_error(nullptr);
  // It exports state format 1.
  ctx = create(edition, yaml());
  ASSERT_NE(ctx, nullptr);
  std::uint64_t size = 0;
  edition->export_state(ctx, nullptr, 0, &size);
  std::vector<std::uint8_t> blob(size);
  ASSERT_EQ(edition->export_state(ctx, blob.data(), size, &size), SP_OK);
  EXPECT_EQ(blob[8], 1u);
  edition->destroy(ctx);
}

TEST_F(PluginAbi, NoNf4HostRejectsAnNf4ConfigByName) {
  sp_policy_ctx *ctx = nullptr;
  sp_host_api_v1 old_host = host;
  old_host.struct_size = SP_HOST_API_V1_0_SIZE;  // a 1.0 host: BF16 and INT8
  const std::string tiers = standalone("  tiers: [bf16, int8, nf4]\n  telemetry_enabled: false\n");
  EXPECT_EQ(v1->create(&old_host, tiers.c_str(), blocks.data(), kBlocks, &ctx), SP_ERR_CONFIG);
  EXPECT_NE(std::string(v1->last_error(nullptr)).find("selective_precision.tiers: nf4 is a tier, but the host"),
            std::string::npos)
      << v1->last_error(nullptr);
  const std::string forced = standalone("  force_nf4_blocks: [1]\n");
  sp_host_api_v1 no_nf4 = host;
  no_nf4.supported_precisions = SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8);
  EXPECT_EQ(v1->create(&no_nf4, forced.c_str(), blocks.data(), kBlocks, &ctx), SP_ERR_CONFIG);
  EXPECT_NE(std::string(v1->last_error(nullptr)).find("selective_precision.force_nf4_blocks"), std::string::npos);
  no_nf4.supported_precisions |= SP_PRECISION_BIT(SP_PRECISION_NF4);
  ASSERT_EQ(v1->create(&no_nf4, tiers.c_str(), blocks.data(), kBlocks, &ctx), SP_OK) << v1->last_error(nullptr);
  v1->destroy(ctx);
}

// Symmetric with NF4: a host that lists BF16 only refuses INT8 hints, so a config that
// would send them (the default tiers, or force_int8_blocks) is refused at create().
TEST_F(PluginAbi, Bf16OnlyHostRejectsAnInt8ConfigByName) {
  sp_policy_ctx *ctx = nullptr;
  sp_host_api_v1 bf16_only = host;
  bf16_only.supported_precisions = SP_PRECISION_BIT(SP_PRECISION_BF16);
  const std::string defaults = standalone("  telemetry_enabled: false\n");  // tiers [bf16, int8]
  EXPECT_EQ(v1->create(&bf16_only, defaults.c_str(), blocks.data(), kBlocks, &ctx), SP_ERR_CONFIG);
  EXPECT_NE(std::string(v1->last_error(nullptr))
                .find("selective_precision.tiers: int8 is a tier, but the host "
                      "cannot transfer INT8"),
            std::string::npos)
      << v1->last_error(nullptr);
  const std::string forced = standalone("  telemetry_enabled: false\n  tiers: [bf16]\n  force_int8_blocks: [1]\n");
  EXPECT_EQ(v1->create(&bf16_only, forced.c_str(), blocks.data(), kBlocks, &ctx), SP_ERR_CONFIG);
  EXPECT_NE(std::string(v1->last_error(nullptr))
                .find("selective_precision.force_int8_blocks: 1 block(s) forced "
                      "to int8, but the host cannot transfer INT8"),
            std::string::npos)
      << v1->last_error(nullptr);
  const std::string bf16_tier = standalone("  telemetry_enabled: false\n  tiers: [bf16]\n");
  ASSERT_EQ(v1->create(&bf16_only, bf16_tier.c_str(), blocks.data(), kBlocks, &ctx), SP_OK) << v1->last_error(nullptr);
  v1->destroy(ctx);
  // A 1.0-sized host struct has no supported_precisions: it transfers BF16 and INT8.
  sp_host_api_v1 old_host = bf16_only;
  old_host.struct_size = SP_HOST_API_V1_0_SIZE;
  ASSERT_EQ(v1->create(&old_host, defaults.c_str(), blocks.data(), kBlocks, &ctx), SP_OK) << v1->last_error(nullptr);
  v1->destroy(ctx);
}

TEST_F(PluginAbi, OneDotOneFunctionsRouteCalibrationAndBytes) {
  host.supported_precisions =
      SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8) | SP_PRECISION_BIT(SP_PRECISION_NF4);
  sp_policy_ctx *ctx = create(v1, standalone("  tiers: [bf16, int8, nf4]\n  telemetry_enabled: false\n"));
  ASSERT_NE(ctx, nullptr);
  const std::uint32_t ids[] = {0, 1};
  const double errors[] = {0.01, 0.02};
  EXPECT_EQ(v1->set_precision_calibration_errors(ctx, SP_PRECISION_INT8, ids, errors, 2), SP_OK);
  EXPECT_EQ(v1->set_precision_calibration_errors(ctx, SP_PRECISION_NF4, ids, errors, 2), SP_OK);
  EXPECT_EQ(v1->set_precision_calibration_errors(ctx, SP_PRECISION_BF16, ids, errors, 2), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(v1->set_precision_calibration_errors(ctx, 5, ids, errors, 2), SP_ERR_INVALID_ARGUMENT);
  std::vector<std::uint64_t> bytes(kBlocks, 560);
  EXPECT_EQ(v1->set_transfer_bytes(ctx, SP_PRECISION_NF4, bytes.data(), kBlocks), SP_OK);
  EXPECT_EQ(v1->set_transfer_bytes(ctx, SP_PRECISION_NF4, bytes.data(), kBlocks - 1), SP_ERR_INVALID_ARGUMENT);
  // A 1.0-sized feedback is accepted; the loss in it is read.
  ASSERT_EQ(v1->begin_step(ctx, 0), SP_OK);
  sp_step_feedback_v1 feedback{};
  feedback.struct_size = SP_STEP_FEEDBACK_V1_0_SIZE;
  feedback.loss = 1.0;
  EXPECT_EQ(v1->end_step(ctx, 0, &feedback), SP_OK) << v1->last_error(ctx);
  v1->destroy(ctx);
}

TEST_F(PluginAbi, ARejectedConfigLeavesNoContextAndAMessage) {
  sp_policy_ctx *ctx = reinterpret_cast<sp_policy_ctx *>(&host);
  const std::string bad = standalone("  int8_threshold: 0.9\n");
  EXPECT_EQ(v1->create(&host, bad.c_str(), blocks.data(), kBlocks, &ctx), SP_ERR_CONFIG);
  EXPECT_EQ(ctx, nullptr);
  EXPECT_NE(std::string(v1->last_error(nullptr)).find("selective_precision.int8_threshold"), std::string::npos)
      << v1->last_error(nullptr);
}

TEST_F(PluginAbi, CreateRejectsBadHostInput) {
  sp_policy_ctx *ctx = nullptr;
  const std::string good = yaml();
  EXPECT_EQ(v1->create(nullptr, good.c_str(), blocks.data(), kBlocks, &ctx), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(v1->create(&host, nullptr, blocks.data(), kBlocks, &ctx), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(v1->create(&host, good.c_str(), blocks.data(), 0, &ctx), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(v1->create(&host, good.c_str(), blocks.data(), kBlocks, nullptr), SP_ERR_INVALID_ARGUMENT);
  std::swap(blocks[1].block_id, blocks[2].block_id);
  EXPECT_EQ(v1->create(&host, good.c_str(), blocks.data(), kBlocks, &ctx), SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(v1->last_error(nullptr)).find("sorted by id"), std::string::npos);
  std::swap(blocks[1].block_id, blocks[2].block_id);
  host.abi_major = 2;
  EXPECT_EQ(v1->create(&host, good.c_str(), blocks.data(), kBlocks, &ctx), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ctx, nullptr);
  EXPECT_EQ(v1->destroy(nullptr), SP_OK);
}

TEST_F(PluginAbi, BlockDescsOfALaterMinorAreReadWithTheirOwnStride) {
  struct GrownDesc {
    sp_block_desc_v1 v1;
    std::uint64_t appended_field;
  };
  std::vector<GrownDesc> grown(kBlocks);
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    grown[b] = GrownDesc{blocks[b], 0xdeadbeef};
    grown[b].v1.struct_size = sizeof(GrownDesc);
  }
  sp_policy_ctx *ctx = nullptr;
  const std::string good = yaml();
  ASSERT_EQ(v1->create(&host, good.c_str(), &grown[0].v1, kBlocks, &ctx), SP_OK) << v1->last_error(nullptr);
  v1->destroy(ctx);
}

TEST_F(PluginAbi, FailedHooksReturnAStatusAndAMessageAndChangeNothing) {
  sp_policy_ctx *ctx = create(v1, yaml());
  run_step(v1, ctx, 0);
  ASSERT_EQ(v1->begin_step(ctx, 1), SP_OK);
  const std::vector<std::uint8_t> before = export_state(v1, ctx);

  const sp_grad_moments_v1 unknown[] = {moments_with_l2(kBlocks, 1.0)};
  EXPECT_EQ(v1->post_backward(ctx, 1, unknown, 1), SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(v1->last_error(ctx)).find("block 6"), std::string::npos) << v1->last_error(ctx);
  std::vector<sp_hint_v1> hints(kBlocks);
  EXPECT_EQ(v1->compute_hints(ctx, 1, hints.data(), kBlocks - 1), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(v1->begin_step(ctx, 1), SP_ERR_ORDER);
  EXPECT_NE(std::string(v1->last_error(ctx)).find("steps must increase"), std::string::npos);
  EXPECT_EQ(v1->end_step(ctx, 0, nullptr), SP_ERR_ORDER);
  const std::uint32_t ids[] = {0};
  const double nan_error[] = {std::numeric_limits<double>::quiet_NaN()};
  EXPECT_EQ(v1->set_calibration_errors(ctx, ids, nan_error, 1), SP_ERR_INVALID_ARGUMENT);
  std::uint64_t size = 0;
  EXPECT_EQ(v1->export_state(ctx, nullptr, 0, nullptr), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(v1->export_state(ctx, nullptr, 1 << 20, &size), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(export_state(v1, ctx), before);

  EXPECT_EQ(v1->begin_step(nullptr, 3), SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(v1->last_error(nullptr)).find("begin_step: ctx is null"), std::string::npos);
  v1->destroy(ctx);
}

TEST_F(PluginAbi, ImportRejectsDamagedBlobsAndKeepsTheContextAsItWas) {
  sp_policy_ctx *source = create(v1, yaml());
  for (int step = 0; step < 12; ++step) run_step(v1, source, step);
  const std::vector<std::uint8_t> blob = export_state(v1, source);
  sp_policy_ctx *target = create(v2, yaml());
  run_step(v2, target, 0);
  const std::vector<std::uint8_t> before = export_state(v2, target);
  for (std::size_t size = 0; size < blob.size(); size += 7) {
    EXPECT_EQ(v2->import_state(target, blob.data(), size), SP_ERR_STATE) << size;
  }
  for (std::size_t byte = 0; byte < blob.size(); byte += 3) {
    std::vector<std::uint8_t> flipped = blob;
    flipped[byte] ^= 0x10;
    EXPECT_EQ(v2->import_state(target, flipped.data(), flipped.size()), SP_ERR_STATE) << byte;
  }
  EXPECT_EQ(v2->import_state(target, nullptr, 64), SP_ERR_STATE);
  EXPECT_FALSE(std::string(v2->last_error(target)).empty());
  EXPECT_EQ(export_state(v2, target), before);
  v1->destroy(source);
  v2->destroy(target);
}

TEST_F(PluginAbi, HotSwapFromV1ToV2DecidesExactlyAsAnUninterruptedRun) {
  constexpr std::int64_t kSteps = 40;
  sp_policy_ctx *uninterrupted = create(v1, yaml());
  std::vector<std::vector<sp_hint_v1>> expected;
  for (std::int64_t step = 0; step < kSteps; ++step) expected.push_back(run_step(v1, uninterrupted, step));
  v1->destroy(uninterrupted);
  // The run must exercise the rules a migration could break: switches, cooldowns, unsafe blocks.
  std::set<sp_reason> reasons;
  std::size_t int8_hints = 0;
  for (const auto &hints : expected) {
    for (const sp_hint_v1 &hint : hints) {
      reasons.insert(hint.reason);
      int8_hints += hint.precision == SP_PRECISION_INT8 ? 1 : 0;
    }
  }
  for (sp_reason reason : {SP_REASON_THRESHOLD, SP_REASON_HYSTERESIS_HOLD, SP_REASON_COOLDOWN, SP_REASON_UNSAFE,
                           SP_REASON_FORCED, SP_REASON_NOT_DECISION_STEP}) {
    EXPECT_EQ(reasons.count(reason), 1u) << "the run never produced reason " << reason;
  }
  EXPECT_GT(int8_hints, 0u);

  for (std::int64_t swap_at : {1, 4, 7, 8, 15, 22}) {
    sp_policy_ctx *old_ctx = create(v1, yaml());
    for (std::int64_t step = 0; step < swap_at; ++step) run_step(v1, old_ctx, step);
    const std::vector<std::uint8_t> blob = export_state(v1, old_ctx);
    sp_policy_ctx *new_ctx = create(v2, yaml());
    ASSERT_EQ(v2->import_state(new_ctx, blob.data(), blob.size()), SP_OK) << v2->last_error(new_ctx);
    v1->destroy(old_ctx);
    for (std::int64_t step = swap_at; step < kSteps; ++step) {
      const std::vector<sp_hint_v1> hints = run_step(v2, new_ctx, step);
      for (std::uint32_t b = 0; b < kBlocks; ++b) {
        ASSERT_TRUE(same_hint(hints[b], expected[static_cast<std::size_t>(step)][b]))
            << "swap at " << swap_at << ", step " << step << ", block " << b;
      }
    }
    v2->destroy(new_ctx);
  }
}

// ABI 1.3: before the first step the policy gives its forced routes (BF16 elsewhere, and
// everywhere in mode off); step 0's hints then switch nothing they hold, and after a step began
// the call is out of order.
TEST_F(PluginAbi, InitialHintsAreTheForcedRoutesBeforeTheFirstStep) {
  const auto initial = [&](const std::string &config) {
    sp_policy_ctx *ctx = create(v1, standalone(config));
    std::vector<sp_hint_v1> hints(kBlocks);
    EXPECT_EQ(v1->initial_hints(ctx, hints.data(), kBlocks), SP_OK) << v1->last_error(ctx);
    std::vector<sp_precision> precisions;
    for (const sp_hint_v1 &h : hints) precisions.push_back(static_cast<sp_precision>(h.precision));
    return std::make_pair(ctx, precisions);
  };
  const auto bf16 = SP_PRECISION_BF16, int8 = SP_PRECISION_INT8;
  auto [statics, routes] = initial("  mode: static\n  telemetry_enabled: false\n  force_int8_blocks: [1, 4]\n");
  EXPECT_EQ(routes, (std::vector<sp_precision>{bf16, int8, bf16, bf16, int8, bf16}));
  const std::vector<sp_hint_v1> step0 = run_step(v1, statics, 0);
  for (std::uint32_t b = 0; b < kBlocks; ++b) EXPECT_EQ(step0[b].precision, routes[b]) << b;
  std::vector<sp_hint_v1> late(kBlocks);
  EXPECT_EQ(v1->initial_hints(statics, late.data(), kBlocks), SP_ERR_ORDER);
  EXPECT_NE(std::string(v1->last_error(statics)).find("compute_hints decides from then on"), std::string::npos);
  v1->destroy(statics);

  auto [dynamic, dynamic_routes] = initial("  telemetry_enabled: false\n  force_int8_blocks: [2]\n");
  EXPECT_EQ(dynamic_routes, (std::vector<sp_precision>{bf16, bf16, int8, bf16, bf16, bf16}));
  std::vector<sp_hint_v1> short_buffer(kBlocks);
  EXPECT_EQ(v1->initial_hints(dynamic, short_buffer.data(), kBlocks - 1), SP_ERR_INVALID_ARGUMENT);
  v1->destroy(dynamic);

  auto [off, off_routes] = initial("  mode: off\n  telemetry_enabled: false\n  force_int8_blocks: [1]\n");
  EXPECT_EQ(off_routes, std::vector<sp_precision>(kBlocks, bf16));
  v1->destroy(off);
}

TEST_F(PluginAbi, LogsGoThroughTheHostCallback) {
  sp_policy_ctx *ctx = create(v1, standalone("  mode: off\n  force_int8_blocks: [1]\n  telemetry_enabled: false\n"));
  EXPECT_EQ(log.count_containing("ignored"), 1u);
  EXPECT_EQ(log.count_containing("mode off"), 1u);
  v1->destroy(ctx);

  host.min_log_level = SP_LOG_ERROR;
  log.lines.clear();
  ctx = create(v1, yaml());
  for (int step = 0; step < 10; ++step) run_step(v1, ctx, step);
  EXPECT_TRUE(log.lines.empty()) << "nothing below the host's minimum level";
  v1->destroy(ctx);
}

}  // namespace
}  // namespace sp::policy::testing
