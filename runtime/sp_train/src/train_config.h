// The training configuration of sp-train: one YAML document with `model`, `data`, `train`
// and `memory.stagehand.{streaming, selective_precision}`. Every key of the host's sections is
// validated here; the `selective_precision` section belongs to the policy plugin, which parses
// the same text and names its own keys (the host only reads the two calibration keys it acts on).
#pragma once

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "train_error.h"

namespace sp::train {

// ConfigError: train_error.h.

// What one policy decision covers: a whole transformer block (its four matrices), or each of
// its two sublayers (attention: qkv and proj; MLP: fc and proj), so that a block's tolerant
// half can travel in a cheaper format than its sensitive one.
enum class StreamingUnit { block, sublayer };

struct ModelConfig {
  std::uint32_t d_model = 128;
  std::uint32_t n_heads = 4;
  std::uint32_t n_blocks = 6;
  std::uint32_t seq_len = 128;
  std::uint32_t mlp_ratio = 4;
  double init_std = 0.02;
  // A stress test of the policy, not a training feature: in these blocks a fresh run moves a
  // factor `outlier_magnitude` from `outlier_channels` attention value channels into the
  // attn.proj columns that read them (GptModel::plant_outlier_channels).
  std::vector<std::uint32_t> outlier_blocks;
  double outlier_magnitude = 64.0;
  std::uint32_t outlier_channels = 1;
  StreamingUnit streaming_unit = StreamingUnit::block;
};

struct DataConfig {
  std::string path = "/usr/share/common-licenses";
  // Every chunk_bytes-sized chunk whose index falls on the validation stride goes to
  // validation, so both splits sample every file.
  double val_fraction = 0.1;
  std::uint32_t chunk_bytes = 4096;
};

enum class TrainMode { full, lora };
// Where the model computes. cpu: blocks stream through the host backend (optionally paced
// like a PCIe link). cuda: through the CUDA backend into device slots, and LibTorch computes
// on the GPU over views of those slots; it needs a LibTorch built with CUDA.
enum class ComputeDevice { cpu, cuda };
// What the block's matrix products run in. The weights are always exactly what the BF16 or
// INT8 transfer delivered; fp32 widens them losslessly, bf16 computes on the slot in place
// (GPU only: the CPU build of LibTorch has no fast bf16 matmul).
enum class ComputeDtype { fp32, bf16 };
enum class ResumePolicy { auto_resume, never };
// How full mode updates the streamed masters: fused (AdamW and the image rebuild in one sweep,
// sp/kernels/adamw.h) or unfused (AdamW, then the rebuild reading the masters again: the
// reference path). Both give the same bits.
enum class HostOptimizer { fused, unfused, overlapped };
// How AdamW stores its two moments: fp32 (8 bytes per parameter), or bf16 (4 bytes), rounded to
// nearest even or stochastically (sp/kernels/adamw.h says why the latter).
enum class AdamMoments { fp32, bf16, bf16_stochastic };

struct LoraConfig {
  std::uint32_t rank = 8;
  double alpha = 16.0;
};

enum class DataParallelMode { replicated, sharded };

struct TrainLoopConfig {
  TrainMode mode = TrainMode::full;
  ComputeDevice device = ComputeDevice::cpu;
  ComputeDtype compute_dtype = ComputeDtype::fp32;
  std::int64_t steps = 200;
  std::uint32_t batch_size = 16;
  double lr = 3e-3;
  double min_lr_ratio = 0.1;  // cosine decay ends at lr * min_lr_ratio
  std::int64_t lr_warmup_steps = 20;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // global L2 norm; 0 disables clipping
  HostOptimizer host_optimizer = HostOptimizer::fused;
  AdamMoments adam_moments = AdamMoments::fp32;
  std::int64_t eval_interval = 50;
  std::uint32_t eval_batches = 8;
  std::int64_t checkpoint_interval = 100;  // 0: only at the end and on SIGINT
  std::uint64_t seed = 1234;
  std::uint32_t threads = 0;  // 0: every core
  LoraConfig lora;
  std::string plugin = "sp_selective_precision";
  std::int64_t plugin_poll_steps = 1;  // 0: only on SIGHUP
  // Every this many steps (0: never), the calibration errors are measured again on the
  // trained weights (on the step's own batch) and given to the plugin.
  std::uint32_t recalibrate_every = 0;
  // Data parallelism (RANK, WORLD_SIZE from torchrun): how long a collective may wait for the
  // other ranks before the run stops with exit code 6.
  std::uint32_t collective_timeout_seconds = 300;
  // Data parallelism: how long the ranks wait for each other's checkpoint writes (rank 0's
  // main file, each rank's shard), which may take longer than any collective.
  std::uint32_t checkpoint_timeout_seconds = 3600;
  // Data parallelism: every rank keeps every block's masters and optimizer state (replicated),
  // or each keeps those of its own blocks and sends their images to the others (sharded:
  // StreamedModelOptions::shard_masters).
  DataParallelMode data_parallel = DataParallelMode::replicated;
  // How long one plugin hook may take before the plugin is quarantined (0: no deadline).
  double plugin_hook_deadline_seconds = 60.0;
  std::string calibration_cache_dir;  // empty: $XDG_CACHE_HOME/sp-train or ~/.cache/sp-train
  // A checkpoint of the same model shape whose weights replace the random initialization
  // (e.g. LoRA on a base trained in full mode); empty: random. A resume ignores it.
  std::string init_checkpoint;
  ResumePolicy resume = ResumePolicy::auto_resume;
};

struct StreamingSection {
  std::uint32_t prefetch_window = 2;
  std::uint32_t int8_group_size = 64;
  std::uint32_t spare_slabs = 2;
  double bandwidth_cap_gbps = 0.0;  // host backend pacing; 0: memcpy speed
  std::string metrics_file = "transfer_metrics.jsonl";
  // A policy file from `sp-bench merge-policy`: a block takes the INT8 path only where it
  // also says INT8 pays for the block's size on this machine. Empty: the plugin alone decides.
  std::string transfer_policy_path;
};

// The policy keys the host acts on (the plugin validates them too): it runs the calibration
// pass, and it owns the run directory where the plugin's telemetry lands.
struct PolicyHostKeys {
  bool run_calibration = true;
  std::uint32_t calibration_samples = 4;
  // Elements per bf16 scale of the NF4 images: 32, 64, 128 or 256 (NF4 has no per-row mode).
  std::uint32_t nf4_group_size = 64;
  bool telemetry_enabled = true;
  std::string telemetry_file = "selective_precision_telemetry.jsonl";
};

// The most optimizer steps a run may have (train.steps, and so a checkpoint's next_step).
inline constexpr std::int64_t kMaxSteps = std::int64_t{1} << 40;

// The files sp-train itself writes in the run directory. The two configurable logs
// (streaming.metrics_file, the policy's telemetry_file) must be other plain file names there:
// the run cuts its logs back when it starts, and must never cut anything else.
inline constexpr const char* kRunConfigFile = "config.yaml";
inline constexpr const char* kRunTrainMetricsFile = "train_metrics.jsonl";
inline constexpr const char* kRunCheckpointFile = "checkpoint.bin";
inline constexpr const char* kRunSummaryFile = "summary.json";

struct TrainConfig {
  ModelConfig model;
  DataConfig data;
  TrainLoopConfig train;
  StreamingSection streaming;
  PolicyHostKeys policy_keys;
  // The whole document after overrides, as YAML text: handed to the plugin's create() and
  // saved beside the run.
  std::string resolved_yaml;
  std::string source_name;
};

// "key.path=value" from --set; the value is parsed as YAML ("3", "[0, 1]", "off").
struct Override {
  std::string key_path;
  std::string value;
  // How the user wrote it ("--set train.steps=3", "--steps"); messages about the key name
  // this instead of the config file. Empty: "--set key.path=value".
  std::string given_as = {};
  // The value is a string as it stands, not YAML: a path like "corpus #2.txt" must not lose
  // its " #2.txt" to a YAML comment.
  bool literal = false;
};
// Splits "a.b=c"; throws ConfigError naming the argument when there is no '=' or no key.
Override parse_override(const std::string& argument);

// Parses `text` (named `source_name` in messages), applies the overrides in order, validates.
TrainConfig parse_train_config(const std::string& text, const std::string& source_name,
                               const std::vector<Override>& overrides = {});
// Reads the file first; a missing or unreadable file is a ConfigError naming it.
TrainConfig load_train_config(const std::filesystem::path& file, const std::vector<Override>& overrides = {});

const char* mode_name(TrainMode mode);
const char* compute_device_name(ComputeDevice device);
const char* streaming_unit_name(StreamingUnit unit);
const char* compute_dtype_name(ComputeDtype dtype);
const char* host_optimizer_name(HostOptimizer optimizer);
const char* adam_moments_name(AdamMoments moments);
const char* data_parallel_name(DataParallelMode mode);

}  // namespace sp::train
