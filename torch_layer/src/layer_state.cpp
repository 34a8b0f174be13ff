// Sharding (each block's masters on one rank), the layer's state for checkpoints, and
// calibration.
#include "streamed_model_impl.h"

#include <algorithm>
#include <cctype>

namespace sp::torch_layer {

void StreamedModel::Impl::shard_masters() {
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    share_image(*engines.train, b, Precision::bf16);  // every engine starts on BF16
    if (shards.owns(b)) continue;
    engines.train->forget_masters(b);
    engines.eval->forget_masters(b);
    blocks[b].forget_masters();
  }
}

void StreamedModel::Impl::share_image(ad::StreamingEngine& target, std::uint32_t b, Precision precision) {
  const int root = shards.owner(b);
  const std::string what = fmt::format("the {} image of {}", precision_name(precision), blocks[b].block.name);
  const auto send = [&](std::uint8_t* data, std::uint64_t bytes) {
    shards.group()->broadcast(torch::from_blob(data, {static_cast<std::int64_t>(bytes)}, torch::kUInt8), root, what);
  };
  if (shards.owns(b)) {
    const ad::StreamingEngine::ImageBytes image = target.image(b, precision);
    // A broadcast's root only reads its tensor.
    send(const_cast<std::uint8_t*>(image.data), image.bytes);
  } else {
    target.receive_image(b, precision, send);
  }
}

std::map<std::string, torch::Tensor> StreamedModel::gather_masters(std::uint32_t block) {
  Impl& m = *impl_;
  if (m.step_state.in_step()) throw std::logic_error("StreamedModel::gather_masters: call it between steps");
  if (block >= m.blocks.size()) {
    throw std::invalid_argument(
        fmt::format("StreamedModel::gather_masters: block {} is out of range (there are {})", block, m.blocks.size()));
  }
  const BlockGroup& b = m.blocks[block];
  if (m.shards.owns(block) && !m.shards.sharded()) return b.masters;
  std::map<std::string, torch::Tensor> out;
  for (const StreamedParameter& p : b.streamed) {
    torch::Tensor whole = m.shards.owns(block) ? p.master.detach() : torch::empty(p.shape, torch::kFloat32);
    m.shards.group()->broadcast(whole, m.shards.owner(block), fmt::format("{}'s master '{}'", b.block.name, p.name));
    out.emplace(p.name, m.shards.owns(block) ? p.master : whole);
  }
  return out;
}

void StreamedModel::Impl::share_images(bool all, const std::vector<bool>& rebuilt) {
  if (!shards.sharded()) return;
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    const Precision route = engines.train->policy_bridge().route(b);
    if (!all && !(b < rebuilt.size() && rebuilt[b]) && blocks[b].shared_on(route)) continue;
    share_image(*engines.train, b, route);
    blocks[b].mark_shared(route);
  }
}

void StreamedModel::Impl::share_eval_images(const std::vector<Precision>& routes) {
  if (!shards.sharded()) return;
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    if (shards.owns(b) && blocks[b].evaluation_image_stale()) engines.eval->on_weights_updated(b);
    share_image(*engines.eval, b, routes.at(b));
    blocks[b].mark_evaluation_image_fresh();
  }
}

void StreamedModel::Impl::refresh_eval_image(std::uint32_t b) {
  if (engines.eval->has_masters(b)) {
    engines.eval->on_weights_updated(b);
    return;
  }
  const Precision route = engines.eval->policy_bridge().route(b);
  const ad::StreamingEngine::ImageBytes image = engines.train->image(b, route);
  engines.eval->receive_image(b, route,
                              [&](std::uint8_t* data, std::uint64_t bytes) { std::memcpy(data, image.data, bytes); });
}

void StreamedModel::Impl::gather_moments(std::vector<sp_grad_moments_v1>& moments) {
  constexpr std::int64_t kFields = 5;
  torch::Tensor values = torch::zeros({static_cast<std::int64_t>(moments.size()) * kFields}, torch::kFloat64);
  double* v = values.data_ptr<double>();
  for (std::uint32_t u = 0; u < moments.size(); ++u, v += kFields) {
    if (!shards.owns_unit(u)) continue;
    const sp_grad_moments_v1& m = moments[u];
    v[0] = m.sum_sq, v[1] = m.sum, v[2] = m.max_abs;
    v[3] = static_cast<double>(m.count), v[4] = static_cast<double>(m.nonfinite);
  }
  shards.group()->all_reduce(values, Reduction::sum, "the blocks' gradient moments")->wait();
  v = values.data_ptr<double>();
  for (std::uint32_t u = 0; u < moments.size(); ++u, v += kFields) {
    sp_grad_moments_v1& m = moments[u];
    m.sum_sq = v[0], m.sum = v[1], m.max_abs = v[2];
    m.count = static_cast<std::uint64_t>(v[3]), m.nonfinite = static_cast<std::uint64_t>(v[4]);
  }
}

void StreamedModel::Impl::restore_state(const std::map<std::string, torch::Tensor>& state) {
  const auto entry = [&](const std::string& key, torch::ScalarType type) -> torch::Tensor {
    const auto it = state.find(key);
    if (it == state.end()) throw StateEntryError(key, "missing");
    if (it->second.scalar_type() != type || !it->second.device().is_cpu()) {
      throw StateEntryError(key,
                            fmt::format("{} on {}; expected {} on the CPU", c10::toString(it->second.scalar_type()),
                                        it->second.device().str(), c10::toString(type)));
    }
    return it->second.contiguous();
  };
  // Everything is checked before anything changes.
  std::vector<std::pair<StreamedParameter*, torch::Tensor>> masters;
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    if (!shards.owns(b)) continue;  // sharded: its owner restores it; an entry for it is not read
    for (StreamedParameter& p : blocks[b].streamed) {
      const std::string key = master_key(blocks[b], p);
      torch::Tensor saved = entry(key, torch::kFloat32);
      if (saved.sizes() != p.master.sizes()) {
        throw StateEntryError(
            key, fmt::format("shape {}; expected {}", fmt::join(saved.sizes(), "x"), fmt::join(p.master.sizes(), "x")));
      }
      masters.emplace_back(&p, std::move(saved));
    }
  }
  const torch::Tensor blob = entry("policy/state", torch::kUInt8);
  const torch::Tensor hints = entry("policy/hints", torch::kUInt8);
  const torch::Tensor steps_begun = entry("layer/passes", torch::kInt64);
  // Absent from states written before steps were checked: the count starts afresh.
  std::optional<std::int64_t> restored_last_step;
  if (state.count("layer/last_step")) {
    const torch::Tensor last = entry("layer/last_step", torch::kInt64);
    if (last.numel() != 1 || last.data_ptr<std::int64_t>()[0] < -1) {
      throw StateEntryError("layer/last_step", "expected one step number, or -1 for none");
    }
    if (last.data_ptr<std::int64_t>()[0] >= 0) restored_last_step = last.data_ptr<std::int64_t>()[0];
  }
  const std::size_t hint_bytes = static_cast<std::size_t>(hints.numel());
  if (hint_bytes % sizeof(sp_hint_v1) != 0 || (hint_bytes != 0 && hint_bytes != num_units() * sizeof(sp_hint_v1))) {
    throw StateEntryError("policy/hints",
                          fmt::format("holds {} bytes; expected none or {} hints (one per policy unit)", hint_bytes,
                                      num_units()));
  }
  if (steps_begun.numel() != 2)
    throw StateEntryError("layer/passes", fmt::format("holds {} values; expected 2", steps_begun.numel()));
  std::vector<sp_hint_v1> stored(hint_bytes / sizeof(sp_hint_v1));
  if (hint_bytes) std::memcpy(stored.data(), hints.data_ptr(), hint_bytes);
  std::vector<sp::host::UnitHint> restored;
  try {
    restored = sp::host::hints_from_abi(stored);
  } catch (const std::invalid_argument& e) {
    throw StateEntryError("policy/hints", e.what());
  }
  // The plugin's state comes after the hints, and a plugin that rejects it leaves the previous
  // hints in force. No hints (a state exported before the plugin's first ones): the default
  // routes again.
  const std::vector<sp::host::UnitHint> previous = policy_link.session().hints();
  const auto put_hints = [&](std::vector<sp::host::UnitHint> hints) {
    policy_link.session().restore_hints(std::move(hints));
    route_by_hints();
  };
  put_hints(std::move(restored));
  try {
    if (blob.numel() == 0) {
      log->warn("StreamedModel: the state holds no plugin state (it could not be exported); the policy starts over");
    } else {
      policy_link.session().restore_state(
          std::vector<std::uint8_t>(blob.data_ptr<std::uint8_t>(), blob.data_ptr<std::uint8_t>() + blob.numel()));
    }
  } catch (...) {
    put_hints(previous);
    throw;
  }
  {
    torch::NoGradGuard no_grad;
    for (auto& [p, saved] : masters) p->master.copy_(saved);
  }
  passes.restore_engine_steps(steps_begun.data_ptr<std::int64_t>()[0]);
  evaluation.restore_engine_steps(steps_begun.data_ptr<std::int64_t>()[1]);
  step_state.restore_last_begun(restored_last_step);
  note_image_versions();
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    if (shards.owns(b)) engines.train->on_weights_updated(b);
  }
  for (BlockGroup& block : blocks) block.mark_evaluation_image_stale();
}

void StreamedModel::Impl::calibration_pass(const ad::RuntimeLimitHints& limits,
                                           const std::function<void(std::uint32_t)>& run) {
  // The blocks as a chain in their order (calibrate(x), forward(x)), whichever order the
  // host's own evaluation passes call them in.
  if (evaluation.is_open()) evaluation.end_pass();
  engines.eval->set_block_order({});
  begin_eval_pass(limits);
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    eval_block(b, [&](const NamedParameters&) {
      run(b);
      return 0;
    });
  }
  evaluation.count_calibration(evaluation.end_pass().h2d_bytes.total());
}

CalibrationErrors StreamedModel::Impl::measure_calibration_errors(const std::vector<torch::Tensor>& samples) {
  if (step_state.in_step()) throw std::logic_error("StreamedModel: calibrate between steps, not inside one");
  if (samples.empty()) throw std::invalid_argument("StreamedModel: calibration without samples");
  for (const BlockGroup& b : blocks) {
    if (b.params_are_masters) {
      throw std::logic_error(fmt::format(
          "StreamedModel: calibration feeds each block the output of the one before, one tensor; {} computes "
          "through Block::call, whose inputs the layer cannot make up",
          b.block.name));
    }
  }
  torch::NoGradGuard no_grad;
  const std::size_t n = blocks.size();
  CalibrationErrors errors;
  const auto on_host = [](const torch::Tensor& t) { return t.to(torch::kCPU, torch::kFloat32).contiguous(); };
  // One route at a time over every sample, so that a sharded model shares each route's
  // images once: the BF16 outputs of every block are kept for the quantized passes.
  std::vector<std::vector<torch::Tensor>> references;
  share_eval_images(std::vector<Precision>(n, Precision::bf16));
  for (const torch::Tensor& sample : samples) {
    std::vector<torch::Tensor>& reference = references.emplace_back(std::vector<torch::Tensor>{sample});
    calibration_pass(pinned_to(Precision::bf16),
                     [&](std::uint32_t b) { reference.push_back(blocks[b].block.forward(reference.back())); });
  }
  for (const Precision precision : kPrecisions) {
    if (!is_quantized(precision)) continue;
    std::vector<double>* sums = &errors[precision];
    sums->assign(n, 0.0);
    share_eval_images(std::vector<Precision>(n, precision));
    for (const std::vector<torch::Tensor>& reference : references) {
      calibration_pass(pinned_to(precision), [&, sums = sums](std::uint32_t b) {
        const torch::Tensor quantized = on_host(blocks[b].block.forward(reference[b]));
        const torch::Tensor expected = on_host(reference[b + 1]);
        (*sums)[b] +=
            kn::relative_error(expected.data_ptr<float>(), kn::DType::kFloat32, quantized.data_ptr<float>(),
                               kn::DType::kFloat32, static_cast<std::size_t>(expected.numel()), intra_op_exec());
      });
    }
  }
  // The evaluation images are the pinned route's now: the next evaluation takes the routes in
  // force again (rebuilt by the owner, copied elsewhere).
  if (shards.sharded()) {
    for (BlockGroup& block : blocks) block.mark_evaluation_image_stale();
  }
  // The last pass's pins would stand until the next evaluation pass; dropped now, so that an
  // image rebuilt in between is built for the route the block takes next.
  engines.eval->policy_bridge().begin_step();
  for (std::vector<double>& per_block : errors.values) {
    for (double& e : per_block) e /= static_cast<double>(samples.size());
  }
  return errors;
}

void StreamedModel::Impl::require_units_are_blocks(const char* call) const {
  if (units_are_blocks()) return;
  throw std::logic_error(fmt::format(
      "StreamedModel::{}: the policy's units take several blocks each (StreamedModelOptions::units), and "
      "calibration errors are measured per block: policy v3 decides without them",
      call));
}

bool StreamedModel::Impl::set_calibration_errors(CalibrationErrors& errors) {
  if (shards.group()) {
    // Measured on every rank from the same weights and samples, but given from rank 0, so
    // that no rounding difference between machines can split the ranks' decisions.
    std::size_t count = 0;
    for (const std::vector<double>& per_block : errors.values) count += per_block.size();
    torch::Tensor values = torch::empty({static_cast<std::int64_t>(count)}, torch::kFloat64);
    double* next = values.data_ptr<double>();
    for (const std::vector<double>& per_block : errors.values)
      next = std::copy(per_block.begin(), per_block.end(), next);
    shards.group()->broadcast(values, 0, "calibration errors");
    const double* given = values.data_ptr<double>();
    for (std::vector<double>& per_block : errors.values) {
      std::copy_n(given, per_block.size(), per_block.begin());
      given += per_block.size();
    }
  }
  bool accepted = true;
  for (const Precision precision : kPrecisions) {
    if (!is_quantized(precision) || policy_link.session().set_calibration_errors(to_abi(precision), errors[precision]))
      continue;
    std::string name = precision_name(precision);
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::toupper(c); });
    log->warn("calibration: the plugin rejected the {} errors; it decides without them", name);
    accepted = false;
  }
  return accepted;
}

CalibrationErrors StreamedModel::calibrate(const std::vector<torch::Tensor>& samples) {
  impl_->require_units_are_blocks("calibrate");
  CalibrationErrors errors = impl_->measure_calibration_errors(samples);
  impl_->set_calibration_errors(errors);
  return errors;
}

CalibrationErrors StreamedModel::measure_calibration_errors(const std::vector<torch::Tensor>& samples) {
  return impl_->measure_calibration_errors(samples);
}

bool StreamedModel::set_calibration_errors(const CalibrationErrors& errors) {
  if (impl_->step_state.in_step())
    throw std::logic_error("StreamedModel::set_calibration_errors: call it between steps");
  impl_->require_units_are_blocks("set_calibration_errors");
  CalibrationErrors given = errors;
  return impl_->set_calibration_errors(given);
}

std::map<std::string, torch::Tensor> StreamedModel::export_state() const {
  const Impl& m = *impl_;
  if (m.step_state.in_step()) throw std::logic_error("StreamedModel::export_state: call it between steps");
  std::map<std::string, torch::Tensor> state;
  for (std::uint32_t b = 0; b < m.blocks.size(); ++b) {
    if (!m.shards.owns(b)) continue;
    for (const StreamedParameter& p : m.blocks[b].streamed)
      state.emplace(master_key(m.blocks[b], p), p.master.detach());
  }
  std::vector<std::uint8_t> blob;
  try {
    blob = m.policy_link.session().export_state();
  } catch (const sp::host::PluginError& e) {
    // The rest of the state is the run's: a checkpoint without the plugin's beats none. An
    // empty entry says so, and a resume starts the policy over (restore_state).
    m.log->error(
        "StreamedModel: the plugin's state is left out of this state ({}); a resume from it starts the "
        "policy over",
        e.what());
  }
  state.emplace("policy/state", torch::from_blob(const_cast<std::uint8_t*>(blob.data()),
                                                 {static_cast<std::int64_t>(blob.size())}, torch::kUInt8)
                                    .clone());
  const std::vector<sp_hint_v1> in_force = sp::host::hints_to_abi(m.policy_link.session().hints());
  torch::Tensor hints = torch::empty({static_cast<std::int64_t>(in_force.size() * sizeof(sp_hint_v1))}, torch::kUInt8);
  if (!in_force.empty()) std::memcpy(hints.data_ptr(), in_force.data(), hints.numel());
  state.emplace("policy/hints", hints);
  state.emplace("layer/passes", torch::tensor({m.passes.engine_steps(), m.evaluation.engine_steps()}, torch::kInt64));
  state.emplace("layer/last_step", torch::tensor({m.step_state.last_begun().value_or(-1)}, torch::kInt64));
  return state;
}

void StreamedModel::restore_state(const std::map<std::string, torch::Tensor>& state) {
  Impl& m = *impl_;
  if (m.step_state.in_step()) throw std::logic_error("StreamedModel::restore_state: call it between steps");
  if (!m.shards.sharded()) {
    m.restore_state(state);
    return;
  }
  // Sharded, the ranks then share their blocks' images: a rank that could not restore must
  // not leave the others waiting in that exchange, so all first learn whether every one did.
  std::exception_ptr failure;
  try {
    m.restore_state(state);
  } catch (...) {
    failure = std::current_exception();
  }
  const int size = m.shards.group()->size();
  torch::Tensor first_failure = torch::tensor({failure ? rank() : size}, torch::kInt32);
  m.shards.group()->all_reduce(first_failure, Reduction::min, "state restore outcomes")->wait();
  if (failure) std::rethrow_exception(failure);
  const int failed = first_failure.item<std::int32_t>();
  if (failed != size) {
    throw RankMismatchError(fmt::format(
        "StreamedModel::restore_state: rank {} of {} could not restore its state (it says why), so no rank goes on "
        "from it",
        failed, size));
  }
  m.share_images(/*all=*/true);
}

}  // namespace sp::torch_layer
