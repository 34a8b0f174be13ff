// The policy link (issue 51): the layer's one way to the policy plugin. It owns the policy
// session, the policy's units (which block belongs to which), the routes the hints in force
// give each block, what the plugin reads at each step (ABI 1.4's reads_step_signals), the
// signal tables and allocation measurements it is given, and their checks across ranks.
// Free of LibTorch: the measurements it carries are numbers, made by the layer.
// Not installed: the layer's insides (streamed_model_impl.h holds one).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <spdlog/logger.h>

#include "sp/adapters/streaming_engine.h"
#include "sp/host/policy_session.h"
#include "sp/precision.h"

namespace sp::torch_layer {

class PolicyLink {
 public:
  // Throws (RankMismatchError) naming the entries where the ranks' `values` differ; unset in one
  // process. Every rank calls it at the same points.
  using AgreeAcrossRanks = std::function<void(const std::vector<std::int32_t>& values, const std::string& what)>;

  // The units: `unit_of` per block, `names` per unit, covering the blocks in order.
  void set_units(std::vector<std::uint32_t> unit_of, std::vector<std::string> names);
  std::uint32_t num_units() const { return static_cast<std::uint32_t>(names_.size()); }
  std::uint32_t unit_of(std::uint32_t block) const { return unit_of_[block]; }
  const std::vector<std::string>& unit_names() const { return names_; }
  bool units_are_blocks() const { return names_.size() == unit_of_.size(); }

  // Loads the plugin for the units, each with its blocks' image sizes in `engine`.
  void open(const adapters::StreamingEngine& engine, const std::filesystem::path& plugin_file,
            host::PolicyConfig config, std::string host_name, std::filesystem::path output_dir,
            std::shared_ptr<spdlog::logger> logger, std::chrono::milliseconds hook_deadline, AgreeAcrossRanks agree);
  host::PolicySession& session() { return *session_; }
  const host::PolicySession& session() const { return *session_; }

  // Per block, the route of its unit's hint in force; empty before the first hint (BF16).
  std::vector<Precision> block_routes() const;
  // Per unit, the distinct routes of its blocks in `routes` (one per block), in block order: one
  // route where they agree, as the hint routes every block of a unit the same way and only the
  // transfer policy can send one apart.
  std::vector<std::vector<Precision>> unit_routes(const std::vector<Precision>& routes) const;

  // At begin_step, once a step (a hot swap, which can change the answer, happens there only):
  // whether the plugin reads a signal table this step, and, in one process, whether the
  // backward then differentiates frozen streamed weights too (LoRA's base).
  void read_what_the_step_needs(bool one_process);
  bool signals_wanted() const { return signals_wanted_; }
  bool frozen_gradients_wanted() const { return frozen_gradients_wanted_; }

  // The step's signal table (post_backward), and the last table the plugin was given.
  void give_step_signals(std::int64_t step, host::UnitSignalTable table);
  const host::UnitSignalTable& last_signals() const { return last_signals_; }

  // Between steps (StreamedModel::set_unit_signals, propose_allocations,
  // set_allocation_measurements), `last_begun` the last step begun if any. Whether the plugin
  // took it; `first_hints` says that its hints now stand before any step, to be routed by.
  bool set_unit_signals(std::optional<std::int64_t> last_begun, const host::UnitSignalTable& table, bool& first_hints);
  std::vector<std::vector<Precision>> propose_allocations();
  bool set_allocation_measurements(std::optional<std::int64_t> last_begun,
                                   const std::vector<std::vector<Precision>>& allocations,
                                   const std::vector<std::vector<double>>& example_costs, double confidence,
                                   bool& first_hints);

 private:
  void agree(const std::vector<std::int32_t>& values, const std::string& what) const {
    if (agree_) agree_(values, what);
  }
  // Before any step, a plugin with initial hints gives them now.
  bool take_first_hints(std::optional<std::int64_t> last_begun) {
    return !last_begun && session_->take_initial_hints();
  }

  std::unique_ptr<host::PolicySession> session_;
  AgreeAcrossRanks agree_;
  std::vector<std::uint32_t> unit_of_;
  std::vector<std::string> names_;
  host::UnitSignalTable last_signals_;
  bool signals_wanted_ = false;
  bool frozen_gradients_wanted_ = false;
};

// A policy session over the engine's blocks, each its own unit (sp_bench, sp_replay).
std::unique_ptr<host::PolicySession> policy_session_per_block(const adapters::StreamingEngine& engine,
                                                              const std::filesystem::path& plugin_file,
                                                              host::PolicyConfig config, std::string host_name,
                                                              std::filesystem::path output_dir,
                                                              std::shared_ptr<spdlog::logger> logger,
                                                              std::chrono::milliseconds hook_deadline);

}  // namespace sp::torch_layer
