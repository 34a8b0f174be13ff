// sp-replay: runs a policy plugin, through the host library, on a recorded trace of
// per-block gradient moments, and writes the precision each block would have had. It is
// how thresholds are tuned offline: the same .so and the same host code as in training.

#include <unistd.h>

#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <yaml-cpp/yaml.h>

#include "sp/runtime/cli_output_file.h"
#include "sp/input_files/read_file.h"
#include "replay_inputs.h"
#include "sp/host/policy_host.h"
#include "sp/precision_abi.h"
#include "sp/runtime/atomic_file.h"
#include "sp/runtime/plugin_dir.h"
#include "sp/runtime/write_all.h"

namespace fs = std::filesystem;

namespace {

// Exit codes, also listed in --help.
constexpr int kExitOk = 0;
constexpr int kExitInternal = 1;
constexpr int kExitBadInput = 2;
constexpr int kExitPluginLoad = 3;
constexpr int kExitPluginFailed = 4;

constexpr const char* kExitCodeHelp =
    "Exit codes: 0 success; 1 internal error; 2 bad arguments or input file (trace, "
    "calibration, config); 3 the plugin could not be loaded or rejected the config; 4 a "
    "plugin hook failed during the replay (no output is written).";

struct Options {
  fs::path config;
  uint32_t blocks = 0;
  fs::path trace;
  fs::path calibration;
  fs::path plugin_dir;
  std::string plugin = "sp_selective_precision";
  fs::path out;
  fs::path telemetry;
};

class ReplayFailure : public sp::ErrorAs<std::runtime_error> {
 public:
  ReplayFailure(int exit_code, const std::string& message)
      : ErrorAs(exit_code == kExitBadInput ? sp::ErrorKind::bad_input : sp::ErrorKind::plugin, message),
        exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

std::string read_text(const fs::path& path, const char* what) {
  try {
    return sp::input_files::read_whole_file(path, what);
  } catch (const sp::input_files::FileReadError& e) {
    throw ReplayFailure(kExitBadInput, e.what());
  }
}

// The replay decides where telemetry goes: into --telemetry, or nowhere, so that a run
// never drops files into the working directory. The config's section is found where the
// plugin looks for it; anything malformed is left for the plugin to report.
// The original stdout, set aside in main() before the plugin is loaded (-1: --out is used).
int g_decisions_fd = -1;

void write_decisions_to_stdout(const std::string& text) {
  if (const int error = sp::runtime::write_all(g_decisions_fd, text.data(), text.size())) {
    throw std::runtime_error(fmt::format("writing the decisions to stdout failed: {}", std::strerror(error)));
  }
}

std::string with_replay_telemetry(const std::string& config_text, const Options& options) {
  YAML::Node root;
  try {
    root = YAML::Load(config_text);
  } catch (const YAML::Exception& e) {
    throw ReplayFailure(kExitBadInput, fmt::format("{}: not valid YAML: {}", options.config.string(), e.what()));
  }
  if (!root.IsMap()) return config_text;
  YAML::Node section = root["selective_precision"];
  if (!section.IsDefined()) {
    YAML::Node memory = root["memory"];
    if (!memory.IsMap() || !memory["stagehand"].IsMap()) return config_text;
    section = memory["stagehand"]["selective_precision"];
  }
  // A null section is the plugin's defaults, telemetry included: it must be turned off too.
  if (section.IsDefined() && section.IsNull()) section = YAML::Node(YAML::NodeType::Map);
  if (!section.IsMap()) return config_text;
  section["telemetry_enabled"] = !options.telemetry.empty();
  if (!options.telemetry.empty()) section["telemetry_file"] = fs::absolute(options.telemetry).string();
  YAML::Emitter out;
  out << root;
  return out.c_str();
}

std::vector<sp::host::BlockDescription> describe_blocks(uint32_t n) {
  std::vector<sp::host::BlockDescription> blocks(n);
  for (uint32_t i = 0; i < n; ++i) {
    blocks[i].id = i;
    blocks[i].name = fmt::format("block{}", i);
  }
  return blocks;
}

// A hint's route; the host has checked every hint's precision against the ABI.
sp::Precision route_of(sp_precision precision) { return sp::from_abi(precision).value_or(sp::Precision::bf16); }

struct ReplayTally {
  uint64_t steps = 0;
  sp::PerPrecision<uint64_t> block_steps;
  uint64_t precision_changes = 0;
  std::vector<sp_precision> last;
};

void check_no_hook_failed(const sp::host::PolicyHost& host, int64_t step, const char* hook) {
  if (host.hook_failures().total() != 0 || host.last_hint_source() != sp::host::HintSource::plugin) {
    throw ReplayFailure(kExitPluginFailed,
                        fmt::format("the plugin failed in {} at step {} (see the log above); the "
                                    "replay stops because its decisions would be the host's fallback",
                                    hook, step));
  }
}

// The replay's outputs must not land on its inputs, nor on each other.
void check_outputs_are_not_inputs(const Options& options) {
  const std::pair<const char*, const fs::path*> inputs[] = {
      {"--trace", &options.trace}, {"--config", &options.config}, {"--calibration", &options.calibration}};
  const std::pair<const char*, const fs::path*> outputs[] = {{"--out", &options.out},
                                                             {"--telemetry", &options.telemetry}};
  for (const auto& [output_flag, output] : outputs) {
    if (output->empty()) continue;
    std::error_code ignored;
    for (const auto& [input_flag, input] : inputs) {
      if (!input->empty() && fs::equivalent(*output, *input, ignored)) {
        throw ReplayFailure(kExitBadInput, fmt::format("{} {} is also the {}; it would be overwritten", output_flag,
                                                       output->string(), input_flag));
      }
    }
  }
  if (!options.out.empty() && options.out == options.telemetry) {
    throw ReplayFailure(kExitBadInput, fmt::format("--out and --telemetry are both {}", options.out.string()));
  }
}

int run(const Options& options, std::shared_ptr<spdlog::logger> logger) {
  check_outputs_are_not_inputs(options);
  std::ifstream trace_in;
  try {
    trace_in = sp::input_files::open_input_file(options.trace, "trace");
  } catch (const sp::input_files::FileReadError& e) {
    throw ReplayFailure(kExitBadInput, e.what());
  }
  std::optional<sp::replay::CalibrationFile> calibration;
  if (!options.calibration.empty()) {
    calibration = sp::replay::read_calibration_file(options.calibration.string(), options.blocks);
  }
  const std::string config_text = with_replay_telemetry(read_text(options.config, "config"), options);

  const fs::path plugin_file = options.plugin_dir / ("lib" + options.plugin + ".so");
  sp::host::PolicyHostOptions host_options;
  host_options.host_name = "sp-replay";
  host_options.logger = logger;
  // The replay moves no bytes; it stands for a host that can transfer every precision.
  host_options.supported_precisions = sp::abi_mask_of_all();
  std::unique_ptr<sp::host::PolicyHost> host;
  try {
    host = std::make_unique<sp::host::PolicyHost>(plugin_file,
                                                  sp::host::PolicyConfig{config_text, options.config.string()},
                                                  describe_blocks(options.blocks), host_options);
  } catch (const sp::host::PluginError& e) {
    throw ReplayFailure(kExitPluginLoad, e.what());
  }
  logger->info("loaded plugin {} {} from {}", host->plugin_name(), host->plugin_version(), plugin_file.string());

  if (calibration) {
    for (const sp::Precision tier : sp::kQuantizedPrecisions) {
      const sp::replay::BlockErrors& errors = calibration->errors[tier];
      if (errors.block_ids.empty()) continue;
      if (!host->set_calibration_errors(sp::to_abi(tier), errors.block_ids, errors.errors)) {
        throw ReplayFailure(kExitPluginFailed, fmt::format("the plugin rejected the {} errors of {}",
                                                           sp::precision_name(tier), options.calibration.string()));
      }
    }
  }

  // Output is collected and written at the end, atomically: a replay that stops halfway
  // leaves no half file that looks complete.
  std::ostringstream decisions;
  sp::replay::TraceReader reader(trace_in, options.trace.string(), options.blocks);
  ReplayTally tally;
  tally.last.assign(options.blocks, SP_PRECISION_BF16);
  while (const auto step = reader.next()) {
    host->begin_step(step->step);
    host->post_backward(step->step, step->moments);
    const std::vector<sp_hint_v1>& hints = host->compute_hints(step->step);
    check_no_hook_failed(*host, step->step, "begin_step/post_backward/compute_hints");
    nlohmann::json precision = nlohmann::json::array();
    for (const sp_hint_v1& hint : hints) {
      precision.push_back(sp::precision_name(route_of(hint.precision)));
      tally.block_steps[route_of(hint.precision)] += 1;
      tally.precision_changes += hint.precision != tally.last[hint.block_id];
      tally.last[hint.block_id] = hint.precision;
    }
    decisions << nlohmann::json{{"step", step->step}, {"precision", precision}}.dump() << '\n';
    sp_step_feedback_v1 feedback{};
    feedback.loss = step->loss;
    feedback.step_seconds = std::nan("");
    host->end_step(step->step, &feedback);
    check_no_hook_failed(*host, step->step, "end_step");
    ++tally.steps;
  }
  if (tally.steps == 0) {
    throw ReplayFailure(kExitBadInput,
                        fmt::format("{}: the trace holds no steps; nothing to replay", options.trace.string()));
  }

  if (options.out.empty()) {
    write_decisions_to_stdout(decisions.str());
  } else {
    sp::runtime::write_file_atomically(options.out, decisions.str());
  }

  // Each route by the first letter of its label: B, I, N.
  std::string final_map;
  sp::PerPrecision<uint32_t> now;
  for (sp_precision p : tally.last) {
    final_map += sp::route_traits(route_of(p)).label[0];
    now[route_of(p)] += 1;
  }
  const double block_steps = static_cast<double>(tally.steps) * options.blocks;
  // A trace carries no tensor shapes, so the saving uses the nominal payload ratios against
  // BF16: the codes' bits per weight (1/2 for INT8, 1/4 for NF4; scales and headers not counted).
  double nominal_saving = 0.0;
  std::string legend, counts, shares;
  for (const sp::RouteTraits& route : sp::kRouteTraits) {
    const double share = static_cast<double>(tally.block_steps[route.precision]) / block_steps;
    nominal_saving +=
        share * (1.0 - static_cast<double>(route.code_bits) / sp::route_traits(sp::Precision::bf16).code_bits);
    legend += fmt::format("{}{}={}", legend.empty() ? "" : ", ", route.label[0], route.name);
    if (sp::is_quantized(route.precision)) {
      shares += fmt::format("{}{} {:.1f}%", shares.empty() ? "" : ", ", route.label, 100.0 * share);
    }
  }
  logger->info("replayed {} steps of {} blocks: {} precision changes", tally.steps, options.blocks,
               tally.precision_changes);
  // From the least precise route up, as the line has always read: "0 NF4, 1 INT8, 3 BF16".
  for (auto route = sp::kRouteTraits.rbegin(); route != sp::kRouteTraits.rend(); ++route) {
    counts += fmt::format("{}{} {}", counts.empty() ? "" : ", ", now[route->precision], route->label);
  }
  logger->info("final precision ({}): {} ({})", legend, final_map, counts);
  logger->info("share of block transfers: {} -> about {:.1f}% fewer H2D payload bytes than all-BF16", shares,
               100.0 * nominal_saving);
  if (!options.out.empty()) logger->info("decisions written to {}", options.out.string());
  if (!options.telemetry.empty()) logger->info("telemetry written to {}", options.telemetry.string());
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  options.plugin_dir = sp::runtime::default_plugin_dir();
  std::string route_names, error_keys, error_labels;
  for (const sp::RouteTraits& route : sp::kRouteTraits) {
    route_names += fmt::format("{}\"{}\"", route_names.empty() ? "" : "|", route.name);
    if (!sp::is_quantized(route.precision)) continue;
    error_keys +=
        fmt::format("\"{}\": {{\"<id>\": error, ...}}, ", sp::replay::calibration_errors_key(route.precision));
    error_labels += fmt::format("{}{}", error_labels.empty() ? "" : ", ", route.label);
  }
  CLI::App app{fmt::format(
      "sp-replay: replays a recorded gradient-moment trace through a policy plugin and prints the "
      "precision of every block after each step's compute_hints, one JSON line per step:\n"
      "  {{\"step\": s, \"precision\": [{}, ...]}}\n"
      "Trace lines: {{\"step\": s, \"blocks\": [{{\"id\", \"sum_sq\", \"sum\", \"max_abs\", \"count\", "
      "\"nonfinite\"}}, ...], \"loss\": l}}, steps 0, 1, 2, ...; a block that is not listed had no gradient; "
      "\"loss\" (optional, null = unknown) is the step's training loss, handed to the plugin's end_step.\n"
      "Calibration file: {{{}...}}: relative output errors against BF16 of each quantized route ({}); any "
      "object may be left out, not all.",
      route_names, error_keys, error_labels)};
  app.footer(kExitCodeHelp);
  app.add_option("--config", options.config,
                 "YAML with a top-level `selective_precision` section, or a training config with "
                 "`memory.stagehand.selective_precision`")
      ->required();
  app.add_option("--blocks", options.blocks, "number of blocks")->required()->check(CLI::Range(1u, 1u << 20));
  app.add_option("--trace", options.trace, "gradient-moment trace, JSON Lines")->required();
  app.add_option("--calibration", options.calibration, "per-block calibration errors per quantized route, JSON");
  app.add_option("--plugin-dir", options.plugin_dir, "directory holding the plugin .so")->capture_default_str();
  app.add_option("--plugin", options.plugin, "plugin to load: <plugin-dir>/lib<NAME>.so")->capture_default_str();
  app.add_option("--out", options.out, "write the decisions here (atomically) instead of stdout")
      ->check(sp::runtime::output_file());
  app.add_option("--telemetry", options.telemetry,
                 "write the plugin's telemetry JSONL here; without it, telemetry is off")
      ->check(sp::runtime::output_file());
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitBadInput;
  }

  // Decisions on stdout travel on a descriptor of their own: the plugin runs in this process,
  // and whatever it prints on stdout goes to stderr instead of into the decisions.
  if (options.out.empty()) {
    g_decisions_fd = ::dup(STDOUT_FILENO);
    if (g_decisions_fd < 0 || ::dup2(STDERR_FILENO, STDOUT_FILENO) < 0) {
      std::fprintf(stderr, "sp-replay: cannot set stdout aside for the decisions: %s\n", std::strerror(errno));
      return kExitInternal;
    }
  }
  auto logger = spdlog::stderr_color_mt("sp-replay");
  logger->set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
  try {
    return run(options, logger);
  } catch (const ReplayFailure& e) {
    logger->error("{}", e.what());
    return e.exit_code();
  } catch (const sp::replay::InputError& e) {
    logger->error("{}", e.what());
    return kExitBadInput;
  } catch (const std::exception& e) {
    logger->error("{}", e.what());
    return kExitInternal;
  }
}
