#include "train_config.h"
#include "train_config_impl.h"
#include "sp/precision.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include "sp/adapters/host_backend.h"

#include "sp/yaml_diagnostics/yaml_diagnostics.h"
#include "sp/input_files/read_file.h"

namespace sp::train {
namespace {

using yaml_diagnostics::describe;
using yaml_diagnostics::is_plain_scalar;

using detail::apply_override;
using detail::count_documents;
using detail::find_unkeepable;
using detail::Origins;
using detail::refuse_lone_carriage_returns;
using detail::with_own_map;

// Reads one mapping of the document. Every message carries the source and the full key path;
// keys that the section does not know are rejected with the list of those it does.
class Section {
 public:
  // An absent section reads as an empty one. (A missing key of a const node is an invalid
  // handle that must not be assigned to, so a fresh node is returned instead.)
  static YAML::Node or_empty_map(const YAML::Node& node) {
    if (!node.IsDefined() || node.IsNull()) return YAML::Node(YAML::NodeType::Map);
    return node;
  }

  Section(const Origins& origins, std::string path, YAML::Node node, std::vector<const char*> known)
      : origins_(origins), path_(std::move(path)), node_(or_empty_map(node)), known_(std::move(known)) {
    if (!node_.IsMap()) {
      throw ConfigError(
          fmt::format("{}: {}: expected a mapping, found {}", origins_.of(path_), path_, describe(node_)));
    }
    std::vector<std::pair<std::string, YAML::Mark>> seen;
    for (const auto& entry : node_) {
      const std::string key = entry.first.Scalar();
      // yaml-cpp keeps both entries of a repeated key and reads the first: refuse, since
      // the writer most likely meant the second.
      for (const auto& [earlier, mark] : seen) {
        if (earlier == key) {
          throw ConfigError(fmt::format("{}: {}: duplicate key (lines {} and {}); keep one", origins_.of(key_path(key)),
                                        key_path(key), mark.line + 1, entry.first.Mark().line + 1));
        }
      }
      seen.emplace_back(key, entry.first.Mark());
      bool found = false;
      for (const char* k : known_) found = found || key == k;
      if (!found) {
        const std::optional<std::string_view> suggestion = yaml_diagnostics::closest_key(key, known_);
        const std::string hint = suggestion ? fmt::format("did you mean '{}'? ", *suggestion) : "";
        throw ConfigError(path_.empty()
                              ? fmt::format("{}: {}: unknown top-level key; {}expected one of: {}", origins_.of(key),
                                            key, hint, fmt::join(known_, ", "))
                              : fmt::format("{}: {}: unknown key; {}{} accepts: {}", origins_.of(key_path(key)),
                                            key_path(key), hint, path_, fmt::join(known_, ", ")));
      }
    }
  }

  [[noreturn]] void fail(const char* key, const std::string& expected, const YAML::Node& found) const {
    throw ConfigError(fmt::format("{}: {}: expected {}, found {}", origins_.of(key_path(key)), key_path(key), expected,
                                  describe(found)));
  }

  std::string key_path(std::string_view key) const {
    return path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key);
  }

  template <typename Int>
  void integer(const char* key, Int& value, std::int64_t min, std::int64_t max) const {
    const YAML::Node node = node_[key];
    if (!node.IsDefined()) return;
    const std::string expected = fmt::format("an integer in [{}, {}]", min, max);
    std::int64_t parsed = 0;
    if (!is_plain_scalar(node) || !YAML::convert<std::int64_t>::decode(node, parsed) || parsed < min || parsed > max) {
      fail(key, expected, node);
    }
    value = static_cast<Int>(parsed);
  }

  void number(const char* key, double& value, double min, double max, bool min_exclusive = false) const {
    const YAML::Node node = node_[key];
    if (!node.IsDefined()) return;
    const std::string expected = fmt::format("a number in {}{}, {}]", min_exclusive ? "(" : "[", min, max);
    double parsed = 0.0;
    if (!is_plain_scalar(node) || !YAML::convert<double>::decode(node, parsed) || !std::isfinite(parsed) ||
        parsed < min || (min_exclusive && parsed == min) || parsed > max) {
      fail(key, expected, node);
    }
    value = parsed;
  }

  void boolean(const char* key, bool& value) const {
    const YAML::Node node = node_[key];
    if (!node.IsDefined()) return;
    if (!is_plain_scalar(node) || !YAML::convert<bool>::decode(node, value)) {
      fail(key, "true or false", node);
    }
  }

  void string(const char* key, std::string& value, bool allow_empty) const {
    const YAML::Node node = node_[key];
    if (!node.IsDefined()) return;
    if (!node.IsScalar() || (!allow_empty && node.Scalar().empty())) {
      fail(key, allow_empty ? "a string" : "a non-empty string", node);
    }
    value = node.Scalar();
  }

  template <typename Enum>
  void choice(const char* key, Enum& value, const std::vector<std::pair<const char*, Enum>>& choices) const {
    const YAML::Node node = node_[key];
    if (!node.IsDefined()) return;
    std::vector<const char*> names;
    for (const auto& [name, option] : choices) {
      names.push_back(name);
      if (node.IsScalar() && node.Scalar() == name) {
        value = option;
        return;
      }
    }
    fail(key, fmt::format("one of {}", fmt::join(names, ", ")), node);
  }

  // A list of distinct block ids, each below `blocks`.
  void block_ids(const char* key, std::vector<std::uint32_t>& value, std::uint32_t blocks) const {
    const YAML::Node node = node_[key];
    if (!node.IsDefined()) return;
    const std::string expected = fmt::format("a list of distinct block ids in [0, {}) (model.n_blocks)", blocks);
    if (!node.IsSequence()) fail(key, expected, node);
    std::vector<std::uint32_t> ids;
    for (std::size_t i = 0; i < node.size(); ++i) {
      const YAML::Node item = node[i];
      std::int64_t id = 0;
      if (!is_plain_scalar(item) || !YAML::convert<std::int64_t>::decode(item, id) || id < 0 || id >= blocks) {
        fail(key, expected, item);
      }
      if (std::find(ids.begin(), ids.end(), static_cast<std::uint32_t>(id)) != ids.end()) {
        fail(key, fmt::format("{}; {} is listed twice", expected, id), node);
      }
      ids.push_back(static_cast<std::uint32_t>(id));
    }
    value = std::move(ids);
  }

  const YAML::Node& node() const { return node_; }

 private:
  const Origins& origins_;
  std::string path_;
  YAML::Node node_;
  std::vector<const char*> known_;
};

constexpr std::int64_t kMaxU32 = std::numeric_limits<std::uint32_t>::max();

void read_model(const Origins& origins, const Section& s, ModelConfig& m) {
  s.integer("d_model", m.d_model, 8, 65536);
  s.integer("n_heads", m.n_heads, 1, 1024);
  s.integer("n_blocks", m.n_blocks, 1, 4096);
  s.integer("seq_len", m.seq_len, 2, 1 << 20);
  s.integer("mlp_ratio", m.mlp_ratio, 1, 64);
  s.number("init_std", m.init_std, 0.0, 1.0, /*min_exclusive=*/true);
  if (m.d_model % m.n_heads != 0) {
    // n_heads may be the default, absent from the text: its node is then invalid, and describing
    // it threw YAML::InvalidNode past every ConfigError (found by fuzzing, docs/fuzzing.md).
    const YAML::Node given = s.node()["n_heads"];
    if (!given.IsDefined()) {
      throw ConfigError(fmt::format("{}: model.n_heads: expected a divisor of model.d_model ({}), found the default {}",
                                    origins.of("model.n_heads"), m.d_model, m.n_heads));
    }
    s.fail("n_heads", fmt::format("a divisor of model.d_model ({})", m.d_model), given);
  }
  const Section outliers(origins, "model.outliers", s.node()["outliers"], {"blocks", "magnitude", "channels"});
  outliers.block_ids("blocks", m.outlier_blocks, m.n_blocks);
  outliers.number("magnitude", m.outlier_magnitude, 1.0, 1e4);
  outliers.integer("channels", m.outlier_channels, 1, m.d_model);
  s.choice<StreamingUnit>("streaming_unit", m.streaming_unit,
                          {{"block", StreamingUnit::block}, {"sublayer", StreamingUnit::sublayer}});
}

void read_data(const Section& s, DataConfig& d) {
  s.string("path", d.path, /*allow_empty=*/false);
  s.number("val_fraction", d.val_fraction, 0.0, 0.5, /*min_exclusive=*/true);
  s.integer("chunk_bytes", d.chunk_bytes, 64, 1 << 24);
}

void read_train(const Origins& origins, const Section& s, TrainLoopConfig& t) {
  s.choice<TrainMode>("mode", t.mode, {{"full", TrainMode::full}, {"lora", TrainMode::lora}});
  s.choice<ComputeDevice>("device", t.device, {{"cpu", ComputeDevice::cpu}, {"cuda", ComputeDevice::cuda}});
  s.choice<ComputeDtype>("compute_dtype", t.compute_dtype,
                         {{"fp32", ComputeDtype::fp32}, {"bf16", ComputeDtype::bf16}});
  s.integer("steps", t.steps, 1, kMaxSteps);
  s.integer("batch_size", t.batch_size, 1, 1 << 16);
  s.number("lr", t.lr, 0.0, 10.0, /*min_exclusive=*/true);
  s.number("min_lr_ratio", t.min_lr_ratio, 0.0, 1.0);
  s.integer("lr_warmup_steps", t.lr_warmup_steps, 0, kMaxSteps);
  s.number("weight_decay", t.weight_decay, 0.0, 10.0);
  s.number("beta1", t.beta1, 0.0, 0.999999);
  s.number("beta2", t.beta2, 0.0, 0.999999);
  s.number("eps", t.eps, 0.0, 1.0, /*min_exclusive=*/true);
  s.number("grad_clip", t.grad_clip, 0.0, 1e9);
  s.choice<HostOptimizer>("host_optimizer", t.host_optimizer,
                          {{"fused", HostOptimizer::fused},
                           {"unfused", HostOptimizer::unfused},
                           {"overlapped", HostOptimizer::overlapped}});
  s.choice<AdamMoments>(
      "adam_moments", t.adam_moments,
      {{"fp32", AdamMoments::fp32}, {"bf16", AdamMoments::bf16}, {"bf16_stochastic", AdamMoments::bf16_stochastic}});
  s.integer("eval_interval", t.eval_interval, 1, kMaxSteps);
  s.integer("eval_batches", t.eval_batches, 1, 1 << 16);
  s.integer("checkpoint_interval", t.checkpoint_interval, 0, kMaxSteps);
  s.integer("seed", t.seed, 0, std::numeric_limits<std::int64_t>::max());
  s.integer("threads", t.threads, 0, 1024);
  s.string("plugin", t.plugin, /*allow_empty=*/false);
  if (t.plugin.find('/') != std::string::npos) {
    s.fail("plugin", "a plugin name (lib<name>.so is looked up in --plugin-dir), not a path", s.node()["plugin"]);
  }
  s.integer("plugin_poll_steps", t.plugin_poll_steps, 0, kMaxSteps);
  s.integer("recalibrate_every", t.recalibrate_every, 0, kMaxU32);
  s.integer("collective_timeout_seconds", t.collective_timeout_seconds, 1, 86400);
  s.integer("checkpoint_timeout_seconds", t.checkpoint_timeout_seconds, 1, 7 * 86400);
  s.choice<DataParallelMode>("data_parallel", t.data_parallel,
                             {{"replicated", DataParallelMode::replicated}, {"sharded", DataParallelMode::sharded}});
  s.number("plugin_hook_deadline_seconds", t.plugin_hook_deadline_seconds, 0.0, 86400.0);
  s.string("calibration_cache_dir", t.calibration_cache_dir, /*allow_empty=*/true);
  s.string("init_checkpoint", t.init_checkpoint, /*allow_empty=*/true);
  s.choice<ResumePolicy>("resume", t.resume, {{"auto", ResumePolicy::auto_resume}, {"never", ResumePolicy::never}});
  const Section lora(origins, "train.lora", s.node()["lora"], {"rank", "alpha"});
  lora.integer("rank", t.lora.rank, 1, 4096);
  lora.number("alpha", t.lora.alpha, 0.0, 1e6, /*min_exclusive=*/true);
  if (t.compute_dtype == ComputeDtype::bf16 && t.device == ComputeDevice::cpu) {
    s.fail("compute_dtype", "fp32 with train.device cpu (bf16 compute needs train.device: cuda)",
           s.node()["compute_dtype"]);
  }
}

void read_streaming(const Section& s, StreamingSection& st) {
  s.integer("prefetch_window", st.prefetch_window, 0, 64);
  s.integer("int8_group_size", st.int8_group_size, 0, 256);
  if (!is_supported_group_size(Precision::int8, st.int8_group_size)) {
    s.fail("int8_group_size", group_size_expectation(Precision::int8), s.node()["int8_group_size"]);
  }
  s.integer("spare_slabs", st.spare_slabs, 0, 1024);
  s.number("bandwidth_cap_gbps", st.bandwidth_cap_gbps, 0.0, 1e6);
  if (st.bandwidth_cap_gbps > 0.0 && st.bandwidth_cap_gbps < sp::adapters::kMinBandwidthCapGbps) {
    s.fail("bandwidth_cap_gbps", fmt::format("0 (no cap) or a number in [{}, 1e6]", sp::adapters::kMinBandwidthCapGbps),
           s.node()["bandwidth_cap_gbps"]);
  }
  s.string("metrics_file", st.metrics_file, /*allow_empty=*/true);
  s.string("transfer_policy_path", st.transfer_policy_path, /*allow_empty=*/true);
}

// The plugin owns this section; the host reads only the keys it acts on.
void read_policy_keys(const Origins& origins, const YAML::Node& section, PolicyHostKeys& c) {
  if (!section.IsDefined() || !section.IsMap()) return;
  const std::string path = "memory.stagehand.selective_precision";
  if (const YAML::Node run = section["run_calibration"]; run.IsDefined()) {
    if (!is_plain_scalar(run) || !YAML::convert<bool>::decode(run, c.run_calibration)) {
      throw ConfigError(fmt::format("{}: {}.run_calibration: expected true or false, found {}",
                                    origins.of(path + ".run_calibration"), path, describe(run)));
    }
  }
  if (const YAML::Node samples = section["calibration_samples"]; samples.IsDefined()) {
    std::int64_t n = 0;
    if (!is_plain_scalar(samples) || !YAML::convert<std::int64_t>::decode(samples, n) || n < 1 || n > 4096) {
      throw ConfigError(fmt::format("{}: {}.calibration_samples: expected an integer in [1, 4096], found {}",
                                    origins.of(path + ".calibration_samples"), path, describe(samples)));
    }
    c.calibration_samples = static_cast<std::uint32_t>(n);
  }
  if (const YAML::Node group = section["nf4_group_size"]; group.IsDefined()) {
    std::int64_t n = 0;
    if (!is_plain_scalar(group) || !YAML::convert<std::int64_t>::decode(group, n) || n < 0 || n > 256 ||
        !is_supported_group_size(Precision::nf4, static_cast<std::uint32_t>(n))) {
      throw ConfigError(fmt::format("{}: {}.nf4_group_size: expected {}, found {}",
                                    origins.of(path + ".nf4_group_size"), path, group_size_expectation(Precision::nf4),
                                    describe(group)));
    }
    c.nf4_group_size = static_cast<std::uint32_t>(n);
  }
  if (const YAML::Node enabled = section["telemetry_enabled"]; enabled.IsDefined() && is_plain_scalar(enabled)) {
    YAML::convert<bool>::decode(enabled, c.telemetry_enabled);  // a wrong type is the plugin's to report
  }
  if (const YAML::Node file = section["telemetry_file"]; file.IsDefined() && file.IsScalar()) {
    c.telemetry_file = file.Scalar();
  }
}

// A log the run writes, and cuts back when it starts, is a plain file name in the run
// directory and none of the files the run writes itself.
void check_log_file_name(const Origins& origins, const std::string& key_path, const std::string& name,
                         const std::string& other_log) {
  const char* problem = nullptr;
  if (name.find('/') != std::string::npos || name == "." || name == "..") {
    problem = "a path";
  } else {
    for (const char* reserved : {kRunConfigFile, kRunTrainMetricsFile, kRunCheckpointFile, kRunSummaryFile}) {
      if (name == reserved) problem = "a file sp-train writes itself";
    }
    if (!other_log.empty() && name == other_log) problem = "the other log's file";
  }
  if (problem != nullptr) {
    throw ConfigError(
        fmt::format("{}: {}: expected a plain file name inside the run directory other than {}, {}, "
                    "{}, {} and the other log; found '{}' ({})",
                    origins.of(key_path), key_path, kRunConfigFile, kRunTrainMetricsFile, kRunCheckpointFile,
                    kRunSummaryFile, name, problem));
  }
}

}  // namespace

TrainConfig parse_train_config(const std::string& text, const std::string& source_name,
                               const std::vector<Override>& overrides) {
  YAML::Node root;
  refuse_lone_carriage_returns(text, source_name);
  try {
    const std::size_t documents = count_documents(text, source_name);
    // A second document would be read by no one, and a key there silently ignored.
    if (documents > 1) {
      throw ConfigError(
          fmt::format("{}: holds {} YAML documents (separated by ---); expected one", source_name, documents));
    }
    if (documents == 1) root.reset(YAML::Load(text));
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}: not valid YAML: {}", source_name, e.what()));
  }
  if (!root.IsDefined() || root.IsNull()) root.reset(YAML::Node(YAML::NodeType::Map));
  if (!root.IsMap()) {
    throw ConfigError(fmt::format("{}: expected a mapping at the top level, found {}", source_name, describe(root)));
  }
  Origins::Created created;
  for (const Override& override : overrides) apply_override(root, override, source_name, created);
  const Origins origins(source_name, overrides, std::move(created));

  TrainConfig config;
  config.source_name = source_name;
  // Constructing a section checks its keys.
  const Section top_level(origins, "", root, {"model", "data", "train", "memory"});
  read_model(
      origins,
      Section(origins, "model", root["model"],
              {"d_model", "n_heads", "n_blocks", "seq_len", "mlp_ratio", "init_std", "outliers", "streaming_unit"}),
      config.model);
  read_data(Section(origins, "data", root["data"], {"path", "val_fraction", "chunk_bytes"}), config.data);
  read_train(origins,
             Section(origins, "train", root["train"],
                     {"mode",
                      "device",
                      "compute_dtype",
                      "steps",
                      "batch_size",
                      "lr",
                      "min_lr_ratio",
                      "lr_warmup_steps",
                      "weight_decay",
                      "beta1",
                      "beta2",
                      "eps",
                      "grad_clip",
                      "host_optimizer",
                      "adam_moments",
                      "eval_interval",
                      "eval_batches",
                      "checkpoint_interval",
                      "seed",
                      "threads",
                      "lora",
                      "plugin",
                      "plugin_poll_steps",
                      "recalibrate_every",
                      "collective_timeout_seconds",
                      "checkpoint_timeout_seconds",
                      "data_parallel",
                      "plugin_hook_deadline_seconds",
                      "calibration_cache_dir",
                      "init_checkpoint",
                      "resume"}),
             config.train);
  const Section memory(origins, "memory", root["memory"], {"stagehand"});
  const Section stagehand(origins, "memory.stagehand", memory.node()["stagehand"],
                          {"streaming", "selective_precision"});
  read_streaming(Section(origins, "memory.stagehand.streaming", stagehand.node()["streaming"],
                         {"prefetch_window", "int8_group_size", "spare_slabs", "bandwidth_cap_gbps", "metrics_file",
                          "transfer_policy_path"}),
                 config.streaming);
  const YAML::Node policy = stagehand.node()["selective_precision"];
  if (policy.IsDefined() && !policy.IsNull() && !policy.IsMap()) {
    throw ConfigError(fmt::format("{}: memory.stagehand.selective_precision: expected a mapping, found {}",
                                  origins.of("memory.stagehand.selective_precision"), describe(policy)));
  }
  read_policy_keys(origins, policy, config.policy_keys);
  const std::string& metrics_file = config.streaming.metrics_file;
  const std::string& telemetry_file = config.policy_keys.telemetry_file;
  if (!metrics_file.empty()) {
    check_log_file_name(origins, "memory.stagehand.streaming.metrics_file", metrics_file,
                        config.policy_keys.telemetry_enabled ? telemetry_file : "");
  }
  if (config.policy_keys.telemetry_enabled) {
    check_log_file_name(origins, "memory.stagehand.selective_precision.telemetry_file", telemetry_file, metrics_file);
  }

  // Every key is optional, the policy section too: without one the plugin runs on its
  // defaults (it refuses a config that has no section at all). The path to it is built of
  // copies, never written in place: a node on it may be an alias of another section
  // ("memory: &m ~" with "train: *m"), which would grow the policy section too.
  if (!policy.IsDefined() || policy.IsNull()) {
    YAML::Node memory_copy = with_own_map(root["memory"], "stagehand");
    memory_copy["stagehand"] = with_own_map(memory_copy["stagehand"], "selective_precision");
    YAML::Node resolved = with_own_map(root, "memory");
    resolved["memory"] = memory_copy;
    root.reset(resolved);
  }
  std::multimap<int, YAML::Node> visited;
  if (const auto found = find_unkeepable(root, "", visited)) {
    throw ConfigError(fmt::format("{}: {}: {}", origins.of(found->first), found->first, found->second));
  }
  YAML::Emitter out;
  out << root;
  config.resolved_yaml = std::string(out.c_str()) + "\n";
  // The run keeps this text as its config.yaml and the plugin parses it: it must read back.
  // The checks above cover what fuzzing found the emitter to get wrong; this names the rest.
  try {
    YAML::Load(config.resolved_yaml);
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}: accepted, but yaml-cpp writes it back as text it cannot read ({}); simplify the "
                                  "keys and values of the plugin's section",
                                  source_name, e.msg));
  }
  return config;
}

TrainConfig load_train_config(const std::filesystem::path& file, const std::vector<Override>& overrides) {
  std::string text;
  try {
    text = sp::input_files::read_whole_file(file, "config file");
  } catch (const sp::input_files::FileReadError& e) {
    throw ConfigError(e.what());
  }
  return parse_train_config(text, file.string(), overrides);
}

const char* mode_name(TrainMode mode) { return mode == TrainMode::lora ? "lora" : "full"; }

const char* compute_device_name(ComputeDevice device) { return device == ComputeDevice::cuda ? "cuda" : "cpu"; }

const char* data_parallel_name(DataParallelMode mode) {
  return mode == DataParallelMode::sharded ? "sharded" : "replicated";
}

const char* adam_moments_name(AdamMoments moments) {
  switch (moments) {
    case AdamMoments::bf16:
      return "bf16";
    case AdamMoments::bf16_stochastic:
      return "bf16_stochastic";
    case AdamMoments::fp32:
      break;
  }
  return "fp32";
}

const char* host_optimizer_name(HostOptimizer optimizer) {
  switch (optimizer) {
    case HostOptimizer::unfused:
      return "unfused";
    case HostOptimizer::overlapped:
      return "overlapped";
    case HostOptimizer::fused:
      break;
  }
  return "fused";
}

const char* streaming_unit_name(StreamingUnit unit) { return unit == StreamingUnit::sublayer ? "sublayer" : "block"; }

const char* compute_dtype_name(ComputeDtype dtype) { return dtype == ComputeDtype::bf16 ? "bf16" : "fp32"; }

}  // namespace sp::train
