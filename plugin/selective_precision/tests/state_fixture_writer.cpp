// Writes the state-migration fixtures of plugin/selective_precision/tests/data/: drives a
// built selective_precision plugin through its C table (as a host does), exports its state
// blob at a step boundary, then records the hints that the same plugin returns for the steps
// after that boundary. A later version of the plugin imports the blob and must return the
// same hints for the same inputs (state_migration_test.cpp).
//
//   sp_policy_state_fixture_writer PLUGIN.so OUT_DIR
//
// The committed files were written by version 1.0.0, before policy v2 changed any code.
#include <sp/plugin_abi_v1.h>

#include <dlfcn.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr std::uint32_t kBlocks = 6;

// Fixed, varied inputs: some blocks absent, some non-finite, magnitudes that cross every
// threshold of the config below.
std::vector<sp_grad_moments_v1> moments_at(std::int64_t step) {
  std::vector<sp_grad_moments_v1> moments;
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    if ((step + b) % 7 == 3) continue;
    if ((step * 3 + b) % 17 == 5) {
      moments.push_back(sp_grad_moments_v1{b, 0, 1.0, 0.0, 1.0, 1000, 3});
    } else {
      const double l2 = 0.2 + std::fabs(std::sin(0.3 * static_cast<double>(step) + b)) * b;
      moments.push_back(sp_grad_moments_v1{b, 0, l2 * l2, 0.01 * b, l2, 1000, 0});
    }
  }
  return moments;
}

std::string hex_bits(double value) {
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  char text[19];
  std::snprintf(text, sizeof text, "0x%016llx", static_cast<unsigned long long>(bits));
  return text;
}

class Plugin {
 public:
  explicit Plugin(const char *path) : handle_(dlopen(path, RTLD_NOW | RTLD_LOCAL)) {
    if (handle_ == nullptr) throw std::runtime_error(dlerror());
    auto entry = reinterpret_cast<sp_policy_plugin_entry_v1_fn>(dlsym(handle_, SP_PLUGIN_ENTRY_SYMBOL_V1));
    if (entry == nullptr) throw std::runtime_error(std::string(path) + ": no entry symbol");
    table_ = entry();
  }
  ~Plugin() { dlclose(handle_); }
  const sp_policy_plugin_v1_table *operator->() const { return table_; }

 private:
  void *handle_;
  const sp_policy_plugin_v1_table *table_ = nullptr;
};

void check(const Plugin &plugin, sp_policy_ctx *ctx, sp_status status, const char *what) {
  if (status != SP_OK) throw std::runtime_error(std::string(what) + ": " + plugin->last_error(ctx));
}

nlohmann::json run_steps(const Plugin &plugin, sp_policy_ctx *ctx, std::int64_t first, std::int64_t last) {
  nlohmann::json steps = nlohmann::json::array();
  std::vector<sp_hint_v1> hints(kBlocks);
  for (std::int64_t step = first; step <= last; ++step) {
    const std::vector<sp_grad_moments_v1> moments = moments_at(step);
    check(plugin, ctx, plugin->begin_step(ctx, step), "begin_step");
    check(plugin, ctx, plugin->post_backward(ctx, step, moments.data(), static_cast<std::uint32_t>(moments.size())),
          "post_backward");
    check(plugin, ctx, plugin->compute_hints(ctx, step, hints.data(), kBlocks), "compute_hints");
    check(plugin, ctx, plugin->end_step(ctx, step, nullptr), "end_step");
    nlohmann::json record{{"step", step}, {"moments", nlohmann::json::array()}, {"hints", nlohmann::json::array()}};
    for (const sp_grad_moments_v1 &m : moments) {
      record["moments"].push_back(
          {m.block_id, hex_bits(m.sum_sq), hex_bits(m.sum), hex_bits(m.max_abs), m.count, m.nonfinite});
    }
    for (const sp_hint_v1 &h : hints) record["hints"].push_back({h.precision, h.reason, hex_bits(h.sensitivity)});
    steps.push_back(std::move(record));
  }
  return steps;
}

std::vector<std::uint8_t> export_state(const Plugin &plugin, sp_policy_ctx *ctx) {
  std::uint64_t size = 0;
  plugin->export_state(ctx, nullptr, 0, &size);
  std::vector<std::uint8_t> blob(size);
  check(plugin, ctx, plugin->export_state(ctx, blob.data(), blob.size(), &size), "export_state");
  return blob;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s PLUGIN.so OUT_DIR\n", argv[0]);
    return 2;
  }
  try {
    const Plugin plugin(argv[1]);
    const std::string out_dir = argv[2];
    const std::string version = plugin->plugin_version;
    const std::string config =
        "selective_precision:\n  warmup_steps: 3\n  update_interval_steps: 2\n  min_steps_between_switches: 4\n"
        "  history_window: 3\n  telemetry_enabled: false\n  log_decisions: false\n  force_bf16_blocks: [5]\n";
    sp_host_api_v1 host{};
    host.struct_size = sizeof host;
    host.abi_major = SP_PLUGIN_ABI_MAJOR;
    host.abi_minor = SP_PLUGIN_ABI_MINOR;
    host.host_name = "sp_policy_state_fixture_writer";
    host.host_version = "0";
    std::vector<sp_block_desc_v1> blocks;
    nlohmann::json block_list = nlohmann::json::array();
    for (std::uint32_t b = 0; b < kBlocks; ++b) {
      blocks.push_back(sp_block_desc_v1{sizeof(sp_block_desc_v1), b, 1000 + 100ull * b, 2000 + 200ull * b,
                                        1016 + 100ull * b, nullptr});
      block_list.push_back({blocks.back().num_params, blocks.back().bf16_bytes, blocks.back().int8_bytes});
    }
    const std::vector<std::uint32_t> calibrated{0, 1, 2, 3};
    const std::vector<double> errors{0.002, 0.03, 0.08, 0.01};

    nlohmann::json fixture{{"written_by",
                            {{"plugin", plugin->plugin_name},
                             {"version", version},
                             {"abi", std::to_string(plugin->abi_major) + "." + std::to_string(plugin->abi_minor)}}},
                           {"config_yaml", config},
                           {"blocks", block_list},
                           {"scenarios", nlohmann::json::array()}};
    // Scenario "fresh": calibrated, exported before the first step. Scenario "mid_run":
    // exported after step 24, with switches, cooldowns and full windows in the state.
    struct Scenario {
      const char *name;
      std::int64_t export_after;  // -1 = before the first step
      std::int64_t continue_to;
    };
    for (const Scenario &scenario : {Scenario{"fresh", -1, 40}, Scenario{"mid_run", 24, 70}}) {
      sp_policy_ctx *ctx = nullptr;
      check(plugin, nullptr, plugin->create(&host, config.c_str(), blocks.data(), kBlocks, &ctx), "create");
      check(plugin, ctx, plugin->set_calibration_errors(ctx, calibrated.data(), errors.data(), 4), "calibration");
      if (scenario.export_after >= 0) run_steps(plugin, ctx, 0, scenario.export_after);
      const std::vector<std::uint8_t> blob = export_state(plugin, ctx);
      const std::string state_file = "policy-" + version + "-" + scenario.name + ".state";
      std::ofstream(out_dir + "/" + state_file, std::ios::binary)
          .write(reinterpret_cast<const char *>(blob.data()), static_cast<std::streamsize>(blob.size()));
      fixture["scenarios"].push_back(
          {{"name", scenario.name},
           {"state_file", state_file},
           {"exported_after_step", scenario.export_after},
           {"steps", run_steps(plugin, ctx, scenario.export_after + 1, scenario.continue_to)}});
      plugin->destroy(ctx);
    }
    std::ofstream(out_dir + "/policy-" + version + "-continuation.json") << fixture.dump(1) << "\n";
  } catch (const std::exception &error) {
    std::fprintf(stderr, "state fixture writer: %s\n", error.what());
    return 1;
  }
  return 0;
}
