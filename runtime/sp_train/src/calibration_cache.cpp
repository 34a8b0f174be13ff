#include "calibration_cache.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "sp/runtime/atomic_file.h"
#include "sp/runtime/hash.h"
#include "sp/input_files/read_file.h"

namespace sp::train {
namespace fs = std::filesystem;
namespace {

constexpr const char* kFormat = "sp-train-calibration";
// Version 2 added the NF4 errors; a version-1 file is a mismatch, measured again.
constexpr int kVersion = 2;
constexpr const char* kErrorKeys[] = {"block_errors", "nf4_block_errors"};

std::string checksum_of(const std::string& fingerprint, const nlohmann::json& int8, const nlohmann::json& nf4) {
  const std::string text = fingerprint + int8.dump() + nf4.dump();
  return fmt::format("{:016x}", sp::runtime::fnv1a64(text.data(), text.size()));
}

}  // namespace

const char* cache_status_name(CacheStatus status) {
  switch (status) {
    case CacheStatus::hit:
      return "hit";
    case CacheStatus::missing:
      return "missing";
    case CacheStatus::mismatch:
      return "mismatch";
    case CacheStatus::corrupt:
      return "corrupt";
  }
  return "?";
}

std::string calibration_fingerprint(const nlohmann::json& identity) {
  const std::string text = identity.dump();
  return fmt::format("{:016x}", sp::runtime::fnv1a64(text.data(), text.size()));
}

fs::path calibration_cache_file(const fs::path& dir, const std::string& fingerprint) {
  return dir / fmt::format("calibration-{}.json", fingerprint);
}

CacheLookup read_calibration_cache(const fs::path& file, const std::string& fingerprint, std::uint32_t n_blocks) {
  CacheLookup lookup;
  auto corrupt = [&](const std::string& why) {
    lookup.status = CacheStatus::corrupt;
    lookup.detail = fmt::format("{}: corrupt calibration cache: {}", file.string(), why);
    return lookup;
  };
  std::string text;
  try {
    text = sp::input_files::read_whole_file(file, "calibration cache");
  } catch (const sp::input_files::FileReadError& e) {
    if (!e.missing()) return corrupt(e.what());
    lookup.detail = fmt::format("{}: no cache file", file.string());
    return lookup;
  }
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return corrupt(fmt::format("not valid JSON ({})", e.what()));
  }
  // Type before value: json::value() throws when a field exists with another type.
  const auto format = doc.is_object() ? doc.find("format") : doc.end();
  const auto version = doc.is_object() ? doc.find("version") : doc.end();
  if (format == doc.end() || !format->is_string() || *format != kFormat || version == doc.end() ||
      !version->is_number_integer()) {
    return corrupt(fmt::format("expected an object with format \"{}\" and version {}", kFormat, kVersion));
  }
  if (*version != kVersion) {
    lookup.status = CacheStatus::mismatch;
    lookup.detail = fmt::format("{}: cache version {}, this sp-train writes version {} (INT8 and NF4 errors)",
                                file.string(), version->dump(), kVersion);
    return lookup;
  }
  const auto int8 = doc.find(kErrorKeys[0]);
  const auto nf4 = doc.find(kErrorKeys[1]);
  const auto stored_fingerprint = doc.find("fingerprint");
  const auto checksum = doc.find("checksum");
  if (int8 == doc.end() || !int8->is_array() || nf4 == doc.end() || !nf4->is_array() ||
      stored_fingerprint == doc.end() || !stored_fingerprint->is_string() || checksum == doc.end() ||
      !checksum->is_string()) {
    return corrupt("missing block_errors, nf4_block_errors, fingerprint or checksum");
  }
  if (*checksum != checksum_of(stored_fingerprint->get<std::string>(), *int8, *nf4)) {
    return corrupt("checksum mismatch");
  }
  if (*stored_fingerprint != fingerprint) {
    lookup.status = CacheStatus::mismatch;
    lookup.detail = fmt::format("{}: made for fingerprint {}, this run is {}", file.string(),
                                stored_fingerprint->get<std::string>(), fingerprint);
    return lookup;
  }
  const std::pair<const nlohmann::json*, std::vector<double>*> lists[] = {{&*int8, &lookup.errors[sp::Precision::int8]},
                                                                          {&*nf4, &lookup.errors[sp::Precision::nf4]}};
  for (std::size_t k = 0; k < 2; ++k) {
    const auto& [stored, out] = lists[k];
    if (stored->size() != n_blocks) {
      lookup.status = CacheStatus::mismatch;
      lookup.detail = fmt::format("{}: {} holds {} blocks, the model has {}", file.string(), kErrorKeys[k],
                                  stored->size(), n_blocks);
      return lookup;
    }
    for (std::size_t b = 0; b < stored->size(); ++b) {
      const nlohmann::json& e = (*stored)[b];
      if (!e.is_number() || !std::isfinite(e.get<double>()) || e.get<double>() < 0.0) {
        return corrupt(fmt::format("{}[{}] is not a finite number >= 0", kErrorKeys[k], b));
      }
      out->push_back(e.get<double>());
    }
  }
  lookup.status = CacheStatus::hit;
  return lookup;
}

void write_calibration_cache(const fs::path& file, const std::string& fingerprint, const nlohmann::json& identity,
                             const CalibrationErrors& errors) {
  fs::create_directories(file.parent_path());
  const nlohmann::json int8 = errors[sp::Precision::int8];
  const nlohmann::json nf4 = errors[sp::Precision::nf4];
  const nlohmann::json doc = {{"format", kFormat},
                              {"version", kVersion},
                              {"fingerprint", fingerprint},
                              {"identity", identity},
                              {kErrorKeys[0], int8},
                              {kErrorKeys[1], nf4},
                              {"checksum", checksum_of(fingerprint, int8, nf4)}};
  sp::runtime::write_file_atomically(file, doc.dump(2) + "\n");
}

fs::path default_calibration_cache_dir() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    return fs::path(xdg) / "sp-train";
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    return fs::path(home) / ".cache" / "sp-train";
  }
  return fs::path(".sp-train-cache");
}

}  // namespace sp::train
