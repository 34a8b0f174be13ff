// The checkpoint's meta section (JSON): its version, and one migration per older version, so
// that a resume reads one current shape instead of a fallback for each key some release did
// not write yet.
#pragma once

#include <filesystem>

#include <nlohmann/json.hpp>

#include "checkpoint_file.h"

namespace sp::train {

// 1: every checkpoint written before the meta carried a version (no "version" key). Depending
//    on its release it may lack model.streaming_unit, model.nf4_group_size, world_size,
//    adam_moments, data_parallel, nf4_calibration_errors and, in totals, h2d_nf4,
//    nf4_block_steps, calibration_h2d and update_seconds.
// 2: "version": 2, and every key above present. model.nf4_group_size is null where the run
//    never sent an NF4 image (any group size fits it).
inline constexpr int kCheckpointMetaVersion = 2;

// The meta section of `checkpoint` (read from `file`), brought to kCheckpointMetaVersion.
// Throws ResumeError naming the file when it is not a JSON object with an integer next_step in
// [0, kMaxSteps] and a model object, when a newer sp-train wrote it, or when its version is
// not an integer >= 1.
nlohmann::json read_checkpoint_meta(const CheckpointSections& checkpoint, const std::filesystem::path& file);

// Version 1 to 2: each key a version-1 meta may lack, with the value its absence meant.
nlohmann::json migrate_meta_from_v1(nlohmann::json meta);

}  // namespace sp::train
