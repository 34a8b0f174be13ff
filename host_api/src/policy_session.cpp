#include "sp/host/policy_session.h"

#include <sys/stat.h>

#include <stdexcept>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace sp::host {
namespace fs = std::filesystem;

PolicySession::PolicySession(fs::path plugin_file, PolicyConfig config, std::vector<BlockDescription> blocks,
                             PolicyHostOptions options)
    : plugin_file_(std::move(plugin_file)), logger_(options.logger ? options.logger : spdlog::default_logger()) {
  loaded_identity_ = identify(plugin_file_);
  host_ = std::make_unique<PolicyHost>(plugin_file_, config, std::move(blocks), std::move(options));
}

PolicySession::~PolicySession() = default;

bool PolicySession::set_calibration_errors(sp_precision precision, const std::vector<double>& errors) {
  std::vector<std::uint32_t> ids(errors.size());
  for (std::uint32_t b = 0; b < ids.size(); ++b) ids[b] = b;
  return host_->set_calibration_errors(precision, ids, errors);
}

void PolicySession::begin_step(std::int64_t step) { host_->begin_step(step); }

void PolicySession::post_backward(std::int64_t step, const std::vector<sp_grad_moments_v1>& moments) {
  host_->post_backward(step, moments);
}

const std::vector<sp_hint_v1>& PolicySession::compute_hints(std::int64_t step) { return host_->compute_hints(step); }

void PolicySession::end_step(std::int64_t step, const sp_step_feedback_v1& feedback) {
  host_->end_step(step, &feedback);
}

bool PolicySession::set_unit_signals(std::int64_t step, const UnitSignalTable& table) {
  return host_->set_unit_signals(step, table);
}

std::optional<PolicySession::FileIdentity> PolicySession::identify(const fs::path& file) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) return std::nullopt;
  return FileIdentity{static_cast<std::uintmax_t>(st.st_size),
                      static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                      static_cast<std::uint64_t>(st.st_ino)};
}

std::optional<SwapResult> PolicySession::check_for_new_version(bool force) {
  const std::optional<FileIdentity> now = identify(plugin_file_);
  // A file being replaced may be missing for a moment; the next check will see it.
  if (!now) return std::nullopt;
  if (!force && loaded_identity_ && *now == *loaded_identity_) return std::nullopt;
  loaded_identity_ = now;
  SwapResult result = host_->request_swap(plugin_file_);
  swap_requested_ = result.outcome == SwapResult::Outcome::pending;
  return result;
}

std::optional<SwapResult> PolicySession::cancel_swap(const std::string& why) {
  std::optional<SwapResult> result = host_->cancel_swap(why);
  swap_requested_ = false;
  return result;
}

std::optional<SwapResult> PolicySession::take_swap_outcome() {
  if (!swap_requested_ || host_->swap_pending()) return std::nullopt;
  swap_requested_ = false;
  return host_->last_swap_result();
}

void PolicySession::restore_state(const std::vector<std::uint8_t>& blob) {
  if (!host_->import_state(blob)) {
    throw std::runtime_error(fmt::format("the policy plugin {} {} rejected the checkpoint's policy state (see above)",
                                         host_->plugin_name(), host_->plugin_version()));
  }
  logger_->info("restored the policy state ({} bytes) into {} {}", blob.size(), host_->plugin_name(),
                host_->plugin_version());
}

}  // namespace sp::host
