// On-disk cache of calibration errors (the relative output error of each block with INT8 and
// with NF4 weights against BF16 weights), keyed by a fingerprint of everything that determines them: model
// identity (shape and weight contents), quantization config and block layout. A cache file
// that does not parse, fails its checksum, or was made for another fingerprint or block count
// is reported and recomputed, never trusted.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sp/host/policy_session.h"

namespace sp::train {

enum class CacheStatus { hit, missing, mismatch, corrupt };
const char* cache_status_name(CacheStatus status);

using CalibrationErrors = sp::host::CalibrationErrors;

struct CacheLookup {
  CacheStatus status = CacheStatus::missing;
  std::string detail;        // why it was not a hit, naming the file
  CalibrationErrors errors;  // one per block and precision on a hit
};

// Hex digest of the identity object (its canonical dump).
std::string calibration_fingerprint(const nlohmann::json& identity);
// <dir>/calibration-<fingerprint>.json
std::filesystem::path calibration_cache_file(const std::filesystem::path& dir, const std::string& fingerprint);

CacheLookup read_calibration_cache(const std::filesystem::path& file, const std::string& fingerprint,
                                   std::uint32_t n_blocks);
// Creates the directory if needed; written atomically.
void write_calibration_cache(const std::filesystem::path& file, const std::string& fingerprint,
                             const nlohmann::json& identity, const CalibrationErrors& errors);

// $XDG_CACHE_HOME/sp-train, else $HOME/.cache/sp-train, else ./.sp-train-cache.
std::filesystem::path default_calibration_cache_dir();

}  // namespace sp::train
