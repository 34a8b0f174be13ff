// The step: its begin and end, the policy's hooks and hints, the host's updates of the masters.
#include "streamed_model_impl.h"

#include "sp/adapters/route_encoding.h"
#include "sp/adapters/transfer_policy.h"
#include "sp/kernels/taylor.h"

#include <cstring>

namespace sp::torch_layer {

void StreamedModel::Impl::end_plugin_step_as_failed() {
  policy_link.session().end_step(step_state.number(), step_state.feedback(std::numeric_limits<double>::quiet_NaN()));
}

void StreamedModel::Impl::route_by_hints() {
  std::vector<Precision> routes = policy_link.block_routes();
  if (routes.empty()) {
    engines.train->policy_bridge().clear_plugin_routes();
    engines.eval->policy_bridge().clear_plugin_routes();
    return;
  }
  engines.train->policy_bridge().set_plugin_routes(routes);
  engines.eval->policy_bridge().set_plugin_routes(routes);
}

std::vector<sp_grad_moments_v1> StreamedModel::Impl::block_moments() {
  std::vector<torch::Tensor> keep;  // host copies of device gradients, alive for the call
  std::vector<kn::GradTensor> tensors;
  // A unit's moments are those of all its blocks' gradients together.
  const auto add = [&](const torch::Tensor& g, std::uint32_t b) {
    if (!g.defined()) return;
    torch::Tensor host = g.device().is_cpu() && g.scalar_type() == torch::kFloat32 && g.is_contiguous()
                             ? g
                             : g.to(torch::kCPU, torch::kFloat32).contiguous();
    keep.push_back(host);
    tensors.push_back(
        {host.data_ptr<float>(), static_cast<std::size_t>(host.numel()), kn::DType::kFloat32, policy_link.unit_of(b)});
  };
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    if (!shards.owns(b)) continue;
    if (!blocks[b].moment_sources.empty()) {
      for (const torch::Tensor& t : blocks[b].moment_sources) add(t.grad(), b);
    } else if (blocks[b].trainable_masters) {
      for (const StreamedParameter& p : blocks[b].streamed) add(p.master.grad(), b);
    } else {
      for (const torch::Tensor& r : blocks[b].trainable_resident) add(r.grad(), b);
    }
  }
  std::vector<sp_grad_moments_v1> out(num_units());
  kn::grad_moments(tensors.data(), tensors.size(), num_units(), out.data(), intra_op_exec());
  if (shards.sharded()) gather_moments(out);
  return out;
}

std::optional<sp::host::UnitSignalTable> StreamedModel::Impl::measure_unit_signals() {
  if (!policy_link.signals_wanted()) return std::nullopt;
  constexpr auto& kTiers = kQuantizedPrecisions;
  constexpr auto kTierCount = static_cast<std::int64_t>(kTiers.size());
  // Per unit: whether it was measured, then per tier the sums of g*d and g^2*d^2 over its
  // blocks; last, the step's examples. Sharded, each owner fills its units and the ranks add
  // them up.
  constexpr std::int64_t kFields = 1 + 2 * kTierCount;
  const auto n = static_cast<std::int64_t>(num_units());
  torch::Tensor sums = torch::zeros({n * kFields + 1}, torch::kFloat64);
  double* s = sums.data_ptr<double>();
  std::array<kn::SlabEncoding, kTiers.size()> encodings;
  for (std::size_t t = 0; t < kTiers.size(); ++t) encodings[t] = engines.train->image_encoding(kTiers[t]);
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    if (!shards.owns(b)) continue;
    double* row = s + policy_link.unit_of(b) * kFields;
    for (const StreamedParameter& p : blocks[b].streamed) {
      const torch::Tensor& grad = p.master.requires_grad() ? p.master.grad() : p.signal_grad;
      if (!grad.defined()) continue;
      const torch::Tensor g = grad.to(torch::kCPU, torch::kFloat32).contiguous();
      row[0] = 1.0;
      for (std::int64_t t = 0; t < kTierCount; ++t) {
        const kn::TaylorSums terms =
            kn::image_taylor_sums(encodings[static_cast<std::size_t>(t)], p.master.data_ptr<float>(),
                                  g.data_ptr<float>(), {p.rows, p.cols}, intra_op_exec());
        row[1 + 2 * t] += terms.first;
        row[2 + 2 * t] += terms.second;
      }
    }
  }
  s[n * kFields] = static_cast<double>(step_state.examples());
  if (shards.sharded()) {
    shards.group()->all_reduce(sums, Reduction::sum, "the blocks' Taylor terms")->wait();
    s = sums.data_ptr<double>();
  } else if (shards.group()) {
    s[n * kFields] *= shards.group()->size();  // the ranks average equal batches (as DDP expects)
  }
  const double examples = s[n * kFields];

  sp::host::UnitSignalTable table;
  for (const char* column : {"loss_cost", "first_order", "second_order"}) {
    for (const Precision tier : kTiers) table.names.push_back(fmt::format("{}.{}", column, precision_name(tier)));
  }
  const auto columns = static_cast<std::int64_t>(table.names.size());
  table.values.assign(static_cast<std::size_t>(n * columns), std::numeric_limits<double>::quiet_NaN());
  table.samples = static_cast<std::uint64_t>(examples);
  for (std::int64_t t = 0; t < kTierCount; ++t) {
    // The first-order term ranks the units within a tier, but its level over the tier is noise
    // that makes a tier look free (docs/signals.md): it is centred over the tier's units, and
    // the level is left to the second-order term.
    double first_total = 0.0;
    std::int64_t measured = 0;
    for (std::int64_t b = 0; b < n; ++b) {
      if (s[b * kFields] == 0.0) continue;
      first_total += s[b * kFields + 1 + 2 * t];
      ++measured;
    }
    for (std::int64_t b = 0; b < n; ++b) {
      const double* row = s + b * kFields;
      if (row[0] == 0.0) continue;
      const double first = row[1 + 2 * t];
      // The per-example Fisher is about the batch size times the square of the mean gradient.
      const double second = 0.5 * examples * row[2 + 2 * t];
      double* out = table.values.data() + b * columns;
      out[t] = second + (first - first_total / static_cast<double>(measured));
      out[kTierCount + t] = first;
      out[2 * kTierCount + t] = second;
    }
  }
  return table;
}

void StreamedModel::Impl::take_backward_statistics() {
  if (!step_state.in_step()) return;
  step_state.note_backward();
  // A pass armed with update_masters_during_backward() still writes the masters: post_backward()
  // measures that one.
  if (updater.is_armed()) return;
  step_state.keep_statistics(block_moments(), measure_unit_signals());
}

std::vector<Precision> StreamedModel::Impl::current_routes() const {
  std::vector<Precision> routes;
  for (std::uint32_t b = 0; b < blocks.size(); ++b) routes.push_back(engines.train->policy_bridge().route(b));
  return routes;
}

void StreamedModel::begin_step(std::int64_t step) {
  Impl& m = *impl_;
  m.step_state.check_can_begin(step);
  m.rebuild_changed_images(fmt::format("begin_step({})", step));
  m.policy_link.session().begin_step(step);
  m.step_state.begin(step, m.policy_link.session().take_swap_outcome(), m.trainable_versions());
  for (BlockGroup& b : m.blocks) {
    for (StreamedParameter& p : b.streamed) p.signal_grad = torch::Tensor();
  }
  m.policy_link.read_what_the_step_needs(/*one_process=*/!m.shards.group());
  try {
    if (m.shards.group()) {
      // Every rank was asked to swap at this boundary (poll_plugin): each must have the same
      // outcome, or their plugins would now differ.
      m.check_ranks_agree({m.step_state.swapped() ? 1 : 0}, "plugin swap outcomes (1: swapped)");
    }
    // Routes that moved since the images were last shared (hints restored, or a step aborted
    // after its post_backward) get their owners' images before the first fetch.
    m.share_images(/*all=*/false);
  } catch (...) {
    m.end_plugin_step_as_failed();  // it began: the next begin_step can then come
    throw;
  }
  m.step_state.open();
  for (BlockGroup& block : m.blocks) block.begin_step();
  m.updater.disarm();
}

const std::vector<sp_grad_moments_v1>& StreamedModel::post_backward(double loss) {
  Impl& m = *impl_;
  m.step_state.require_step("post_backward");
  const std::int64_t step = m.step_state.number();
  if (m.step_state.after_backward())
    throw std::logic_error("StreamedModel::post_backward: already called in this step");
  m.close_passes_without_backward("post_backward");
  m.wait_for_updates();
  // The statistics the backward kept, else measured now (an armed pass, or a host whose
  // gradients came other than through a training pass's backward).
  const bool kept = m.step_state.has_statistics();
  auto [moments, signals] = kept ? m.step_state.take_statistics()
                                 : std::make_pair(m.block_moments(), std::optional<sp::host::UnitSignalTable>());
  // The plugin takes the blocks that have gradient elements (ABI: the others are left out).
  std::vector<sp_grad_moments_v1> measured;
  for (const sp_grad_moments_v1& block : moments) {
    if (block.count != 0) measured.push_back(block);
  }
  const bool any_trains = std::any_of(m.blocks.begin(), m.blocks.end(), [&](const BlockGroup& b) {
    return b.trainable_masters || !b.trainable_resident.empty() ||
           std::any_of(b.moment_sources.begin(), b.moment_sources.end(),
                       [](const torch::Tensor& t) { return t.requires_grad(); });
  });
  // Blocks with nothing to train (the host trains only its own parameters) report none.
  if (measured.empty() && any_trains) {
    throw std::logic_error(fmt::format(
        "StreamedModel::post_backward: no block has a gradient in step {}: no backward ran through the streamed "
        "blocks since begin_step(), or their gradients were cleared before this call. Run the backward first; to "
        "drop a step without one, call abort_step()",
        step));
  }
  const std::vector<sp_grad_moments_v1>& given = m.step_state.set_moments(std::move(moments));
  m.policy_link.session().post_backward(step, measured);
  if (!kept) signals = m.measure_unit_signals();
  if (signals) {
    signals->loss = std::isfinite(loss) ? loss : std::numeric_limits<double>::quiet_NaN();
    m.policy_link.give_step_signals(step, std::move(*signals));
  }
  m.policy_link.session().compute_hints(step);
  m.route_by_hints();
  if (m.shards.group()) {
    std::vector<std::int32_t> precisions;
    for (const sp::host::UnitHint& h : m.policy_link.session().hints()) precisions.push_back(to_abi(h.precision));
    m.check_ranks_agree(precisions, "the plugin's hints");
  }
  m.step_state.end_backward();
  if (const std::optional<OverlappedUpdater::Armed> armed = m.updater.disarm()) {
    // Armed blocks whose backward did not run (no training pass, or one that ended above them).
    for (std::uint32_t b = 0; b < m.blocks.size(); ++b) {
      if (m.blocks[b].trainable_masters && m.shards.owns(b) && !armed->begun[b]) {
        m.update_block(b, armed->step, armed->moments[b], /*skip_nonfinite=*/true);
      }
    }
  }
  return given;
}

StreamedModel::UpdateInputs StreamedModel::prepare_update(const std::vector<torch::Tensor>& rest_to_average,
                                                          const std::function<double()>& read_loss) {
  impl_->step_state.require_step("prepare_update");
  average_gradients(rest_to_average);
  const double loss = average(read_loss());
  return {loss, post_backward(loss)};
}

StepReport StreamedModel::end_step(double loss) {
  Impl& m = *impl_;
  m.step_state.require_step("end_step");
  if (!m.step_state.after_backward()) {
    throw std::logic_error(
        "StreamedModel::end_step: call post_backward() first: the plugin's hints must reach the engines before "
        "the images of the updated weights are rebuilt");
  }
  refresh_images();
  const std::int64_t step = m.step_state.number();
  m.policy_link.session().end_step(step, m.step_state.feedback(loss));
  m.step_state.end();
  const std::uint32_t every = m.options.recalibrate_every;
  if (every != 0 && m.last_input.defined() && (step + 1) % every == 0) {
    // On the updated weights, between steps (where the ABI takes calibration errors): the
    // plugin decides with them from the next step on.
    const auto start = Clock::now();
    CalibrationErrors errors = m.measure_calibration_errors({m.last_input});
    m.set_calibration_errors(errors);
    m.step_state.set_calibration(std::move(errors), std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::vector<Precision> routes = m.current_routes();
  std::vector<std::vector<Precision>> by_unit = m.policy_link.unit_routes(routes);
  return m.step_state.report(std::move(routes), std::move(by_unit));
}

void StreamedModel::abort_step() {
  Impl& m = *impl_;
  m.abandon_passes();
  if (!m.step_state.in_step()) return;
  m.step_state.end();
  m.end_plugin_step_as_failed();
}

void StreamedModel::refresh_images() {
  Impl& m = *impl_;
  // Per block: whether its owner may have a new image, to share. A trainable block's owner
  // updated it; a frozen block's masters change only when the host loads or edits them, which
  // only its owner sees, so sharded the ranks learn it from one another.
  std::vector<bool> rebuilt(m.blocks.size(), false);
  bool any_frozen = false;
  for (std::uint32_t b = 0; b < m.blocks.size(); ++b) {
    rebuilt[b] = m.blocks[b].trainable_masters;
    any_frozen = any_frozen || !m.blocks[b].trainable_masters;
    if (!m.shards.owns(b) || (!m.blocks[b].trainable_masters && !m.blocks[b].changed_master())) continue;
    rebuilt[b] = true;
    // update_masters() wrote its image; the host changed its masters since, or not.
    if (m.blocks[b].take_updated_in_step() && !m.blocks[b].changed_master()) continue;
    m.engines.train->on_weights_updated(b);
    m.blocks[b].mark_evaluation_image_stale();
  }
  if (m.shards.sharded() && any_frozen) {
    torch::Tensor changed = torch::zeros({static_cast<std::int64_t>(rebuilt.size())}, torch::kInt32);
    std::int32_t* flags = changed.data_ptr<std::int32_t>();
    for (std::size_t b = 0; b < rebuilt.size(); ++b) flags[b] = rebuilt[b] ? 1 : 0;
    m.shards.group()->all_reduce(changed, Reduction::max, "blocks whose masters changed")->wait();
    for (std::size_t b = 0; b < rebuilt.size(); ++b) rebuilt[b] = flags[b] != 0;
  }
  m.share_images(/*all=*/false, rebuilt);
  m.note_image_versions();
}

StreamedModel::StepPhase StreamedModel::step_phase() const { return impl_->step_state.phase(); }

bool StreamedModel::trained_in_step() const {
  const Impl& m = *impl_;
  return m.step_state.in_step() && m.step_state.backward_ran() &&
         m.trainable_versions() != m.step_state.versions_at_begin();
}

void StreamedModel::update_masters(std::uint32_t block, const sp::kernels::AdamWStep& step,
                                   const std::map<std::string, MasterMoments>& moments) {
  Impl& m = *impl_;
  m.step_state.require_step("update_masters");
  if (!m.step_state.after_backward()) {
    throw std::logic_error(
        "StreamedModel::update_masters: call post_backward() first: the image is written for the route the plugin "
        "decides there");
  }
  if (block >= m.blocks.size()) {
    throw std::invalid_argument(
        fmt::format("StreamedModel::update_masters: block {} is out of range (there are {})", block, m.blocks.size()));
  }
  if (!m.shards.owns(block)) {
    throw std::logic_error(fmt::format(
        "StreamedModel::update_masters: {} is owned by rank {}, which updates it (shard_masters); this is rank {}",
        m.blocks[block].block.name, m.shards.owner(block), rank()));
  }
  if (m.blocks[block].updated_in_step()) {
    throw std::logic_error(fmt::format("StreamedModel::update_masters: block {} was already updated in step {}",
                                       m.blocks[block].block.name, m.step_state.number()));
  }
  m.update_block(block, step, moments, /*skip_nonfinite=*/false);
}

void StreamedModel::update_masters_during_backward(const sp::kernels::AdamWStep& step,
                                                   std::vector<std::map<std::string, MasterMoments>> moments) {
  Impl& m = *impl_;
  m.step_state.require_step("update_masters_during_backward");
  if (m.step_state.after_backward()) {
    throw std::logic_error(
        "StreamedModel::update_masters_during_backward: post_backward() already ran in this step; use "
        "update_masters()");
  }
  if (m.passes.backward_under_way()) {
    throw std::logic_error(
        "StreamedModel::update_masters_during_backward: a backward is running; arm the update before it starts");
  }
  if (m.updater.is_armed()) {
    throw std::logic_error(
        fmt::format("StreamedModel::update_masters_during_backward: already armed in step {}", m.step_state.number()));
  }
  if (m.passes.awaiting_backward() > 1) {
    throw std::logic_error(
        "StreamedModel::update_masters_during_backward: more than one training pass awaits its backward; the update "
        "of the first backward would miss the others' gradients. Arm it with one pass open at most");
  }
  if (moments.size() != m.blocks.size()) {
    throw std::invalid_argument(
        fmt::format("StreamedModel::update_masters_during_backward: {} moment maps for {} blocks; give one per block",
                    moments.size(), m.blocks.size()));
  }
  for (std::uint32_t b = 0; b < m.blocks.size(); ++b) {
    if (!m.blocks[b].trainable_masters || !m.shards.owns(b)) continue;
    for (const StreamedParameter& p : m.blocks[b].streamed) {
      if (moments_of(moments[b], p.name) == nullptr) {
        throw std::invalid_argument(fmt::format(
            "StreamedModel::update_masters_during_backward: {}.{} has no AdamW moments (exp_avg and exp_avg_sq) in "
            "the map given",
            m.blocks[b].block.name, p.name));
      }
    }
  }
  m.updater.arm(step, std::move(moments));
  m.step_state.drop_statistics();  // of an earlier pass: post_backward() measures the armed one
}

void StreamedModel::Impl::apply_transfer_policy(const std::filesystem::path& file) {
  const ad::TransferPolicy policy = ad::load_transfer_policy_or_bf16(
      file.string(), [&](const std::string& why) { log->warn("transfer policy {}", why); });
  std::vector<std::uint64_t> sizes;
  for (std::uint32_t b = 0; b < blocks.size(); ++b) sizes.push_back(engines.train->image_bytes(b, Precision::bf16));
  const ad::TransferGate trained = ad::transfer_gate(policy, ad::BlockWeights::kTrained, sizes);
  const ad::TransferGate frozen = ad::transfer_gate(policy, ad::BlockWeights::kFrozen, sizes);
  // Each block on the path of its own weights; a route the policy measured nowhere stays empty.
  const auto per_block = [&](const std::vector<bool>& if_trained, const std::vector<bool>& if_frozen) {
    std::vector<bool> pays;
    if (if_trained.empty() && if_frozen.empty()) return pays;
    for (std::uint32_t b = 0; b < blocks.size(); ++b) {
      const std::vector<bool>& source = blocks[b].trainable_masters ? if_trained : if_frozen;
      pays.push_back(!source.empty() && source[b]);
    }
    return pays;
  };
  ad::TransferGate gate;
  for (const Precision route : kPrecisions) gate.pays[route] = per_block(trained.pays[route], frozen.pays[route]);
  const auto count = [](const std::vector<bool>& pays) { return std::count(pays.begin(), pays.end(), true); };
  const auto trainable =
      std::count_if(blocks.begin(), blocks.end(), [](const BlockGroup& b) { return b.trainable_masters; });
  const char* kind = trainable == 0 ? "frozen" : trainable == static_cast<std::ptrdiff_t>(blocks.size()) ? "trained" : "trained and frozen";
  std::string pays_for;
  for (Precision tier : kQuantizedPrecisions) {
    pays_for +=
        fmt::format("{}{} pays for {}", pays_for.empty() ? "" : ", ", route_traits(tier).label, count(gate.pays[tier]));
  }
  log->info("transfer policy {} ({} blocks): {} of {} blocks", file.string(), kind, pays_for, blocks.size());
  engines.train->policy_bridge().set_transfer_gate(gate);
  engines.eval->policy_bridge().set_transfer_gate(std::move(gate));
}

const sp::host::UnitSignalTable& StreamedModel::unit_signals() const { return impl_->policy_link.last_signals(); }

bool StreamedModel::set_unit_signals(const sp::host::UnitSignalTable& table) {
  Impl& m = *impl_;
  if (m.step_state.in_step()) throw std::logic_error("StreamedModel::set_unit_signals: call it between steps");
  bool first_hints = false;
  if (!m.policy_link.set_unit_signals(m.step_state.last_begun(), table, first_hints)) return false;
  if (first_hints) m.route_first_hints();
  return true;
}

std::vector<std::vector<Precision>> StreamedModel::propose_allocations() {
  Impl& m = *impl_;
  if (m.step_state.in_step()) throw std::logic_error("StreamedModel::propose_allocations: call it between steps");
  return m.policy_link.propose_allocations();
}

bool StreamedModel::set_allocation_measurements(const std::vector<std::vector<Precision>>& allocations,
                                                const std::vector<std::vector<double>>& example_costs,
                                                double confidence) {
  Impl& m = *impl_;
  if (m.step_state.in_step())
    throw std::logic_error("StreamedModel::set_allocation_measurements: call it between steps");
  bool first_hints = false;
  if (!m.policy_link.set_allocation_measurements(m.step_state.last_begun(), allocations, example_costs, confidence,
                                                 first_hints)) {
    return false;
  }
  if (first_hints) m.route_first_hints();
  return true;
}

std::optional<std::vector<double>> StreamedModel::unit_costs(Precision precision) {
  return impl_->policy_link.session().unit_costs(to_abi(precision));
}

std::optional<sp_budget_status_v1> StreamedModel::budget_status() {
  return impl_->policy_link.session().budget_status();
}

void StreamedModel::set_transfer_gate(sp::adapters::TransferGate gate) {
  impl_->engines.train->policy_bridge().set_transfer_gate(gate);
  impl_->engines.eval->policy_bridge().set_transfer_gate(std::move(gate));
}

std::optional<sp::host::SwapResult> StreamedModel::poll_plugin(bool force) {
  if (impl_->step_state.in_step()) throw std::logic_error("StreamedModel::poll_plugin: call it between steps");
  Impl& m = *impl_;
  if (!m.shards.group()) return m.policy_link.session().check_for_new_version(force);
  // Rank 0 looks at the file; every rank then asks for the swap at the same step boundary.
  std::optional<sp::host::SwapResult> request;
  if (m.shards.group()->rank() == 0) request = m.policy_link.session().check_for_new_version(force);
  torch::Tensor requested =
      torch::tensor({request && request->outcome != sp::host::SwapResult::Outcome::failed ? 1 : 0}, torch::kInt32);
  m.shards.group()->broadcast(requested, 0, "plugin swap request");
  if (requested.item<std::int32_t>() == 0) return request;
  if (m.shards.group()->rank() != 0) request = m.policy_link.session().check_for_new_version(/*force=*/true);
  // All or nothing: the lowest rank that could not stage the new version, or the world size
  // when every rank did. Where one failed, every rank drops its staged copy and keeps the old.
  const bool staged = request && request->outcome == sp::host::SwapResult::Outcome::pending;
  torch::Tensor first_failure =
      torch::tensor({staged ? m.shards.group()->size() : m.shards.group()->rank()}, torch::kInt32);
  m.shards.group()->all_reduce(first_failure, Reduction::min, "plugin swap staging")->wait();
  const int failed_rank = first_failure.item<std::int32_t>();
  if (failed_rank == m.shards.group()->size()) return request;
  const std::string why =
      fmt::format("rank {} of {} could not load the new version, so every rank keeps the old one{}", failed_rank,
                  m.shards.group()->size(), staged ? "" : fmt::format(" ({})", request ? request->message : "no file"));
  if (staged) return m.policy_link.session().cancel_swap(why);
  if (request) request->message = why;
  return request;
}

}  // namespace sp::torch_layer
