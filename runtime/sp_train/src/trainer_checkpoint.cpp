// sp-train's checkpoints: what a run writes to resume, sharded or whole, and how it reads it back.
#include "trainer_impl.h"

namespace sp::train {

namespace {

template <typename T>
std::vector<std::uint8_t> pod_bytes(const T& value) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&value);
  return {p, p + sizeof value};
}

}  // namespace

fs::path checkpoint_path(const fs::path& out_dir) { return out_dir / kRunCheckpointFile; }

std::optional<CheckpointSections> Trainer::Impl::find_checkpoint() {
  const fs::path file = checkpoint_path(options.out_dir);
  if (config.train.resume == ResumePolicy::never || !fs::exists(file)) return std::nullopt;
  try {
    return CheckpointSections::read(file);
  } catch (const CheckpointError& e) {
    throw ResumeError(fmt::format("{} (remove it, or pass --set train.resume=never to start over)", e.what()));
  }
}

nlohmann::json Trainer::Impl::model_identity() const {
  const ModelConfig& m = config.model;
  return {{"d_model", m.d_model},
          {"n_heads", m.n_heads},
          {"n_blocks", m.n_blocks},
          {"seq_len", m.seq_len},
          {"mlp_ratio", m.mlp_ratio},
          {"streaming_unit", streaming_unit_name(m.streaming_unit)},
          {"mode", mode_name(config.train.mode)},
          {"lora_rank", config.train.mode == TrainMode::lora ? config.train.lora.rank : 0},
          {"int8_group_size", config.streaming.int8_group_size},
          {"nf4_group_size", config.policy_keys.nf4_group_size}};
}

void Trainer::Impl::load_initial_weights(const fs::path& file) {
  const std::string what = fmt::format("train.init_checkpoint {}", file.string());
  try {
    const CheckpointSections in = CheckpointSections::read(file);
    const nlohmann::json meta = read_checkpoint_meta(in, file);
    const nlohmann::json expected = model_identity();
    for (const char* key : {"d_model", "n_heads", "n_blocks", "seq_len", "mlp_ratio"}) {
      if (!meta["model"].contains(key) || meta["model"][key] != expected[key]) {
        throw ResumeError(fmt::format("{}: made for model.{} = {}, this config has {}", what, key,
                                      meta["model"].value(key, nlohmann::json()).dump(), expected[key].dump()));
      }
    }
    for (std::uint32_t b = 0; b < n_blocks; ++b) {
      for (std::size_t i = 0; i < kStreamedPerBlock; ++i) {
        torch::Tensor& w = model->streamed()[b][i];
        in.get_into(fmt::format("master/block{}.{}", b, kStreamedNames[i]), w.data_ptr(), w.numel() * sizeof(float));
      }
    }
    std::size_t loaded = 0;
    for (ResidentParam& p : model->resident()) {
      if (!in.has("resident/" + p.name)) continue;
      in.get_into("resident/" + p.name, p.value.data_ptr(), p.value.numel() * sizeof(float));
      ++loaded;
    }
    model->refresh_compute();
    log->info("initial weights from {} (step {}): every streamed block and {} resident tensors", file.string(),
              meta["next_step"].get<std::int64_t>(), loaded);
  } catch (const CheckpointError& e) {
    throw ResumeError(fmt::format("{}: {}", what, e.what()));
  } catch (const nlohmann::json::exception& e) {
    throw ResumeError(fmt::format("{}: section 'meta' is malformed: {}", what, e.what()));
  }
}

nlohmann::json Trainer::Impl::totals_json() const {
  nlohmann::json val = nlohmann::json::array();
  for (const auto& [step, loss] : totals.val_history) val.push_back({step, loss});
  nlohmann::json out = {{"h2d_all_bf16", totals.h2d_all_bf16},
                        {"eval_h2d", eval_h2d()},
                        {"calibration_h2d", calibration_h2d()},
                        {"tokens", totals.tokens},
                        {"train_seconds", totals.train_seconds},
                        {"update_seconds", totals.update_seconds},
                        {"val_history", val},
                        {"swaps", totals.swaps},
                        {"last_loss", totals.last_loss}};
  for (Precision precision : kPrecisions) {
    out[fmt::format("h2d_{}", precision_name(precision))] = totals.h2d[precision];
    out[fmt::format("{}_block_steps", precision_name(precision))] = totals.block_steps[precision];
  }
  return out;
}

void Trainer::Impl::save_checkpoint() {
  const bool sharded = layer->sharded();
  const auto start = Clock::now();
  if (collectives) {
    collectives->exchange(fmt::format("checkpoint{}/arrive", ++checkpoint_exchanges), "",
                          std::chrono::seconds(config.train.collective_timeout_seconds));
  }
  const std::map<std::string, torch::Tensor> layer_state =
      rank() == 0 || sharded ? layer->export_state() : std::map<std::string, torch::Tensor>{};
  if (sharded) {
    std::string failure;
    try {
      CheckpointSections shard;
      const std::string meta =
          nlohmann::json{{"next_step", next_step}, {"rank", rank()}, {"world_size", world_size()}}.dump();
      shard.put("shard", meta.data(), meta.size());
      for (const auto& [key, t] : layer_state) {
        if (is_master_entry(key)) shard.put_view(key, t.data_ptr(), t.numel() * t.element_size());
      }
      for (std::size_t i : adam_masters) put_moments(shard, i);
      shard.write_atomically(shard_path(next_step));
    } catch (const std::exception& e) {
      failure = fmt::format("its shard ({})", e.what());
    }
    agree_on_checkpoint("shards", failure);
  }
  std::string failure;
  if (rank() == 0) {
    try {
      write_main_checkpoint(layer_state);
    } catch (const std::exception& e) {
      if (!collectives) throw;
      failure = fmt::format("the checkpoint ({})", e.what());
    }
  }
  if (collectives) agree_on_checkpoint("main", failure);
  if (sharded) remove_other_shards(next_step);
  if (rank() != 0 && !sharded) return;
  log->info("checkpoint at step {} written to {} in {:.2f}s", next_step,
            sharded ? fmt::format("{} and the ranks' {}{}.bin", checkpoint_path(options.out_dir).string(), kShardPrefix,
                                  next_step)
                    : checkpoint_path(options.out_dir).string(),
            seconds_since(start));
}

void Trainer::Impl::agree_on_checkpoint(const char* part, const std::string& failure) {
  const std::vector<std::string> outcomes =
      collectives->exchange(fmt::format("checkpoint{}/{}", ++checkpoint_exchanges, part), failure,
                            std::chrono::seconds(config.train.checkpoint_timeout_seconds));
  for (std::size_t r = 0; r < outcomes.size(); ++r) {
    if (outcomes[r].empty()) continue;
    throw CheckpointError(
        fmt::format("checkpoint at step {}: rank {} could not write {}; {} still holds the "
                    "previous checkpoint",
                    next_step, r, outcomes[r], checkpoint_path(options.out_dir).string()));
  }
}

void Trainer::Impl::put_moments(CheckpointSections& out, std::size_t i) {
  const std::vector<std::uint8_t>& exp_avg = adam->exp_avg_bytes(i);
  const std::vector<std::uint8_t>& exp_avg_sq = adam->exp_avg_sq_bytes(i);
  out.put_view("adam/" + adam->name(i) + "/exp_avg", exp_avg.data(), exp_avg.size());
  out.put_view("adam/" + adam->name(i) + "/exp_avg_sq", exp_avg_sq.data(), exp_avg_sq.size());
}

void Trainer::Impl::write_main_checkpoint(const std::map<std::string, torch::Tensor>& layer_state) {
  const bool sharded = layer->sharded();
  CheckpointSections out;
  nlohmann::json meta = {
      {"version", kCheckpointMetaVersion},
      {"next_step", next_step},
      {"model", model_identity()},
      {"seed", config.train.seed},
      {"world_size", world_size()},
      {"data_fnv1a64", fmt::format("{:016x}", corpus->fingerprint())},
      {"plugin", {{"name", layer->policy().host().plugin_name()}, {"version", layer->policy().plugin_version()}}},
      {"calibration_status", calibration_status},
      {"calibration_errors", calibration_errors[sp::Precision::int8]},
      {"nf4_calibration_errors", calibration_errors[sp::Precision::nf4]},
      {"decisions", decisions()},
      {"totals", totals_json()},
      {"adam_moments", adam_moments_name(config.train.adam_moments)},
      {"data_parallel", sharded ? "sharded" : "replicated"}};
  // The overlapped update's next clipping: only that mode has one.
  if (config.train.host_optimizer == HostOptimizer::overlapped && previous_grad_norm) {
    meta["previous_grad_norm"] = *previous_grad_norm;
  }
  const std::string meta_text = meta.dump();
  out.put("meta", meta_text.data(), meta_text.size());
  // The layer's state: the masters (sharded: in the shards), the plugin state, the hints in
  // force, its pass counters.
  for (const auto& [key, t] : layer_state) {
    if (!sharded || !is_master_entry(key)) out.put_view(key, t.data_ptr(), t.numel() * t.element_size());
  }
  for (const ResidentParam& p : model->resident()) {
    out.put_view("resident/" + p.name, p.value.data_ptr(), p.value.numel() * sizeof(float));
  }
  // Sharded, the masters' moments are in the shards: the resident tensors' only.
  if (sharded) {
    for (std::size_t i : adam_resident) put_moments(out, i);
  } else {
    for (std::size_t i = 0; i < adam->size(); ++i) put_moments(out, i);
  }
  out.put("adam/steps", pod_bytes(adam->steps_taken()));
  const torch::Tensor rng = at::detail::getDefaultCPUGenerator().get_state();
  out.put("rng/torch", rng.data_ptr(), static_cast<std::size_t>(rng.numel()));
  out.write_atomically(checkpoint_path(options.out_dir));
}

void Trainer::Impl::remove_other_shards(std::int64_t keep) {
  const std::string current = shard_path(keep).filename().string();
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(run_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kShardPrefix, 0) != 0 || name == current) continue;
    std::error_code removed;
    fs::remove(entry.path(), removed);
    if (removed) log->warn("checkpoint: could not remove {}: {}", entry.path().string(), removed.message());
  }
  remove_stale_temporaries(run_dir, {}, {kShardPrefix});
}

CheckpointSections Trainer::Impl::read_shard(std::int64_t step) {
  const fs::path file = shard_path(step);
  CheckpointSections shard;
  std::string failure;
  try {
    shard = CheckpointSections::read(file);
    const Bytes& bytes = shard.get("shard");
    const nlohmann::json meta = nlohmann::json::parse(bytes.begin(), bytes.end(), nullptr, false);
    const nlohmann::json expected = {{"next_step", step}, {"rank", rank()}, {"world_size", world_size()}};
    if (meta != expected) {
      throw CheckpointError(
          fmt::format("{}: section 'shard' is {}; expected {} (the shard of this rank at the main "
                      "checkpoint's step)",
                      file.string(), meta.dump(), expected.dump()));
    }
  } catch (const CheckpointError& e) {
    failure = fs::exists(file) ? e.what()
                               : fmt::format("{}: missing (the checkpoint {} names this rank's shard of step {})",
                                             file.string(), checkpoint_path(options.out_dir).string(), step);
  }
  const std::optional<int> failed = first_failing_rank(failure.empty(), "checkpoint shards read");
  if (!failure.empty()) throw ResumeError(failure);
  if (failed) {
    throw ResumeError(fmt::format("rank {} could not read its checkpoint shard (its log says why)", *failed));
  }
  return shard;
}

std::map<std::string, torch::Tensor> Trainer::Impl::read_layer_state(const CheckpointSections& in) const {
  const std::string file = checkpoint_path(options.out_dir).string();
  std::map<std::string, torch::Tensor> state;
  for (const auto& [key, like] : layer->export_state()) {
    if (key == "layer/passes" && !in.has(key)) {
      // A checkpoint from before the layer: one training pass per step, evaluation passes
      // uncounted (they only number the evaluation engine's steps).
      state.emplace(key, torch::tensor({next_step, std::int64_t{0}}, torch::kInt64));
      continue;
    }
    if (like.dim() == 1 && like.scalar_type() == torch::kUInt8) {
      const Bytes& bytes = in.get(key);
      if (key == "policy/hints" && (bytes.size() % sizeof(sp_hint_v1) != 0 ||
                                    (!bytes.empty() && bytes.size() != n_units * sizeof(sp_hint_v1)))) {
        throw ResumeError(fmt::format("{}: section 'policy/hints' holds {} bytes; expected none or {} hints", file,
                                      bytes.size(), n_units));
      }
      torch::Tensor t = torch::empty({static_cast<std::int64_t>(bytes.size())}, torch::kUInt8);
      if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
      state.emplace(key, std::move(t));
    } else {
      torch::Tensor t = torch::empty(like.sizes(), like.options());
      in.get_into(key, t.data_ptr(), static_cast<std::size_t>(t.numel()) * t.element_size());
      state.emplace(key, std::move(t));
    }
  }
  return state;
}

void Trainer::Impl::restore(const CheckpointSections& main) {
  const nlohmann::json meta = read_checkpoint_meta(main, checkpoint_path(options.out_dir));
  std::map<std::string, torch::Tensor> layer_state;
  // Sharded, the main file's sections and this rank's shard's, read as one.
  CheckpointSections merged;
  const CheckpointSections* source = &main;
  try {
    const nlohmann::json expected = model_identity();
    // The mode first: a LoRA config resuming a full run differs in lora_rank too, and the
    // mode is the difference to report.
    for (const char* key : {"mode", "d_model", "n_heads", "n_blocks", "seq_len", "mlp_ratio", "lora_rank",
                            "streaming_unit", "int8_group_size", "nf4_group_size"}) {
      const nlohmann::json& value = expected.at(key);
      const nlohmann::json saved = meta["model"].value(key, nlohmann::json());
      // A run that never sent an NF4 image (checkpoint_meta.h) fits any NF4 group size.
      if (std::string_view(key) == "nf4_group_size" && meta["model"].contains(key) && saved.is_null()) continue;
      if (saved.is_null() || saved != value) {
        throw ResumeError(
            fmt::format("{}: made for {} = {}, this config has {} (use another --out, or "
                        "--set train.resume=never)",
                        checkpoint_path(options.out_dir).string(), key,
                        meta["model"].value(key, nlohmann::json()).dump(), value.dump()));
      }
    }
    if (meta.at("seed") != config.train.seed) {
      throw ResumeError(fmt::format("{}: made with train.seed {}, this run has {}",
                                    checkpoint_path(options.out_dir).string(), meta.at("seed").dump(),
                                    config.train.seed));
    }
    // Each rank's share of a step's batch depends on the world size, and with it the data
    // order: a run resumes on the world size it was made with.
    if (meta.at("world_size") != world_size()) {
      throw ResumeError(
          fmt::format("{}: made with {} data-parallel rank(s), this run has {} (WORLD_SIZE); resume "
                      "on the same number of ranks, or use another --out",
                      checkpoint_path(options.out_dir).string(), meta.at("world_size").dump(), world_size()));
    }
    const std::string saved_mode = meta.at("data_parallel").get<std::string>();
    const std::string mode = layer->sharded() ? "sharded" : "replicated";  // sharding one rank changes nothing
    if (saved_mode != mode) {
      throw ResumeError(fmt::format(
          "{}: made with its masters {}, this run keeps them {} (train.data_parallel); resume in the same mode, or "
          "use another --out",
          checkpoint_path(options.out_dir).string(), saved_mode, mode));
    }
    if (layer->sharded()) {
      merged = main;
      merged.merge(read_shard(next_step));
      source = &merged;
    }
    const CheckpointSections& in = *source;
    layer_state = read_layer_state(in);
    for (ResidentParam& p : model->resident()) {
      in.get_into("resident/" + p.name, p.value.data_ptr(), p.value.numel() * sizeof(float));
    }
    model->refresh_compute();
    // The moments' storage decides their size: a checkpoint resumes with the storage it was
    // written with.
    const std::string saved_moments = meta.at("adam_moments").get<std::string>();
    if (saved_moments != adam_moments_name(config.train.adam_moments)) {
      throw ResumeError(fmt::format(
          "{}: made with train.adam_moments {}, this config has {} (resume with the same storage, or use "
          "another --out)",
          checkpoint_path(options.out_dir).string(), saved_moments, adam_moments_name(config.train.adam_moments)));
    }
    for (std::size_t i = 0; i < adam->size(); ++i) {
      std::vector<std::uint8_t>& exp_avg = adam->exp_avg_bytes(i);
      std::vector<std::uint8_t>& exp_avg_sq = adam->exp_avg_sq_bytes(i);
      in.get_into("adam/" + adam->name(i) + "/exp_avg", exp_avg.data(), exp_avg.size());
      in.get_into("adam/" + adam->name(i) + "/exp_avg_sq", exp_avg_sq.data(), exp_avg_sq.size());
    }
    std::int64_t steps = 0;
    in.get_into("adam/steps", &steps, sizeof steps);
    if (steps < 0 || steps > next_step) {
      throw CheckpointError(fmt::format("{}: section 'adam/steps' holds {}; expected a count in [0, next_step = {}]",
                                        checkpoint_path(options.out_dir).string(), steps, next_step));
    }
    adam->set_steps_taken(steps);
    const Bytes& rng = in.get("rng/torch");
    torch::Tensor state = torch::empty({static_cast<std::int64_t>(rng.size())}, torch::kUInt8);
    std::memcpy(state.data_ptr(), rng.data(), rng.size());
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    try {
      generator.set_state(state);
    } catch (const c10::Error&) {
      throw CheckpointError(fmt::format("{}: section 'rng/torch' ({} bytes) is not a CPU generator state",
                                        checkpoint_path(options.out_dir).string(), rng.size()));
    }

    if (const auto norm = meta.find("previous_grad_norm"); norm != meta.end()) {
      if (!norm->is_number() || !std::isfinite(norm->get<double>()) || norm->get<double>() < 0.0) {
        throw CheckpointError(fmt::format("{}: section 'meta': previous_grad_norm is {}; expected a finite number >= 0",
                                          checkpoint_path(options.out_dir).string(), norm->dump()));
      }
      previous_grad_norm = norm->get<double>();
    }
    calibration_errors[sp::Precision::int8] = meta.at("calibration_errors").get<std::vector<double>>();
    calibration_errors[sp::Precision::nf4] = meta.at("nf4_calibration_errors").get<std::vector<double>>();
    for (const auto& [key, errors] : {std::pair<const char*, const std::vector<double>*>{
                                          "calibration_errors", &calibration_errors[sp::Precision::int8]},
                                      {"nf4_calibration_errors", &calibration_errors[sp::Precision::nf4]}}) {
      const bool errors_valid =
          std::all_of(errors->begin(), errors->end(), [](double e) { return std::isfinite(e) && e >= 0.0; });
      if ((!errors->empty() && errors->size() != n_units) || !errors_valid) {
        throw CheckpointError(
            fmt::format("{}: section 'meta': {} holds {} values; expected none or {} finite "
                        "values >= 0",
                        checkpoint_path(options.out_dir).string(), key, errors->size(), n_units));
      }
    }
    calibration_status = "restored from checkpoint";
    const nlohmann::json& t = meta.at("totals");
    for (Precision precision : kPrecisions) {
      totals.h2d[precision] = t.at(fmt::format("h2d_{}", precision_name(precision))).get<std::uint64_t>();
      totals.block_steps[precision] =
          t.at(fmt::format("{}_block_steps", precision_name(precision))).get<std::uint64_t>();
    }
    totals.h2d_all_bf16 = t.at("h2d_all_bf16");
    totals.eval_h2d_before = t.at("eval_h2d");
    totals.calibration_h2d_before = t.at("calibration_h2d");
    totals.tokens = t.at("tokens");
    totals.train_seconds = t.at("train_seconds");
    totals.update_seconds = t.at("update_seconds");
    for (const nlohmann::json& v : t.at("val_history")) totals.val_history.emplace_back(v.at(0), v.at(1));
    for (const nlohmann::json& s : t.at("swaps")) totals.swaps.push_back(s);
    totals.last_loss = t.at("last_loss").is_number() ? t.at("last_loss").get<double>() : NAN;
  } catch (const nlohmann::json::exception& e) {
    throw ResumeError(
        fmt::format("{}: section 'meta' is malformed: {}", checkpoint_path(options.out_dir).string(), e.what()));
  } catch (const CheckpointError& e) {
    throw ResumeError(e.what());
  }
  const std::string file = checkpoint_path(options.out_dir).string();
  try {
    layer->restore_state(layer_state);
  } catch (const tl::StateEntryError& e) {
    throw ResumeError(fmt::format("{}: section '{}': {}", file, e.entry(), e.detail()));
  } catch (const tl::CollectiveError&) {
    throw;  // a rank died or stalled during a sharded restore: not a defect of the checkpoint
  } catch (const tl::RankMismatchError&) {
    throw;  // another rank could not restore: it names itself, and its checkpoint
  } catch (const std::logic_error&) {
    throw;                             // a bug on this side, not a defect of the checkpoint
  } catch (const std::exception& e) {  // the plugin rejected the state
    throw ResumeError(fmt::format("{}: {}", file, e.what()));
  }
  log->info("resumed from {} at step {}", checkpoint_path(options.out_dir).string(), next_step);
}

}  // namespace sp::train
