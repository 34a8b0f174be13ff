#include "checkpoint_meta.h"

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "train_config.h"

namespace sp::train {

nlohmann::json migrate_meta_from_v1(nlohmann::json meta) {
  const auto fill = [](nlohmann::json& object, const char* key, nlohmann::json value) {
    if (!object.contains(key)) object[key] = std::move(value);
  };
  nlohmann::json& model = meta["model"];
  fill(model, "streaming_unit", "block");  // before streaming units, whole blocks streamed
  fill(model, "nf4_group_size", nullptr);  // before the NF4 route: no NF4 image was ever sent
  fill(meta, "world_size", 1);
  fill(meta, "adam_moments", "fp32");         // before bf16 moments
  fill(meta, "data_parallel", "replicated");  // before sharded masters
  fill(meta, "nf4_calibration_errors", std::vector<double>{});
  if (meta.contains("totals") && meta["totals"].is_object()) {
    nlohmann::json& totals = meta["totals"];
    fill(totals, "h2d_nf4", std::uint64_t{0});
    fill(totals, "nf4_block_steps", std::uint64_t{0});
    fill(totals, "calibration_h2d", std::uint64_t{0});  // calibration bytes were in eval_h2d then
    fill(totals, "update_seconds", 0.0);                // before the fused optimizer
  }
  meta["version"] = 2;
  return meta;
}

nlohmann::json read_checkpoint_meta(const CheckpointSections& checkpoint, const std::filesystem::path& file) {
  nlohmann::json meta;
  try {
    const Bytes& text = checkpoint.get("meta");
    meta = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  } catch (const CheckpointError& e) {
    throw ResumeError(e.what());
  }
  if (!meta.is_object() || !meta.contains("next_step") || !meta["next_step"].is_number_integer() ||
      meta["next_step"].get<std::int64_t>() < 0 || meta["next_step"].get<std::int64_t>() > kMaxSteps ||
      !meta.contains("model") || !meta["model"].is_object()) {
    throw ResumeError(
        fmt::format("{}: section 'meta' is not a JSON object with next_step in [0, {}] and a model object",
                    file.string(), kMaxSteps));
  }
  const nlohmann::json version = meta.value("version", nlohmann::json(1));
  if (!version.is_number_integer() || version.get<std::int64_t>() < 1) {
    throw ResumeError(fmt::format("{}: section 'meta': version is {}; expected an integer >= 1", file.string(),
                                  version.dump()));
  }
  if (version.get<std::int64_t>() > kCheckpointMetaVersion) {
    throw ResumeError(fmt::format(
        "{}: section 'meta' is version {}, written by a newer sp-train; this one reads versions 1 to {}",
        file.string(), version.get<std::int64_t>(), kCheckpointMetaVersion));
  }
  if (version.get<std::int64_t>() == 1) meta = migrate_meta_from_v1(std::move(meta));
  return meta;
}

}  // namespace sp::train
