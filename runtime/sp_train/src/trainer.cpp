// sp-train's step and loop: a training step through the streaming layer, evaluation, the step
// records, the summary, and the run.
#include "trainer_impl.h"

#include <utility>

#include "sp/precision_abi.h"

namespace sp::train {

namespace {

// Steps in a row with a non-finite loss or gradient (each skipped) before the run gives up.
constexpr int kMaxNonFiniteSteps = 8;

// `more` with one key per route, the route's name: {"bf16": ..., "int8": ..., "nf4": ...}.
template <class T>
nlohmann::json per_route(const PerPrecision<T>& values, nlohmann::json more = nlohmann::json::object()) {
  for (Precision precision : kPrecisions) more[precision_name(precision)] = values[precision];
  return more;
}

}  // namespace

Trainer::Impl::BoundaryRequests Trainer::Impl::boundary_requests() const {
  BoundaryRequests r{options.stop_requested && options.stop_requested->load(),
                     options.plugin_check_requested && options.plugin_check_requested->exchange(false)};
  if (!collectives) return r;
  torch::Tensor flags = torch::tensor({r.stop ? 1 : 0, r.check_plugin ? 1 : 0}, torch::kInt32);
  collectives->all_reduce(flags, tl::Reduction::max, "stop and swap requests")->wait();
  return {flags[0].item<std::int32_t>() != 0, flags[1].item<std::int32_t>() != 0};
}

// {"status", "errors" (INT8's, the key the summary had before a second quantized route),
// "<route>_errors" for each later one}.
nlohmann::json Trainer::Impl::calibration_summary() const {
  nlohmann::json summary{{"status", calibration_status}};
  for (const Precision tier : kQuantizedPrecisions) {
    const std::string key = tier == Precision::int8 ? "errors" : fmt::format("{}_errors", precision_name(tier));
    summary[key] = calibration_errors[tier];
  }
  return summary;
}

std::vector<std::uint8_t> Trainer::Impl::decisions() const {
  std::vector<std::uint8_t> out(n_units, SP_PRECISION_BF16);
  const std::vector<sp::host::UnitHint>& hints = layer->hints();
  for (std::size_t u = 0; u < hints.size(); ++u) out[u] = static_cast<std::uint8_t>(to_abi(hints[u].precision));
  return out;
}

std::pair<torch::Tensor, torch::Tensor> Trainer::Impl::tensors_of(std::vector<std::int64_t>& tokens,
                                                                  std::uint32_t batch) const {
  const std::int64_t window = config.model.seq_len + 1;
  const torch::Tensor all = torch::from_blob(tokens.data(), {batch, window}, torch::kInt64);
  const auto place = [&](const torch::Tensor& t) {
    return t.to(compute.device(), torch::kInt64, /*non_blocking=*/false, /*copy=*/true);
  };
  return {place(all.narrow(1, 0, window - 1)), place(all.narrow(1, 1, window - 1))};
}

double Trainer::Impl::evaluate() {
  torch::NoGradGuard no_grad;
  std::vector<std::int64_t> tokens;
  double sum = 0.0;
  for (std::uint32_t i = 0; i < config.train.eval_batches; ++i) {
    // Each rank takes its share of a batch of batch_size * world_size rows, as in training.
    const std::uint32_t rows = config.train.batch_size;
    corpus->val_batch(i, config.train.eval_batches, rows * world_size(), tokens, rows * rank(), rows);
    auto [idx, targets] = tensors_of(tokens, rows);
    sum += model->head_loss(layer->forward(model->embed(idx)), targets).item<double>();
  }
  return layer->average(sum / config.train.eval_batches);
}

double Trainer::Impl::learning_rate(std::int64_t step) const {
  const TrainLoopConfig& t = config.train;
  if (step < t.lr_warmup_steps) return t.lr * static_cast<double>(step + 1) / t.lr_warmup_steps;
  const double span = std::max<std::int64_t>(1, t.steps - t.lr_warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - t.lr_warmup_steps) / span);
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return t.lr * (t.min_lr_ratio + (1.0 - t.min_lr_ratio) * cosine);
}

double Trainer::Impl::global_grad_norm(const std::vector<sp_grad_moments_v1>& moments) const {
  double sum_sq = 0.0;
  for (const sp_grad_moments_v1& m : moments) {
    if (m.nonfinite != 0) return NAN;
    sum_sq += m.sum_sq;
  }
  for (std::size_t r : non_adapter_resident) sum_sq += model->resident()[r].grad.pow(2).sum().item<double>();
  return std::sqrt(sum_sq);
}

double Trainer::Impl::clip_scale(double grad_norm) const {
  const double clip = config.train.grad_clip;
  return clip > 0.0 && grad_norm > clip ? clip / grad_norm : 1.0;
}

void Trainer::Impl::update_resident() {
  for (std::size_t index : adam_resident) adam->step_parameter(index);
  model->refresh_compute();
}

void Trainer::Impl::optimizer_step(double lr, double grad_norm) {
  adam->begin_step(lr, clip_scale(grad_norm));
  update_resident();
  if (config.train.host_optimizer != HostOptimizer::unfused) {
    for (std::uint32_t u = 0; u < unit_moments.size(); ++u) {
      if (layer->owner(u) == rank()) layer->update_masters(u, adam->step_constants(), unit_moments[u]);
    }
  } else {
    for (std::size_t index : adam_masters) adam->step_parameter(index);
  }
}

StepRecord Trainer::Impl::train_step(std::int64_t step) {
  const auto start = Clock::now();
  const std::uint32_t batch = config.train.batch_size;
  StepRecord record;
  record.step = step;
  record.lr = learning_rate(step);
  record.calibration_step = std::exchange(calibration_step_due, false);

  layer->begin_step(step);
  record.plugin_version = std::string(layer->policy().plugin_version());
  for (Precision route : layer->routes()) record.routes.push_back(static_cast<std::uint8_t>(to_abi(route)));

  std::vector<std::int64_t> tokens;
  corpus->train_batch(config.train.seed, step, batch, tokens,
                      std::uint64_t{batch} * static_cast<std::uint64_t>(rank()));
  auto [idx, targets] = tensors_of(tokens, batch);
  model->clear_gradients();
  for (torch::Tensor& g : master_grads) g.zero_();
  // The overlapped update steps the masters during the backward, before this step's gradient
  // norm exists: it clips by the previous step's (the last finite one). A run's first step,
  // or a resume from a checkpoint without that norm, has none and updates after the backward.
  const bool overlapped = config.train.mode == TrainMode::full &&
                          config.train.host_optimizer == HostOptimizer::overlapped && previous_grad_norm &&
                          !record.calibration_step;
  if (overlapped) {
    adam->begin_step(record.lr, clip_scale(*previous_grad_norm));
    layer->update_masters_during_backward(adam->step_constants(), unit_moments);
  }

  // The layer fetches each block for the forward and again, in reverse, for the backward,
  // where it recomputes and differentiates it; the masters' gradients land in their .grad.
  const torch::Tensor loss = model->head_loss(layer->forward(model->embed(idx)), targets);
  loss.backward();
  // The layer averaged across ranks the gradients its blocks produced; the embedding and
  // the head are this host's, which the step sequence averages. Every rank records, and the
  // plugin sees, the loss's mean across ranks.
  const auto [mean_loss, moments] = layer->prepare_update(model->outside_blocks(), [&] {
    model->queue_resident_gradients_to_host();
    // The backward's one host synchronization. Reading the loss waits for the compute stream,
    // on which every gradient copy to the host was queued before it, so the host gradients
    // are complete from here on. Read earlier, the loss would stall the host before the
    // backward was queued.
    return loss.item<double>();
  });
  record.loss = mean_loss;
  record.decisions = decisions();
  record.grad_norm = global_grad_norm(moments);
  const auto update_start = Clock::now();
  if (record.calibration_step) {
    log->info("step {}: a calibration step (policy v3): the policy allocated from its gradients; no update", step);
  } else if (std::isfinite(record.grad_norm) && std::isfinite(record.loss)) {
    nonfinite_streak = 0;
    if (overlapped) {
      update_resident();  // the streamed masters were updated during the backward
    } else {
      optimizer_step(record.lr, record.grad_norm);
    }
    previous_grad_norm = record.grad_norm;
  } else if (++nonfinite_streak >= kMaxNonFiniteSteps) {
    throw DivergedError(
        fmt::format("step {}: loss {}, gradient norm {}; {} steps in a row were skipped "
                    "(lower train.lr?)",
                    step, record.loss, record.grad_norm, nonfinite_streak));
  } else if (overlapped) {
    log->warn(
        "step {}: non-finite loss or gradients; the resident parameters are not updated, the streamed blocks "
        "whose gradients are finite were, during the backward",
        step);
  } else {
    log->warn("step {}: non-finite loss or gradients; the update is skipped", step);
  }

  const tl::StepReport report = layer->end_step(record.loss);
  record.update_seconds = seconds_since(update_start);
  // A non-finite step that the overlap left wholly unapplied (no block updated, nor the
  // resident parameters) does not count for the bias correction, as in the exact modes; one
  // that updated some blocks does.
  if (overlapped && nonfinite_streak > 0) {
    // Sharded, each rank updates its own units: the step is unapplied only where every rank
    // skipped all of them, and every rank's bias correction must follow the same count.
    std::uint32_t owned = 0;
    for (std::uint32_t u = 0; u < n_units; ++u) owned += layer->owner(u) == rank() ? 1 : 0;
    bool unapplied = report.updates_skipped.size() == owned;
    if (layer->sharded()) unapplied = !first_failing_rank(unapplied, "whether any rank updated a block");
    if (unapplied) adam->set_steps_taken(adam->steps_taken() - 1);
  }
  if (report.swap) note_swap(step, *report.swap, record);
  if (report.calibration) {
    calibration_errors = *report.calibration;
    calibration_status = fmt::format("re-calibrated at step {}", step);
    nlohmann::json recalibration{{"seconds", report.calibration_seconds}};
    std::string errors_text;
    for (Precision tier : kQuantizedPrecisions) {
      recalibration[precision_name(tier)] = calibration_errors[tier];
      errors_text += fmt::format("{}{} {:.4f}", errors_text.empty() ? "" : ", ", route_traits(tier).label,
                                 fmt::join(calibration_errors[tier], " "));
    }
    record.recalibration = std::move(recalibration);
    log->debug("step {}: re-calibrated in {:.3f}s: {}", step, report.calibration_seconds, errors_text);
  }
  record.h2d_bytes = report.h2d_bytes;
  record.h2d_bytes_all_bf16 = report.h2d_bytes_all_bf16;
  record.seconds = seconds_since(start);
  return record;
}

void Trainer::Impl::note_swap(std::int64_t step, const sp::host::SwapResult& swap, StepRecord& record) {
  const bool swapped = swap.outcome == sp::host::SwapResult::Outcome::swapped;
  record.swap_note = swapped ? fmt::format("swapped {} -> {}", swap.old_version, swap.new_version)
                             : fmt::format("swap failed, kept {}: {}", swap.old_version, swap.message);
  (swapped ? log->info("step {}: plugin {}", step, record.swap_note)
           : log->warn("step {}: plugin {}", step, record.swap_note));
  totals.swaps.push_back({{"step", step},
                          {"outcome", swapped ? "swapped" : "failed"},
                          {"old_version", swap.old_version},
                          {"new_version", swap.new_version},
                          {"message", swap.message}});
}

void Trainer::Impl::poll_plugin(std::int64_t step, bool forced) {
  const std::int64_t every = config.train.plugin_poll_steps;
  if (!forced && (every == 0 || step % every != 0)) return;
  if (std::optional<sp::host::SwapResult> request = layer->poll_plugin(forced)) {
    if (request->outcome == sp::host::SwapResult::Outcome::failed) {
      log->warn("plugin file changed but cannot be swapped in; keeping {}: {}", layer->policy().plugin_version(),
                request->message);
      totals.swaps.push_back({{"step", step}, {"outcome", "failed"}, {"message", request->message}});
    } else {
      log->info("plugin file changed: swapping to {} at the start of step {}", request->new_version, step);
    }
  }
}

void Trainer::Impl::write_step_record(const StepRecord& r) {
  nlohmann::json record = {{"step", r.step},
                           {"loss", r.loss},
                           {"lr", r.lr},
                           {"grad_norm", r.grad_norm},
                           {"routes", r.routes},
                           {"decisions", r.decisions},
                           {"h2d_bytes_all_bf16", r.h2d_bytes_all_bf16},
                           {"seconds", r.seconds},
                           {"update_seconds", r.update_seconds},
                           {"plugin_version", r.plugin_version}};
  for (Precision precision : kPrecisions) {
    record[fmt::format("h2d_bytes_{}", precision_name(precision))] = r.h2d_bytes[precision];
  }
  if (r.val_loss) record["val_loss"] = *r.val_loss;
  if (!r.swap_note.empty()) record["plugin_swap"] = r.swap_note;
  if (r.recalibration) record["recalibration"] = *r.recalibration;
  if (r.calibration_step) record["calibration_step"] = true;
  train_metrics->append(record);
}

nlohmann::json Trainer::Impl::summary(RunOutcome outcome, double wall_seconds) const {
  const std::uint64_t moved = totals.h2d.total();
  const std::uint64_t saved = totals.h2d_all_bf16 - moved;
  const double tokens_per_second = totals.train_seconds > 0 ? totals.tokens / totals.train_seconds : 0.0;
  return {{"outcome", outcome == RunOutcome::completed ? "completed" : "interrupted"},
          {"steps", next_step},
          {"final_val_loss",
           totals.val_history.empty() ? nlohmann::json() : nlohmann::json(totals.val_history.back().second)},
          {"final_train_loss", std::isfinite(totals.last_loss) ? nlohmann::json(totals.last_loss) : nlohmann::json()},
          {"val_loss_history", totals_json()["val_history"]},
          {"h2d_bytes",
           per_route(totals.h2d, {{"total", moved},
                                  {"all_bf16_equivalent", totals.h2d_all_bf16},
                                  {"saved", saved},
                                  {"saved_fraction",
                                   totals.h2d_all_bf16 ? static_cast<double>(saved) / totals.h2d_all_bf16 : 0.0}})},
          {"eval_h2d_bytes", eval_h2d()},
          {"calibration_h2d_bytes", calibration_h2d()},
          {"block_steps", per_route(totals.block_steps)},
          {"final_decisions", decisions()},
          {"tokens", totals.tokens},
          {"tokens_per_second", tokens_per_second},
          {"train_seconds", totals.train_seconds},
          {"update_seconds", totals.update_seconds},
          {"wall_seconds", wall_seconds},
          {"mode", mode_name(config.train.mode)},
          // Full mode only: LoRA's streamed masters are frozen.
          {"host_optimizer", config.train.mode == TrainMode::full
                                 ? nlohmann::json(host_optimizer_name(config.train.host_optimizer))
                                 : nlohmann::json()},
          {"adam_moments", adam_moments_name(config.train.adam_moments)},
          {"device", compute_device_name(config.train.device)},
          {"compute_dtype", compute_dtype_name(config.train.compute_dtype)},
          {"model", model_identity()},
          {"plugin",
           {{"name", layer->policy().host().plugin_name()},
            {"version", layer->policy().plugin_version()},
            {"hook_failures", layer->policy().host().hook_failures().total()}}},
          {"plugin_swaps", totals.swaps},
          {"calibration", calibration_summary()},
          {"config", config.source_name},
          {"model_outliers",
           {{"blocks", config.model.outlier_blocks},
            {"magnitude", config.model.outlier_magnitude},
            {"channels", config.model.outlier_channels}}},
          {"torch_threads", torch::get_num_threads()},
          {"data_parallel",
           {{"rank", rank()},
            {"world_size", world_size()},
            {"mode", data_parallel_name(config.train.data_parallel)},
            {"gradients_reduced_on", layer->gradient_reduction_device().str()}}},
          {"peak_rss_bytes", peak_rss_bytes()},
          {"previous_crash", previous_crash ? nlohmann::json(*previous_crash) : nlohmann::json()},
          // The peak RSS expected: what the process held before it built the model, and the estimate.
          {"estimated_host_bytes", resident_before_build + estimated_host_bytes(config, shards())},
          {"resident_before_model_bytes", resident_before_build},
          // Records the run could not write (disk full, ...): each loss was logged when it happened.
          {"log_records_lost",
           {{kRunTrainMetricsFile, train_metrics->lost()}, {"transfer_metrics", layer->metrics_records_lost()}}}};
}

RunSummary Trainer::Impl::run() {
  const auto wall_start = Clock::now();
  RunSummary result;
  ProgressLine no_progress(stdout, false);
  ProgressLine& progress = options.progress && rank() == 0 ? *options.progress : no_progress;
  const std::int64_t total = config.train.steps;
  const std::uint64_t tokens_per_step = std::uint64_t{config.train.batch_size} * config.model.seq_len;
  if (next_step >= total) log->info("nothing to do: the run is already at step {} of {}", next_step, total);
  const auto run_start = Clock::now();
  const std::int64_t first = next_step;
  while (next_step < total) {
    const BoundaryRequests requests = boundary_requests();
    if (requests.stop) {
      progress.finish();
      log->warn("interrupted: writing a checkpoint at step {}", next_step);
      result.outcome = RunOutcome::interrupted;
      break;
    }
    poll_plugin(next_step, requests.check_plugin);
    StepRecord record = train_step(next_step);
    ++next_step;
    totals.h2d += record.h2d_bytes;
    totals.h2d_all_bf16 += record.h2d_bytes_all_bf16;
    totals.tokens += tokens_per_step;
    totals.train_seconds += record.seconds;
    totals.update_seconds += record.update_seconds;
    totals.last_loss = record.loss;
    PerPrecision<std::uint64_t> blocks_per_route;
    for (std::uint8_t code : record.routes) ++blocks_per_route[from_abi(code).value()];
    totals.block_steps += blocks_per_route;
    if (next_step % config.train.eval_interval == 0 || next_step == total) {
      record.val_loss = evaluate();
      totals.val_history.emplace_back(next_step, *record.val_loss);
    }
    write_step_record(record);

    ProgressState state;
    state.step = next_step;
    state.total = total;
    state.loss = record.loss;
    state.val_loss =
        totals.val_history.empty() ? std::nullopt : std::optional<double>(totals.val_history.back().second);
    state.tokens_per_second = totals.train_seconds > 0 ? totals.tokens / totals.train_seconds : 0.0;
    for (const Precision route : kPrecisions) state.blocks[route] = static_cast<std::uint32_t>(blocks_per_route[route]);
    state.bytes_all_bf16 = totals.h2d_all_bf16;
    state.bytes_saved = totals.h2d_all_bf16 - totals.h2d.total();
    state.eta_seconds = seconds_since(run_start) / (next_step - first) * (total - next_step);
    progress.update(state);

    if (options.on_step) options.on_step(record);
    result.steps.push_back(std::move(record));
    if (config.train.checkpoint_interval > 0 && next_step % config.train.checkpoint_interval == 0 &&
        next_step < total) {
      save_checkpoint();
    }
  }
  progress.finish();
  layer->flush_metrics();
  save_checkpoint();
  result.json = summary(result.outcome, seconds_since(wall_start));
  if (const std::uint64_t lost = train_metrics->lost() + layer->metrics_records_lost()) {
    log->error("{} log record(s) could not be written (disk full?); summary.json counts them per file", lost);
  }
  result.summary_file = run_dir / kRunSummaryFile;
  sp::runtime::write_file_atomically(result.summary_file,
                                     result.json.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  return result;
}

namespace {

// LibTorch's errors carry a C++ backtrace meant for its own developers; the user gets the
// message. Running out of memory is a model or batch too big for this machine: a config matter.
// The layer's data-parallel failures end the run with their own exit code.
template <typename Work>
auto reporting_torch_errors(Work&& work) {
  constexpr const char* kTooBig =
      "not enough memory for this model and batch (model.d_model, model.n_blocks, model.seq_len, "
      "train.batch_size); lower them: {}";
  try {
    return work();
  } catch (const tl::CollectiveError& e) {
    throw DistributedError(e.what());
  } catch (const tl::RankMismatchError& e) {
    throw DistributedError(e.what());
  } catch (const std::bad_alloc& e) {
    throw ConfigError(fmt::format(kTooBig, e.what()));
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    if (message.find("can't allocate memory") != std::string::npos) throw ConfigError(fmt::format(kTooBig, message));
    throw std::runtime_error(message);
  }
}

}  // namespace

Trainer::Trainer(TrainConfig config, RunOptions options)
    : impl_(reporting_torch_errors([&] { return std::make_unique<Impl>(std::move(config), std::move(options)); })) {}
Trainer::~Trainer() = default;
RunSummary Trainer::run() {
  return reporting_torch_errors([&] { return impl_->run(); });
}
std::int64_t Trainer::next_step() const { return impl_->next_step; }
const std::string& Trainer::calibration_status() const { return impl_->calibration_status; }
const CalibrationErrors& Trainer::calibration_errors() const { return impl_->calibration_errors; }

}  // namespace sp::train
