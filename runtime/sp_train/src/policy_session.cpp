#include "policy_session.hpp"

#include <sys/stat.h>

#include <cstring>
#include <stdexcept>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <yaml-cpp/yaml.h>

namespace sp::train {
namespace fs = std::filesystem;
namespace {

constexpr std::uint32_t kInputsFormat = 1;

// The run's policy config with the plugin's side effects (telemetry file, decision log) off,
// for replaying already-recorded steps.
std::string quiet_config(const std::string& yaml) {
  YAML::Node root = YAML::Load(yaml);
  YAML::Node section = root["memory"]["stagehand"]["selective_precision"];
  section["telemetry_enabled"] = false;
  section["log_decisions"] = false;
  YAML::Emitter out;
  out << root;
  return out.c_str();
}

template <typename T>
void append(std::vector<std::uint8_t>& out, const T& value) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&value);
  out.insert(out.end(), p, p + sizeof value);
}

class Reader {
 public:
  explicit Reader(const std::vector<std::uint8_t>& bytes) : bytes_(bytes) {}
  template <typename T>
  T read(const char* what) {
    if (sizeof(T) > bytes_.size() - pos_) {
      throw std::runtime_error(fmt::format("policy inputs: truncated while reading {} at byte {}", what, pos_));
    }
    T value;
    std::memcpy(&value, bytes_.data() + pos_, sizeof value);
    pos_ += sizeof value;
    return value;
  }
  bool done() const { return pos_ == bytes_.size(); }

 private:
  const std::vector<std::uint8_t>& bytes_;
  std::size_t pos_ = 0;
};

}  // namespace

PolicySession::PolicySession(fs::path plugin_file, std::string config_yaml, std::string source_name,
                             std::vector<sp::host::BlockDescription> blocks, fs::path output_dir,
                             std::shared_ptr<spdlog::logger> logger)
    : plugin_file_(std::move(plugin_file)),
      config_{std::move(config_yaml), std::move(source_name)},
      logger_(std::move(logger)) {
  sp::host::PolicyHostOptions options;
  options.host_name = "sp-train";
  options.output_dir = std::move(output_dir);
  options.logger = logger_;
  options.fallback = sp::host::FallbackMode::last_good;
  loaded_identity_ = identify(plugin_file_);
  host_ = std::make_unique<sp::host::PolicyHost>(plugin_file_, config_, std::move(blocks), options);
}

PolicySession::~PolicySession() = default;

bool PolicySession::set_calibration_errors(const std::vector<double>& errors) {
  std::vector<std::uint32_t> ids(errors.size());
  for (std::uint32_t b = 0; b < ids.size(); ++b) ids[b] = b;
  calibration_errors_ = errors;
  return host_->set_calibration_errors(ids, errors);
}

void PolicySession::begin_step(std::int64_t step) {
  current_ = StepInputs{};
  current_.step = step;
  host_->begin_step(step);
}

void PolicySession::post_backward(std::int64_t step, const std::vector<sp_grad_moments_v1>& moments) {
  current_.moments = moments;
  host_->post_backward(step, moments);
}

const std::vector<sp_hint_v1>& PolicySession::compute_hints(std::int64_t step) {
  return host_->compute_hints(step);
}

void PolicySession::end_step(std::int64_t step, const sp_step_feedback_v1& feedback) {
  current_.feedback = feedback;
  host_->end_step(step, &current_.feedback);
  log_.push_back(std::move(current_));
}

std::optional<PolicySession::FileIdentity> PolicySession::identify(const fs::path& file) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) return std::nullopt;
  return FileIdentity{static_cast<std::uintmax_t>(st.st_size),
                      static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                      static_cast<std::uint64_t>(st.st_ino)};
}

std::optional<sp::host::SwapResult> PolicySession::check_for_new_version(bool force) {
  const std::optional<FileIdentity> now = identify(plugin_file_);
  // A file being replaced may be missing for a moment; the next check will see it.
  if (!now) return std::nullopt;
  if (!force && loaded_identity_ && *now == *loaded_identity_) return std::nullopt;
  loaded_identity_ = now;
  sp::host::SwapResult result = host_->request_swap(plugin_file_);
  swap_requested_ = result.outcome == sp::host::SwapResult::Outcome::pending;
  return result;
}

std::optional<sp::host::SwapResult> PolicySession::take_swap_outcome() {
  if (!swap_requested_ || host_->swap_pending()) return std::nullopt;
  swap_requested_ = false;
  return host_->last_swap_result();
}

std::vector<std::uint8_t> PolicySession::serialize_inputs() const {
  std::vector<std::uint8_t> out;
  append(out, kInputsFormat);
  append(out, static_cast<std::uint32_t>(host_->block_count()));
  append(out, static_cast<std::uint64_t>(calibration_errors_.size()));
  for (double e : calibration_errors_) append(out, e);
  append(out, static_cast<std::uint64_t>(log_.size()));
  for (const StepInputs& s : log_) {
    append(out, s.step);
    append(out, static_cast<std::uint32_t>(s.moments.size()));
    for (const sp_grad_moments_v1& m : s.moments) append(out, m);
    append(out, s.feedback);
  }
  return out;
}

std::vector<sp_hint_v1> PolicySession::restore_from_inputs(const std::vector<std::uint8_t>& bytes) {
  Reader in(bytes);
  if (in.read<std::uint32_t>("the format") != kInputsFormat) {
    throw std::runtime_error("policy inputs: unknown format version");
  }
  const auto blocks = in.read<std::uint32_t>("the block count");
  if (blocks != host_->block_count()) {
    throw std::runtime_error(fmt::format("policy inputs: recorded for {} blocks, the model has {}",
                                         blocks, host_->block_count()));
  }
  std::vector<double> errors(in.read<std::uint64_t>("the calibration count"));
  if (errors.size() > blocks) throw std::runtime_error("policy inputs: more calibration errors than blocks");
  for (double& e : errors) e = in.read<double>("a calibration error");
  std::vector<StepInputs> log(in.read<std::uint64_t>("the step count"));
  for (StepInputs& s : log) {
    s.step = in.read<std::int64_t>("a step number");
    s.moments.resize(in.read<std::uint32_t>("a moment count"));
    if (s.moments.size() > blocks) throw std::runtime_error("policy inputs: more moments than blocks");
    for (sp_grad_moments_v1& m : s.moments) m = in.read<sp_grad_moments_v1>("gradient moments");
    s.feedback = in.read<sp_step_feedback_v1>("step feedback");
  }
  if (!in.done()) throw std::runtime_error("policy inputs: trailing bytes");

  logger_->info("restoring the policy state: replaying {} recorded steps into {} {}", log.size(),
                host_->plugin_name(), host_->plugin_version());
  const sp::host::PolicyConfig run_config = config_;
  auto swap_to = [&](const sp::host::PolicyConfig& config) {
    const sp::host::SwapResult swap = host_->swap_now(plugin_file_, config);
    if (swap.outcome != sp::host::SwapResult::Outcome::swapped) {
      throw std::runtime_error(fmt::format("restoring the policy state failed: {}", swap.message));
    }
  };
  swap_to(sp::host::PolicyConfig{quiet_config(run_config.text), run_config.source_name + " (replay)"});
  if (!errors.empty()) set_calibration_errors(errors);
  std::vector<sp_hint_v1> last_hints;
  for (StepInputs& s : log) {
    begin_step(s.step);
    post_backward(s.step, s.moments);
    last_hints = compute_hints(s.step);
    end_step(s.step, s.feedback);
  }
  swap_to(run_config);
  if (host_->hook_failures().total() != 0) {
    throw std::runtime_error("restoring the policy state failed: a plugin hook failed during the replay");
  }
  return last_hints;
}

}  // namespace sp::train
