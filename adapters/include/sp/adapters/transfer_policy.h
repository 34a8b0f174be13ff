// The benchmark-driven transfer policy ("never slower than BF16").
//
// The gradient policy decides where INT8 or NF4 is *safe*; this decides where it is *worth
// it*. `sp-bench transfer` measures, on one machine, the BF16 path, the INT8 path and the NF4
// path (copy + dequant, plus the image rebuild when weights are trained) for a sweep of block
// sizes and writes a TransferReport. `sp-bench merge-policy` folds one or more reports into a
// TransferPolicy: per path, the size ranges where every report measured the quantized route
// at least `speedup_threshold` times faster than BF16. Anything not covered by a rule of its
// route does not take that route (the PolicyBridge's fallback: NF4 -> INT8 -> BF16).
//
// Files from before NF4 (reports whose points have no "nf4" object, policies without
// "nf4_frozen" / "nf4_trained" rules) still load: NF4 was not measured there, so it pays
// nowhere, and merging such a report with newer ones leaves no NF4 rule (a size is allowed
// only where every report allows it).
//
// The formats, the merge rule and the gate live here, beside the PolicyBridge that consumes the
// gate; the measuring (runtime/sp_bench's transfer_measure.h) stays with the tool.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "sp/adapters/policy_bridge.h"
#include "sp/error.h"

namespace sp::adapters {

// Whether a run's streamed blocks change every step (full training) or not (LoRA bases).
enum class BlockWeights { kFrozen, kTrained };

// Which quantized path a measurement or rule is about: a quantized route for frozen blocks
// (LoRA base weights), which pay copy + dequant, or for trained ones, which also pay the
// rebuild of their quantized image after every optimizer step. Made by transfer_path().
struct TransferPath {
  Precision route = Precision::int8;
  BlockWeights weights = BlockWeights::kFrozen;
  friend constexpr bool operator==(const TransferPath& a, const TransferPath& b) {
    return a.route == b.route && a.weights == b.weights;
  }
  friend constexpr bool operator!=(const TransferPath& a, const TransferPath& b) { return !(a == b); }
  friend constexpr bool operator<(const TransferPath& a, const TransferPath& b) {  // a map key, in route order
    return a.route != b.route ? a.route < b.route : a.weights < b.weights;
  }
};
// The path of a quantized route for such blocks; std::invalid_argument for BF16, which has none.
TransferPath transfer_path(Precision route, BlockWeights weights);
// Every path: each quantized route (in kPrecisions' order) for frozen, then trained blocks.
std::vector<TransferPath> transfer_paths();
std::string transfer_path_name(TransferPath path);  // "int8_frozen", ..., "nf4_trained"
std::optional<TransferPath> parse_transfer_path(const std::string& name);

// A report or policy file that cannot be used. what() names the file, the field and the
// expectation.
class TransferPolicyError : public ErrorAs<std::runtime_error> {
 public:
  explicit TransferPolicyError(const std::string& what) : ErrorAs(ErrorKind::bad_input, what) {}
};

// ---- Reports -------------------------------------------------------------------------

struct TimingStats {
  double median_s = 0;
  double min_s = 0;
  double max_s = 0;
  uint32_t samples = 0;
};

// The NF4 route at one block size (group size `group_size`, bf16 scales).
struct Nf4Measurement {
  uint32_t group_size = 64;
  uint64_t nf4_bytes = 0;  // bytes of the block's NF4 image (packed codes + scales + header)
  TimingStats copy;        // H2D copy of the NF4 image, from events
  TimingStats dequant;     // dequant into the compute slot, from events
  TimingStats rebuild;     // host-side NF4 image rebuild after an optimizer step
  double frozen_path_s = 0;
  double trained_path_s = 0;
};

// One block size, all paths. Per-block seconds throughout.
struct TransferPoint {
  uint64_t bf16_bytes = 0;   // bytes of the block's BF16 image: the size rules are keyed by
  uint64_t int8_bytes = 0;   // bytes of its INT8 image (codes + scales + header)
  double raw_copy_s = 0;     // the physical limit: a bare pinned copy of bf16_bytes, same run
  TimingStats bf16_copy;     // BF16 path: H2D copy, from the backend's events
  TimingStats int8_copy;     // INT8 path: H2D copy of the INT8 image, from events
  TimingStats int8_dequant;  // INT8 path: dequant into the compute slot, from events
  // Host-side image rebuild after an optimizer step (trained blocks), each precision.
  TimingStats bf16_rebuild;
  TimingStats int8_rebuild;
  // Median streaming time per block, measured whole over pipelined steps (copies overlap
  // dequants of other blocks), not summed from the parts above.
  double bf16_path_s = 0;
  double int8_frozen_path_s = 0;
  // Path plus the rebuild of its image, for blocks whose weights change every step.
  double bf16_trained_path_s = 0;
  double int8_trained_path_s = 0;
  // Absent in reports written before NF4 was measured.
  std::optional<Nf4Measurement> nf4;

  // BF16 time over the quantized route's time on `path`: above 1 means it is faster. 0 for an
  // NF4 path when the point has no NF4 measurement (never good enough for a rule).
  double speedup(TransferPath path) const;
};

struct TransferReport {
  static constexpr int kFormatVersion = 1;
  std::string machine;                       // host name or a label given on the command line
  std::string backend;                       // "cuda" or "host"
  std::string device;                        // e.g. "NVIDIA H200" or "host memcpy, 25 GB/s cap"
  std::optional<double> bandwidth_cap_gbps;  // set for the emulating host backend
  double reference_h2d_gbps = 0;             // raw pinned copy bandwidth measured in the same run
  // How the rebuild times were measured: "fused" (what writing the image adds to the fused
  // host optimizer's AdamW pass) or "unfused" (building the image from the masters after the
  // optimizer; reports written before the fused optimizer, which have no such key).
  std::string rebuild = "unfused";
  std::vector<TransferPoint> points;
};

std::string report_to_json(const TransferReport& report);
TransferReport report_from_json(const std::string& text, const std::string& source_name);
TransferReport load_report(const std::string& path);

// ---- Policies ------------------------------------------------------------------------

struct TransferRule {
  uint64_t min_bytes = 0;             // inclusive, BF16 image bytes
  std::optional<uint64_t> max_bytes;  // exclusive; none = no upper bound
  double measured_speedup = 0;        // the smallest speedup measured inside the range
};

struct MergeSource {
  std::string machine;
  std::string backend;
  std::string device;
};

class TransferPolicy {
 public:
  static constexpr int kFormatVersion = 1;

  // A policy that allows INT8 nowhere: the conservative fallback.
  TransferPolicy() = default;

  // Folds reports into rules. Per report, a measured size is good when its speedup is at
  // least `speedup_threshold`; the range between two neighbouring sizes is allowed only
  // when both are good (nothing was measured in between), the range above the largest
  // size only when it is good, and nothing below the smallest size is allowed. Reports are
  // then intersected: a size is allowed only where every report allows it, with the
  // smallest speedup among them. Throws TransferPolicyError when there is no report, a
  // report has no point, or the threshold is not a positive finite number.
  static TransferPolicy merge(const std::vector<TransferReport>& reports, double speedup_threshold);

  static TransferPolicy from_json(const std::string& text, const std::string& source_name);
  static TransferPolicy load(const std::string& path);
  std::string to_json() const;

  // True when a rule of `path` covers a block whose BF16 image has `bf16_bytes`.
  bool pays(TransferPath path, uint64_t bf16_bytes) const;
  // The rule that covers the size, if any.
  const TransferRule* find_rule(TransferPath path, uint64_t bf16_bytes) const;

  double speedup_threshold() const { return speedup_threshold_; }
  const std::vector<TransferRule>& rules(TransferPath path) const;
  const std::vector<MergeSource>& sources() const { return sources_; }

 private:
  double speedup_threshold_ = 1.0;
  std::map<TransferPath, std::vector<TransferRule>> rules_;  // sorted, disjoint, coalesced
  std::vector<MergeSource> sources_;
};

// The gate the PolicyBridge combines with the plugin's hints, both quantized routes
// for blocks whose weights are `weights`: a route only where both policies say so, NF4 hints
// falling back to INT8 where only INT8 pays (PolicyBridge::decide).
TransferGate transfer_gate(const TransferPolicy& policy, BlockWeights weights,
                           const std::vector<uint64_t>& block_bf16_bytes);

// Loads the transfer policy a run was configured with. A missing or unusable file is not
// fatal: `warn` is called once with the reason, and the result allows INT8 nowhere, so
// every block stays BF16 (the conservative choice).
TransferPolicy load_transfer_policy_or_bf16(const std::string& path,
                                            const std::function<void(const std::string&)>& warn);

}  // namespace sp::adapters
