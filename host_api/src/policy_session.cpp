#include "sp/host/policy_session.h"

#include <sys/stat.h>

#include <cmath>
#include <stdexcept>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "sp/precision_abi.h"

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

bool UnitHint::operator==(const UnitHint& o) const {
  const bool same_sensitivity =
      sensitivity == o.sensitivity || (std::isnan(sensitivity) && std::isnan(o.sensitivity));
  return precision == o.precision && same_sensitivity && reason == o.reason;
}

std::vector<sp_hint_v1> hints_to_abi(const std::vector<UnitHint>& hints) {
  std::vector<sp_hint_v1> out(hints.size(), sp_hint_v1{});
  for (std::uint32_t u = 0; u < hints.size(); ++u) {
    out[u] = sp_hint_v1{u, to_abi(hints[u].precision), hints[u].sensitivity, hints[u].reason, 0};
  }
  return out;
}

std::vector<UnitHint> hints_from_abi(const std::vector<sp_hint_v1>& hints) {
  std::vector<UnitHint> out;
  out.reserve(hints.size());
  for (std::size_t i = 0; i < hints.size(); ++i) {
    const sp_hint_v1& hint = hints[i];
    if (hint.block_id != i) {
      throw std::invalid_argument(fmt::format("hints[{}].block_id is {}, expected {}", i, hint.block_id, i));
    }
    const std::optional<Precision> precision = from_abi(hint.precision);
    if (!precision) {
      throw std::invalid_argument(
          fmt::format("hints[{}].precision is {}; expected {}", i, hint.precision, abi_code_expectation()));
    }
    out.push_back(UnitHint{*precision, hint.sensitivity, hint.reason});
  }
  return out;
}

const std::vector<UnitHint>& PolicySession::compute_hints(std::int64_t step) {
  // PolicyHost checked them against the plugin's ABI minor and this host's precisions, or put
  // its fallback in their place: translating them cannot fail.
  hints_ = hints_from_abi(host_->compute_hints(step));
  return hints_;
}

bool PolicySession::take_initial_hints() {
  const std::optional<std::vector<sp_hint_v1>> initial = host_->initial_hints();
  if (!initial) return false;
  hints_ = hints_from_abi(*initial);
  return true;
}

void PolicySession::restore_hints(std::vector<UnitHint> hints) {
  if (!hints.empty() && hints.size() != host_->block_count()) {
    throw std::invalid_argument(
        fmt::format("{} hints for {} policy units: expected one per unit, or none", hints.size(), host_->block_count()));
  }
  hints_ = std::move(hints);
}

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
