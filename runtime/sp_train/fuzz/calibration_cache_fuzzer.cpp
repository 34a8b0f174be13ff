// Fuzzes sp-train's calibration cache reader (runtime/sp_train/src/calibration_cache.h):
// read_calibration_cache on a file under /tmp holding the input.
//
// Input: one flags byte, then the file. Flags bit 0: when the file is a JSON object with the
// two error arrays and a string fingerprint, store the matching checksum first (so that
// mutations get past it); bit 1: look the file up under its own fingerprint (else under a fixed
// one, a mismatch); bits 2-4: the model's block count minus one (1 to 8).
//
// Contract checked (calibration_cache.h: a bad cache "is reported and recomputed, never
// trusted"):
//   - read_calibration_cache never throws: every defect is a status with a detail;
//   - a hit holds exactly n_blocks finite errors >= 0 per precision and no detail; anything
//     else has a detail that names the file;
//   - a hit round-trips: write_calibration_cache, read again, a hit with the same errors.
// Any violation aborts.
#include "fuzz_support.h"
#include "calibration_cache.h"

#include "sp/runtime/hash.h"

#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace {

[[noreturn]] void fail(const std::string &what) { sp::fuzz::contract_violated("calibration_cache_fuzzer", what); }


// The checksum calibration_cache.cpp stores: FNV-1a of fingerprint + both arrays' dumps.
std::string checksum_of(const std::string &fingerprint, const nlohmann::json &int8, const nlohmann::json &nf4) {
  const std::string text = fingerprint + int8.dump() + nf4.dump();
  return fmt::format("{:016x}", sp::runtime::fnv1a64(text.data(), text.size()));
}

bool same_bits(const std::vector<double> &a, const std::vector<double> &b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

void check_lookup(const sp::train::CacheLookup &lookup, const std::string &file, std::uint32_t n_blocks) {
  if (lookup.status == sp::train::CacheStatus::hit) {
    if (!lookup.detail.empty()) fail("a hit with a detail");
    for (const std::vector<double> *errors :
         {&lookup.errors[sp::Precision::int8], &lookup.errors[sp::Precision::nf4]}) {
      if (errors->size() != n_blocks) fail("a hit without one error per block");
      for (double e : *errors) {
        if (!std::isfinite(e) || e < 0.0) fail("a hit with an error that is not finite and >= 0");
      }
    }
  } else if (lookup.detail.find(file) == std::string::npos) {
    fail("a miss whose detail does not name the file");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t flags = data[0];
  std::string text(reinterpret_cast<const char *>(data + 1), size - 1);
  const std::uint32_t n_blocks = ((flags >> 2) & 7u) + 1;
  std::string fingerprint = "0123456789abcdef";

  // The harness's own JSON handling must not throw either: parse without exceptions.
  nlohmann::json doc = nlohmann::json::parse(text, nullptr, false);
  if (!doc.is_discarded() && doc.is_object()) {
    const auto int8 = doc.find("block_errors");
    const auto nf4 = doc.find("nf4_block_errors");
    const auto stored = doc.find("fingerprint");
    const bool has_fingerprint = stored != doc.end() && stored->is_string();
    if (has_fingerprint && (flags & 2u)) fingerprint = stored->get<std::string>();
    if ((flags & 1u) && has_fingerprint && int8 != doc.end() && int8->is_array() && nf4 != doc.end() &&
        nf4->is_array()) {
      doc["checksum"] = checksum_of(stored->get<std::string>(), *int8, *nf4);
      text = doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
    }
  }
  static const sp::fuzz::ScratchFile input("calibration-cache.json"), rewritten("calibration-cache-rewritten.json");
  input.write(text.data(), text.size());

  const sp::train::CacheLookup lookup = sp::train::read_calibration_cache(input.path(), fingerprint, n_blocks);
  check_lookup(lookup, input.path(), n_blocks);
  if (lookup.status != sp::train::CacheStatus::hit) return 0;

  sp::train::write_calibration_cache(rewritten.path(), fingerprint, nlohmann::json::object(), lookup.errors);
  const sp::train::CacheLookup again = sp::train::read_calibration_cache(rewritten.path(), fingerprint, n_blocks);
  if (again.status != sp::train::CacheStatus::hit) fail("a rewritten cache is not a hit: " + again.detail);
  if (!same_bits(again.errors[sp::Precision::int8], lookup.errors[sp::Precision::int8]) ||
      !same_bits(again.errors[sp::Precision::nf4], lookup.errors[sp::Precision::nf4])) {
    fail("a rewritten cache reads back other errors");
  }
  return 0;
}
