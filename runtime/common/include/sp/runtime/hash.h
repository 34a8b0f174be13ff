// Non-cryptographic hashes shared by the reference host: data fingerprints, checkpoint
// checksums, calibration-cache keys and batch offsets. Their values are part of files on disk
// (checkpoints, caches) and of run summaries, so they must never change.
#pragma once

#include <cstddef>
#include <cstdint>

namespace sp::runtime {

// SplitMix64: the stateless mixer behind batch offsets and fingerprints.
inline std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// FNV-1a 64 over bytes, continuing from `state`.
inline std::uint64_t fnv1a64(const void* data, std::size_t bytes, std::uint64_t state = 0xcbf29ce484222325ull) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  for (std::size_t i = 0; i < bytes; ++i) {
    state ^= p[i];
    state *= 0x100000001b3ull;
  }
  return state;
}

}  // namespace sp::runtime
