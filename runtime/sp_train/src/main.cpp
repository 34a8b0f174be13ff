// sp-train: trains a byte-level GPT whose transformer blocks stream through the adapters,
// with the Selective Precision plugin choosing each block's route. See docs/training.md.

#include <csignal>

#include <atomic>
#include <filesystem>
#include <iostream>

#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <spdlog/spdlog.h>

#include "checkpoint_file.h"
#include "error_report.h"
#include "progress.h"
#include "sp/host/plugin_library.h"
#include "sp/precision.h"
#include "text_corpus.h"
#include "train_config.h"
#include "trainer.h"
#include "sp/runtime/plugin_dir.h"

namespace fs = std::filesystem;

namespace {

using sp::train::ExitCode;

// Exit codes (sp::train::ExitCode), also listed in --help and docs/training.md.
constexpr int exit_code(ExitCode code) { return static_cast<int>(code); }
constexpr int kExitOk = exit_code(ExitCode::ok);
constexpr int kExitBadConfig = exit_code(ExitCode::bad_config);
constexpr int kExitInterrupted = exit_code(ExitCode::interrupted);

constexpr const char* kFooter =
    "Exit codes: 0 training finished; 1 internal error (a bug, or a failure outside sp-train's "
    "checks such as a file it cannot write); 2 bad command line or config (the "
    "message names the file and key); 3 the policy plugin could not be loaded or rejected its "
    "config section; 4 unusable data path or checkpoint; 5 the loss diverged (non-finite for 8 "
    "steps in a row); 6 data-parallel training stopped (a rank died or stalled, or the ranks' "
    "decisions differed); 7 the CUDA runtime or driver failed; 130 interrupted by SIGINT, 143 by SIGTERM, after writing a checkpoint (run the same command "
    "again to resume).\n"
    "Signals: SIGINT and SIGTERM checkpoint at the next step boundary and exit; SIGHUP makes the trainer "
    "look for a new plugin version at the next step boundary.\n"
    "The run directory holds config.yaml, train_metrics.jsonl, transfer_metrics.jsonl, the "
    "plugin's telemetry, checkpoint.bin and summary.json. A run directory that holds a "
    "checkpoint is resumed (train.resume: never starts over).";

std::atomic<bool> g_stop{false};
std::atomic<int> g_stop_signal{0};
std::atomic<bool> g_plugin_check{false};

// SIGINT (Ctrl-C) and SIGTERM (what schedulers and `docker stop` send) both stop the run at the
// next step boundary with a checkpoint.
extern "C" void on_stop_signal(int signal) {
  g_stop_signal.store(signal);
  g_stop.store(true);
  // A second Ctrl-C kills; a repeated SIGTERM (a scheduler and torchrun's agent may both send
  // one) still waits for the checkpoint.
  if (signal == SIGINT) std::signal(SIGINT, SIG_DFL);
}
extern "C" void on_sighup(int) { g_plugin_check.store(true); }

}  // namespace

int main(int argc, char** argv) {
  fs::path config_file;
  std::string data;
  std::int64_t steps = 0;
  std::string seed;
  fs::path out = "sp-train-run";
  fs::path plugin_dir = sp::runtime::default_plugin_dir();
  std::vector<std::string> sets;

  CLI::App app{
      "sp-train: trains a byte-level GPT whose transformer blocks stream host->device one at a "
      "time, forward and backward, while the Selective Precision plugin (loaded from the plugin "
      "directory) decides per block the precision it travels in."};
  app.footer(kFooter);
  app.add_option("--config", config_file, "training config YAML (model, data, train, memory.stagehand.*); see configs/")
      ->required();
  auto* data_option = app.add_option("--data", data, "text file or directory to train on (overrides data.path)");
  auto* steps_option = app.add_option("--steps", steps, "total optimizer steps (overrides train.steps)")
                           ->check(CLI::Range(std::int64_t{1}, sp::train::kMaxSteps));
  // Kept as text and checked as train.seed is: CLI11 saturates an integer that overflows.
  auto* seed_option = app.add_option("--seed", seed, "seed of init, batches and calibration (overrides train.seed)");
  app.add_option("--out", out, "run directory: metrics, telemetry, checkpoint, summary.json")->capture_default_str();
  app.add_option("--plugin-dir", plugin_dir, "directory holding lib<train.plugin>.so; watched for new versions")
      ->capture_default_str();
  app.add_option("--set", sets,
                 "override a config key, e.g. --set train.mode=lora --set "
                 "memory.stagehand.selective_precision.mode=off (repeatable; value is YAML)")
      ->take_all()
      ->allow_extra_args(false);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitBadConfig;
  }

  auto progress = std::make_shared<sp::train::ProgressLine>(stdout, true);
  auto logger = std::make_shared<spdlog::logger>("sp-train", sp::train::make_progress_aware_sink(progress, stderr));
  try {
    std::vector<sp::train::Override> overrides;
    for (const std::string& s : sets) overrides.push_back(sp::train::parse_override(s));
    if (*data_option) overrides.push_back({"data.path", data, "--data", /*literal=*/true});
    if (*steps_option) overrides.push_back({"train.steps", std::to_string(steps), "--steps"});
    if (*seed_option) overrides.push_back({"train.seed", seed, "--seed"});
    sp::train::TrainConfig config = sp::train::load_train_config(config_file, overrides);

    std::signal(SIGINT, on_stop_signal);
    std::signal(SIGTERM, on_stop_signal);
    std::signal(SIGHUP, on_sighup);
    sp::train::RunOptions options;
    options.out_dir = out;
    options.plugin_dir = plugin_dir;
    options.crash_marker = true;
    options.logger = logger;
    options.progress = progress;
    options.stop_requested = &g_stop;
    options.plugin_check_requested = &g_plugin_check;
    sp::train::Trainer trainer(std::move(config), options);
    const sp::train::RunSummary summary = trainer.run();

    const nlohmann::json& s = summary.json;
    const auto& bytes = s["h2d_bytes"];
    logger->info("{} {} steps in {:.1f}s ({:.0f} tokens/s)",
                 summary.outcome == sp::train::RunOutcome::completed ? "finished" : "stopped at",
                 s["steps"].get<std::int64_t>(), s["wall_seconds"].get<double>(), s["tokens_per_second"].get<double>());
    if (!s["final_val_loss"].is_null()) logger->info("final validation loss {:.4f}", s["final_val_loss"].get<double>());
    std::string per_route;
    for (const sp::RouteTraits& route : sp::kRouteTraits) {
      per_route += fmt::format("{}{} {}", per_route.empty() ? "" : " + ", sp::train::format_bytes(bytes[route.name]),
                               route.label);
    }
    logger->info("H2D: {} = {}; all-BF16 would be {}: {:.1f}% saved", per_route,
                 sp::train::format_bytes(bytes["total"]), sp::train::format_bytes(bytes["all_bf16_equivalent"]),
                 100.0 * bytes["saved_fraction"].get<double>());
    logger->info("summary: {}", summary.summary_file.string());
    if (summary.outcome == sp::train::RunOutcome::completed) return kExitOk;
    return g_stop_signal.load() == SIGTERM ? exit_code(ExitCode::terminated) : kExitInterrupted;
  } catch (...) {
    const sp::train::ErrorReport report = sp::train::report_error(std::current_exception());
    logger->error("{}", report.message);
    return exit_code(report.exit_code);
  }
}
