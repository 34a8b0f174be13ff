// Trainer::Impl, the state of one sp-train run, shared by the files that hold its jobs:
//   trainer_setup.cpp       the ranks, the run directory, the layer and the optimizer, calibration;
//   trainer_checkpoint.cpp  writing, reading and restoring checkpoints;
//   trainer.cpp             the step, the loop and what the run reports.
// Private to sp-train (trainer.h is its interface).
#pragma once

#include "trainer.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "adamw.h"
#include "calibration_cache.h"
#include "checkpoint_file.h"
#include "checkpoint_meta.h"
#include "gpt_model.h"
#include "host_memory.h"
#include "progress.h"
#include "crash_marker.h"
#include "run_lock.h"
#include "sp/adapters/metrics.h"
#include "sp/precision_abi.h"
#include "sp/runtime/atomic_file.h"
#include "sp/runtime/hash.h"
#include "sp/torch_layer/streamed_model.h"
#include "text_corpus.h"

namespace sp::train {
namespace fs = std::filesystem;
namespace ad = sp::adapters;
namespace tl = sp::torch_layer;
using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Trainer::Impl {
  TrainConfig config;
  RunOptions options;
  std::shared_ptr<spdlog::logger> log;
  std::uint32_t n_blocks = 0;  // transformer blocks
  std::uint32_t n_units = 0;   // streaming units: what the plugin decides for (model.streaming_unit)

  // Data parallelism: the ranks (null in one process), and this rank's own run directory
  // (--out itself on rank 0, --out/rank<r> on the others; the checkpoint is rank 0's alone).
  std::shared_ptr<tl::Collectives> collectives;
  fs::path run_dir;
  std::unique_ptr<RunDirectoryLock> run_lock;
  std::optional<std::string> previous_crash;  // what the crash marker of the run before said
  std::unique_ptr<TextCorpus> corpus;
  std::unique_ptr<GptModel> model;
  torch::TensorOptions compute;             // device and dtype of the model's math
  std::uint64_t resident_before_build = 0;  // VmRSS with LibTorch and the corpus loaded, before the model
  // The streamed blocks: engines, masters, autograd, the policy session.
  std::unique_ptr<tl::StreamedModel> layer;
  std::vector<torch::Tensor> master_grads;  // full mode: the masters' .grad, which AdamW reads
  std::unique_ptr<AdamW> adam;
  std::vector<std::size_t> adam_resident;  // resident index -> adam index
  std::vector<std::size_t> adam_masters;   // full mode: adam indices of the masters
  // Full mode, fused host optimizer: each streaming unit's masters' moments by parameter name.
  std::vector<std::map<std::string, tl::MasterMoments>> unit_moments;
  std::vector<std::size_t> non_adapter_resident;  // resident tensors outside the block moments
  std::unique_ptr<ad::MetricsJsonlWriter> train_metrics;

  std::int64_t next_step = 0;
  std::string calibration_status = "disabled";
  CalibrationErrors calibration_errors;
  // A fresh run under a policy with a budget (v3) and run_calibration: its first step is a
  // calibration step, whose gradients the policy allocates from and whose update is skipped.
  bool calibration_step_due = false;
  int nonfinite_streak = 0;
  std::optional<double> previous_grad_norm;  // the last finite one: the overlapped update's clipping
  std::uint64_t checkpoint_exchanges = 0;    // names each agreement on a checkpoint write

  // Totals over the whole run, carried across resumes.
  struct Totals {
    PerPrecision<std::uint64_t> h2d;
    std::uint64_t h2d_all_bf16 = 0;
    // Of the runs before a resume; this one's are the layer's counters.
    std::uint64_t eval_h2d_before = 0, calibration_h2d_before = 0;
    std::uint64_t tokens = 0;
    PerPrecision<std::uint64_t> block_steps;
    double train_seconds = 0.0;
    double update_seconds = 0.0;
    std::vector<std::pair<std::int64_t, double>> val_history;
    std::vector<nlohmann::json> swaps;
    double last_loss = NAN;
  } totals;

  Impl(TrainConfig cfg, RunOptions opts);

  // torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): one rank of a
  // data-parallel run over Gloo (and NCCL for the gradients on a GPU, where the build has it);
  // without them, the one process.
  void join_ranks();

  // The run's largest parts in host memory, estimated before any of them is allocated, against
  // what the machine has available (which what the process holds already is not part of): a
  // model far larger than memory is refused by name instead of meeting the OOM killer minutes
  // later.
  void refuse_what_cannot_fit() const;

  // Before anything is built: every rank must run the same config, plugin build and step, or
  // they would part at a collective minutes later (a hang until its timeout, or a hint
  // mismatch). Rank 0's config text and the digests of the rest are broadcast; each rank
  // compares, and all learn which ranks differ and in what. A rank's own --out and data
  // position are not compared: they differ by design.
  void agree_across_ranks();

  // Where two config texts part, as " (config line N: rank 0 'a', this rank 'b')".
  static std::string first_difference(const std::string& rank0, const std::string& own);

  fs::path plugin_file() const { return options.plugin_dir / ("lib" + config.train.plugin + ".so"); }

  int rank() const { return collectives ? collectives->rank() : 0; }
  int world_size() const { return collectives ? collectives->size() : 1; }
  // The ranks the masters are spread over: the world size when sharded, else 1.
  std::uint32_t shards() const {
    return config.train.data_parallel == DataParallelMode::sharded ? static_cast<std::uint32_t>(world_size()) : 1;
  }
  // Whether `ok` holds on every rank; where it does not, the lowest rank where it fails (every
  // rank learns it, so that all take the same branch after a step that can fail on one).
  std::optional<int> first_failing_rank(bool ok, const std::string& what);

  // The requests signals left for this step boundary (stop: SIGINT or SIGTERM; look at the
  // plugin file: SIGHUP), each set when any rank has it, agreed in one collective.
  struct BoundaryRequests {
    bool stop = false;
    bool check_plugin = false;
  };
  BoundaryRequests boundary_requests() const;

  void prepare_run_directory() const;

  std::optional<CheckpointSections> find_checkpoint();

  nlohmann::json model_identity() const;

  // The model's weights from another run's checkpoint: the same shape is required, the mode
  // may differ. Tensors the checkpoint does not have (LoRA adapters of a full-mode base) keep
  // their initialization.
  void load_initial_weights(const fs::path& file);

  // The streamed blocks go to the LibTorch layer, which sizes the engines from their shapes
  // and opens the policy session.
  void build_layer();

  static MomentStorage moment_storage(AdamMoments moments);

  void build_optimizer();

  // The plugin's hints in force, one sp_precision per block (BF16 before its first hints).
  std::vector<std::uint8_t> decisions() const;
  // The run summary's "calibration": its status and the errors per quantized route.
  nlohmann::json calibration_summary() const;

  std::uint64_t eval_h2d() const { return totals.eval_h2d_before + layer->evaluation_h2d_bytes(); }
  std::uint64_t calibration_h2d() const { return totals.calibration_h2d_before + layer->calibration_h2d_bytes(); }

  std::pair<torch::Tensor, torch::Tensor> tensors_of(std::vector<std::int64_t>& tokens, std::uint32_t batch) const;

  double evaluate();

  // ---- calibration -----------------------------------------------------------------------

  // What the calibration errors depend on, from the model's initial weights (before the layer
  // takes them over).
  nlohmann::json calibration_identity();

  // The first-block inputs calibration measures on: the embeddings of its own batches.
  std::vector<torch::Tensor> calibration_samples();

  void calibrate(const nlohmann::json& identity);

  // ---- the training step -----------------------------------------------------------------

  double learning_rate(std::int64_t step) const;

  // Global gradient norm for clipping: the block moments already hold the streamed (or
  // adapter) part; the resident tensors that are not adapters add theirs. Returns NaN when any
  // gradient element is not finite.
  double global_grad_norm(const std::vector<sp_grad_moments_v1>& moments) const;

  // AdamW over the resident tensors, then over the masters. Fused, each unit's masters are
  // updated in the sweep that writes its next transfer image; unfused, the layer rebuilds the
  // images of the updated masters at end_step, in the precision each block travels next.
  double clip_scale(double grad_norm) const;

  void update_resident();

  void optimizer_step(double lr, double grad_norm);

  StepRecord train_step(std::int64_t step);

  void note_swap(std::int64_t step, const sp::host::SwapResult& swap, StepRecord& record);

  // `forced` is the same on every rank (boundary_requests), so every rank takes the same
  // branch: the layer's poll is a collective.
  void poll_plugin(std::int64_t step, bool forced);

  // ---- checkpoint ------------------------------------------------------------------------

  nlohmann::json totals_json() const;

  // Sharded, each rank's masters and their AdamW moments go to a file of its own, named by the
  // checkpoint's step, in its run directory; the main checkpoint names that step.
  fs::path shard_path(std::int64_t step) const { return run_dir / fmt::format("{}{}.bin", kShardPrefix, step); }
  static constexpr const char* kShardPrefix = "checkpoint.shard-step";

  static bool is_master_entry(const std::string& key) { return key.rfind("master/", 0) == 0; }

  // Rank 0 writes the replicated state; a rank's own state is its data position, which is
  // the step and its rank. Sharded, every rank first writes its shard; rank 0 writes the main
  // file (which makes the checkpoint the current one) only once every shard is on disk, and
  // the shards of older checkpoints go only once the main file names the new ones. The ranks
  // wait for each other's writes up to train.checkpoint_timeout_seconds, not the collectives'
  // timeout: a large checkpoint may take longer to write than any collective should wait. They
  // first meet within the collectives' timeout, so that a rank that died before the write is
  // noticed as soon as in a collective.
  void save_checkpoint();

  // Every rank learns every rank's outcome of one part of a checkpoint write (empty: written),
  // waiting up to train.checkpoint_timeout_seconds; a failure anywhere is thrown everywhere.
  void agree_on_checkpoint(const char* part, const std::string& failure);

  // AdamW's moments of parameter `i`, written from the optimizer's own buffers.
  void put_moments(CheckpointSections& out, std::size_t i);

  void write_main_checkpoint(const std::map<std::string, torch::Tensor>& layer_state);

  // This rank's shards of checkpoints other than `keep`'s, and temporaries a killed write left.
  void remove_other_shards(std::int64_t keep);

  // Sharded: this rank's shard of the checkpoint at `step`, its sections checked against it.
  // Every rank learns whether every rank could read its own, so that none waits for another
  // in the restore that follows.
  CheckpointSections read_shard(std::int64_t step);

  // The layer's state entries from the checkpoint sections of the same names, each shaped as
  // the layer's own export shows (a 1-D byte entry takes the section's length).
  std::map<std::string, torch::Tensor> read_layer_state(const CheckpointSections& in) const;

  void restore(const CheckpointSections& main);

  // ---- the run ---------------------------------------------------------------------------

  void write_step_record(const StepRecord& r);

  nlohmann::json summary(RunOutcome outcome, double wall_seconds) const;

  RunSummary run();
};

}  // namespace sp::train
