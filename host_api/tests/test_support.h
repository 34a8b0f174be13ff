// Helpers for the host library's tests and the integration tests in tests/.
#ifndef SP_HOST_TEST_SUPPORT_H
#define SP_HOST_TEST_SUPPORT_H

#include <sp/host/policy_host.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace spdlog {
class logger;
}

namespace sp::host::testing {

/// A fresh private directory (mkdtemp) removed with everything in it on destruction.
class TempDir {
 public:
  TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// A logger that keeps every message (host and plugin) so tests can look for them.
class CapturedLog {
 public:
  CapturedLog();
  const std::shared_ptr<spdlog::logger>& logger() const { return logger_; }
  /// All messages so far, one per line, each prefixed with its level.
  std::string text() const;

 private:
  class StringSink;
  std::shared_ptr<StringSink> sink_;
  std::shared_ptr<spdlog::logger> logger_;
};

/// Blocks with every size known: BF16, INT8 and NF4 (nf4_bytes = params/2 + params/32).
std::vector<BlockDescription> make_blocks(std::uint32_t count);

/// Deterministic gradient moments: each block alternates between a quiet phase and an
/// active phase whose length depends on the block, so relative magnitudes keep changing
/// and a threshold policy switches blocks both ways. Every seventh (block, step) pair has
/// no gradient, so blocks are sometimes absent, and a few later ones carry non-finite
/// elements, so the unsafe rule fires.
std::vector<sp_grad_moments_v1> synthetic_moments(std::int64_t step, std::uint32_t block_count);

/// One step through the host: begin, post_backward with the synthetic moments,
/// compute_hints, end (feedback: loss 2.5, 1000 BF16, 500 INT8, 250 NF4 bytes, 2000 as
/// all-BF16). Returns the hints.
std::vector<sp_hint_v1> run_step(PolicyHost& host, std::int64_t step);

/// Precisions and reasons of a sequence of steps, compared field by field
/// (sensitivities bit for bit, NaN equal to NaN).
struct Decision {
  std::int64_t step;
  std::uint32_t block_id;
  sp_precision precision;
  sp_reason reason;
  std::uint64_t sensitivity_bits;
  bool operator==(const Decision& other) const;
};
std::vector<Decision> decisions_of(std::int64_t step, const std::vector<sp_hint_v1>& hints);
/// Number of (step, block) pairs whose precision differs from the previous step's.
std::size_t count_switches(const std::vector<Decision>& decisions, std::uint32_t block_count);

/// What the process holds right now; compared before and after repeated swaps.
struct ProcessResources {
  std::size_t open_fds = 0;
  /// Mappings backed by a file: libraries and their segments. Anonymous mappings belong
  /// to the allocator and are judged through heap_bytes_in_use.
  std::size_t mapped_file_regions = 0;
  /// Bytes the C allocator has handed out and not had back (glibc mallinfo2: small
  /// chunks plus mmap'ed large ones), whoever allocated them: host, plugin or library.
  std::size_t heap_bytes_in_use = 0;
};
ProcessResources process_resources();
/// Heap growth a long run of swaps may show without leaking: a few hundred bytes per swap
/// would already exceed it over 200 cycles.
constexpr std::size_t kHeapGrowthLimit = 16u * 1024;
/// AddressSanitizer replaces the allocator, so glibc's statistics say nothing under it;
/// LeakSanitizer checks for leaks at exit instead.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kHeapStatisticsAreMeaningful = false;
#else
constexpr bool kHeapStatisticsAreMeaningful = true;
#endif
/// Lines of /proc/self/maps that contain `needle`.
std::size_t mapped_regions_containing(const std::string& needle);

}  // namespace sp::host::testing

#endif  // SP_HOST_TEST_SUPPORT_H
