// The sp-train training loop, free of LibTorch in its interface so that the CLI and the tests
// compile quickly. sp-train is one host of the LibTorch layer (sp/torch_layer/streamed_model.h):
// it owns the CLI's config, the corpus, the GPT model, AdamW, the run directory, checkpoints
// and the summary; the layer streams the blocks and drives the policy. Per step:
//   layer.begin_step -> embed -> layer.forward (blocks fetched on the routes decided) -> head
//   loss -> loss.backward() (the layer fetches the blocks again in reverse, recomputes and
//   differentiates each; master gradients land in their .grad) -> layer.post_backward
//   (gradient moments to the plugin, its hints to the engines) -> AdamW -> layer.end_step
//   (images of the updated masters rebuilt for their next routes; the plugin's end_step).
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sp/precision.h"

#include "calibration_cache.h"
#include "progress.h"

#include "train_config.h"
#include "train_error.h"

namespace spdlog {
class logger;
}

namespace sp::train {

// ResumeError, DivergedError: train_error.h.

struct StepRecord {
  std::int64_t step = 0;
  double loss = 0.0;
  double lr = 0.0;
  double grad_norm = 0.0;
  // The route each block's fetches took during this step, in the ABI's sp_precision codes
  // (0 = BF16, 1 = INT8, 2 = NF4) that metrics.jsonl and the checkpoint carry (sp::to_abi).
  std::vector<std::uint8_t> routes;
  // The plugin's decision after this step's compute_hints (applies from the next step).
  std::vector<std::uint8_t> decisions;
  PerPrecision<std::uint64_t> h2d_bytes;
  std::uint64_t h2d_bytes_all_bf16 = 0;
  std::optional<double> val_loss;
  double seconds = 0.0;
  // Of `seconds`: the host's update after the backward (AdamW, the image rebuild, fused or not,
  // and the plugin's end_step).
  double update_seconds = 0.0;
  std::string plugin_version;
  std::string swap_note;  // non-empty at the step a hot swap took effect or failed
  // At the steps that re-calibrated (train.recalibrate_every): the errors and the seconds.
  std::optional<nlohmann::json> recalibration;
  // Policy v3's calibration step (the first of a fresh run with a budget and run_calibration):
  // its forward and backward ran and the policy allocated from them; no update.
  bool calibration_step = false;
};

struct RunOptions {
  std::filesystem::path out_dir;
  std::filesystem::path plugin_dir;
  std::shared_ptr<spdlog::logger> logger;
  // The progress bar; null shows none. Give `logger` a make_progress_aware_sink of the same
  // object so that log lines do not land on the bar.
  std::shared_ptr<ProgressLine> progress;
  // Set by SIGINT: checkpoint at the next step boundary and return interrupted.
  const std::atomic<bool>* stop_requested = nullptr;
  // Set by SIGHUP: look at the plugin file at the next step boundary.
  std::atomic<bool>* plugin_check_requested = nullptr;
  // Called after every step, at the step boundary (tests replace the plugin file here).
  std::function<void(const StepRecord&)> on_step;
  // Installs the crash marker's fatal-signal handlers (crash_marker.h) for this run directory.
  // The sp-train CLI does; a program embedding the Trainer keeps its own handlers. Either way a
  // marker that a previous run left is reported and removed.
  bool crash_marker = false;
};

enum class RunOutcome { completed, interrupted };

struct RunSummary {
  RunOutcome outcome = RunOutcome::completed;
  nlohmann::json json;                 // what summary.json holds
  std::vector<StepRecord> steps;       // the steps run by this process
  std::filesystem::path summary_file;  // where `json` was written (a rank's own run directory)
};

class Trainer {
 public:
  // Loads the data, builds the model, the streaming engines and the policy session, runs the
  // calibration pass (or resumes from <out>/checkpoint.bin). Throws ConfigError, DataError,
  // sp::host::PluginError, ResumeError.
  Trainer(TrainConfig config, RunOptions options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Trains to config.train.steps (or until stopped), evaluates, checkpoints, writes
  // summary.json. Throws DivergedError.
  RunSummary run();

  // The step the next run() starts at (> 0 after a resume).
  std::int64_t next_step() const;
  // "hit", "computed (<why>)", "disabled", "restored from checkpoint" or "re-calibrated at step N".
  const std::string& calibration_status() const;
  const CalibrationErrors& calibration_errors() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Path of the run directory's checkpoint.
std::filesystem::path checkpoint_path(const std::filesystem::path& out_dir);

}  // namespace sp::train
