#include "sp/adapters/transfer_policy.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <sstream>

#include <fmt/core.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "sp/kernels/nf4.h"
#include "sp/input_files/json_fields.h"
#include "sp/input_files/read_file.h"

namespace sp::adapters {
namespace {

using input_files::JsonFieldError;
using input_files::JsonFields;
using nlohmann::json;

constexpr const char* kReportFormat = "sp-transfer-report";
constexpr const char* kPolicyFormat = "sp-transfer-policy";

// A half-open byte range [lo, hi); hi == max() stands for "no upper bound".
struct Interval {
  uint64_t lo;
  uint64_t hi;
  double speedup;
};
constexpr uint64_t kUnbounded = std::numeric_limits<uint64_t>::max();

std::vector<Interval> coalesce(std::vector<Interval> intervals) {
  std::sort(intervals.begin(), intervals.end(), [](const Interval& a, const Interval& b) { return a.lo < b.lo; });
  std::vector<Interval> out;
  for (const Interval& next : intervals) {
    if (!out.empty() && out.back().hi >= next.lo) {
      out.back().hi = std::max(out.back().hi, next.hi);
      out.back().speedup = std::min(out.back().speedup, next.speedup);
    } else {
      out.push_back(next);
    }
  }
  return out;
}

// Where one report allows INT8 on `path`: between two neighbouring measured sizes only
// when both are good, above the largest only when it is good.
std::vector<Interval> allowed_by(const TransferReport& report, TransferPath path, double threshold) {
  std::map<uint64_t, double> speedup_at;  // a size measured twice keeps its worse result
  for (const TransferPoint& p : report.points) {
    const double s = p.speedup(path);
    auto [it, inserted] = speedup_at.emplace(p.bf16_bytes, s);
    if (!inserted) it->second = std::min(it->second, s);
  }
  std::vector<Interval> allowed;
  for (auto it = speedup_at.begin(); it != speedup_at.end(); ++it) {
    if (!(it->second >= threshold)) continue;  // an unmeasured NF4 point has speedup 0
    const auto next = std::next(it);
    if (next == speedup_at.end()) {
      allowed.push_back({it->first, kUnbounded, it->second});
    } else if (next->second >= threshold) {
      allowed.push_back({it->first, next->first, std::min(it->second, next->second)});
    }
  }
  return coalesce(std::move(allowed));
}

std::vector<Interval> intersect(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  std::vector<Interval> out;
  for (const Interval& x : a) {
    for (const Interval& y : b) {
      const uint64_t lo = std::max(x.lo, y.lo);
      const uint64_t hi = std::min(x.hi, y.hi);
      if (lo < hi) out.push_back({lo, hi, std::min(x.speedup, y.speedup)});
    }
  }
  return coalesce(std::move(out));
}

std::string read_text_file(const std::string& path, const char* what) {
  try {
    return input_files::read_whole_file(path, what);
  } catch (const input_files::FileReadError& e) {
    throw TransferPolicyError(e.what());
  }
}

json parse_document(const std::string& text, const JsonFields& fields) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e400
    fields.fail("document", fmt::format("not valid JSON ({})", e.what()));
  }
}

void check_format(const json& doc, const JsonFields& fields, const char* format, int version) {
  fields.require_object(doc, "document");
  const std::string found = fields.string(fields.require(doc, "format", "format"), "format");
  if (found != format) fields.fail("format", fmt::format("expected \"{}\", got \"{}\"", format, found));
  const uint64_t v = fields.non_negative_integer(fields.require(doc, "version", "version"), "version");
  if (v != static_cast<uint64_t>(version)) {
    fields.fail("version", fmt::format("unsupported version {}; this build reads version {}", v, version));
  }
}

json stats_to_json(const TimingStats& s) {
  return {{"median_s", s.median_s}, {"min_s", s.min_s}, {"max_s", s.max_s}, {"samples", s.samples}};
}

TimingStats stats_from_json(const JsonFields& fields, const json& j, const std::string& at) {
  fields.require_object(j, at);
  fields.only_keys(j, {"median_s", "min_s", "max_s", "samples"}, at);
  TimingStats s;
  s.median_s = fields.number(fields.require(j, "median_s", at + ".median_s"), at + ".median_s", true);
  s.min_s = fields.number(fields.require(j, "min_s", at + ".min_s"), at + ".min_s", true);
  s.max_s = fields.number(fields.require(j, "max_s", at + ".max_s"), at + ".max_s", true);
  const uint64_t samples = fields.non_negative_integer(fields.require(j, "samples", at + ".samples"), at + ".samples");
  if (samples > std::numeric_limits<uint32_t>::max()) fields.fail(at + ".samples", "too large");
  s.samples = static_cast<uint32_t>(samples);
  if (!(s.min_s <= s.median_s && s.median_s <= s.max_s)) {
    fields.fail(at, fmt::format("expected min_s <= median_s <= max_s, got {} / {} / {}", s.min_s, s.median_s, s.max_s));
  }
  return s;
}

double positive(const JsonFields& fields, const json& j, const char* key, const std::string& at) {
  const double x = fields.number(fields.require(j, key, at + "." + key), at + "." + key, true);
  if (x <= 0) fields.fail(at + "." + key, "expected a number > 0");
  return x;
}

}  // namespace

TransferPath transfer_path(Precision route, BlockWeights weights) {
  if (!is_quantized(route)) {
    throw std::invalid_argument(std::string("transfer_path: ") + precision_name(route) + " has no transfer path");
  }
  return TransferPath{route, weights};
}

std::vector<TransferPath> transfer_paths() {
  std::vector<TransferPath> paths;
  for (const Precision route : kPrecisions) {
    if (!is_quantized(route)) continue;
    for (const BlockWeights weights : {BlockWeights::kFrozen, BlockWeights::kTrained})
      paths.push_back({route, weights});
  }
  return paths;
}

std::string transfer_path_name(TransferPath path) {
  return std::string(precision_name(path.route)) + (path.weights == BlockWeights::kTrained ? "_trained" : "_frozen");
}

std::optional<TransferPath> parse_transfer_path(const std::string& name) {
  for (const TransferPath path : transfer_paths()) {
    if (name == transfer_path_name(path)) return path;
  }
  return std::nullopt;
}

double TransferPoint::speedup(TransferPath path) const {
  const bool trained = path.weights == BlockWeights::kTrained;
  const double bf16_s = trained ? bf16_trained_path_s : bf16_path_s;
  // Report format 1 times INT8 and NF4 by name; any other route has no time in it, and 0 says
  // it is never faster.
  if (path.route == Precision::int8) return bf16_s / (trained ? int8_trained_path_s : int8_frozen_path_s);
  if (path.route == Precision::nf4 && nf4) return bf16_s / (trained ? nf4->trained_path_s : nf4->frozen_path_s);
  return 0.0;
}

std::string report_to_json(const TransferReport& report) {
  json points = json::array();
  for (const TransferPoint& p : report.points) {
    json speedup = json::object();
    for (const TransferPath path : transfer_paths()) {
      if (path.route != Precision::nf4 || p.nf4) speedup[transfer_path_name(path)] = p.speedup(path);
    }
    points.push_back({{"bf16_bytes", p.bf16_bytes},
                      {"int8_bytes", p.int8_bytes},
                      {"raw_copy_s", p.raw_copy_s},
                      {"bf16_copy", stats_to_json(p.bf16_copy)},
                      {"int8_copy", stats_to_json(p.int8_copy)},
                      {"int8_dequant", stats_to_json(p.int8_dequant)},
                      {"bf16_rebuild", stats_to_json(p.bf16_rebuild)},
                      {"int8_rebuild", stats_to_json(p.int8_rebuild)},
                      {"bf16_path_s", p.bf16_path_s},
                      {"int8_frozen_path_s", p.int8_frozen_path_s},
                      {"bf16_trained_path_s", p.bf16_trained_path_s},
                      {"int8_trained_path_s", p.int8_trained_path_s},
                      {"speedup", speedup}});
    if (p.nf4) {
      points.back()["nf4"] = {{"group_size", p.nf4->group_size},          {"nf4_bytes", p.nf4->nf4_bytes},
                              {"copy", stats_to_json(p.nf4->copy)},       {"dequant", stats_to_json(p.nf4->dequant)},
                              {"rebuild", stats_to_json(p.nf4->rebuild)}, {"frozen_path_s", p.nf4->frozen_path_s},
                              {"trained_path_s", p.nf4->trained_path_s}};
    }
  }
  const json doc = {
      {"format", kReportFormat},
      {"version", TransferReport::kFormatVersion},
      {"machine", report.machine},
      {"backend", report.backend},
      {"device", report.device},
      {"bandwidth_cap_gbps", report.bandwidth_cap_gbps ? json(*report.bandwidth_cap_gbps) : json(nullptr)},
      {"reference_h2d_gbps", report.reference_h2d_gbps},
      {"rebuild", report.rebuild},
      {"points", points}};
  return doc.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

TransferReport report_from_json(const std::string& text, const std::string& source_name) {
  try {
    const JsonFields fields(source_name);
    const json doc = parse_document(text, fields);
    check_format(doc, fields, kReportFormat, TransferReport::kFormatVersion);
    fields.only_keys(
        doc,
        {"format", "version", "machine", "backend", "device", "bandwidth_cap_gbps", "reference_h2d_gbps", "rebuild",
         "points"},
        "");
    TransferReport report;
    report.machine = fields.string(fields.require(doc, "machine", "machine"), "machine");
    report.backend = fields.string(fields.require(doc, "backend", "backend"), "backend");
    if (report.backend != "cuda" && report.backend != "host") {
      fields.fail("backend", fmt::format("expected \"cuda\" or \"host\", got \"{}\"", report.backend));
    }
    report.device = fields.string(fields.require(doc, "device", "device"), "device");
    const json& cap = fields.require(doc, "bandwidth_cap_gbps", "bandwidth_cap_gbps");
    if (!cap.is_null()) report.bandwidth_cap_gbps = positive(fields, doc, "bandwidth_cap_gbps", "");
    report.reference_h2d_gbps = positive(fields, doc, "reference_h2d_gbps", "");
    if (doc.contains("rebuild")) {  // optional: older reports measured the unfused rebuild
      report.rebuild = fields.string(doc["rebuild"], "rebuild");
      if (report.rebuild != "fused" && report.rebuild != "unfused") {
        fields.fail("rebuild", fmt::format("expected \"fused\" or \"unfused\", got \"{}\"", report.rebuild));
      }
    }
    const json& points = fields.require(doc, "points", "points");
    fields.require_array(points, "points");
    for (size_t i = 0; i < points.size(); ++i) {
      const std::string at = fmt::format("points[{}]", i);
      const json& j = points[i];
      fields.require_object(j, at);
      fields.only_keys(j,
                       {"bf16_bytes", "int8_bytes", "raw_copy_s", "bf16_copy", "int8_copy", "int8_dequant",
                        "bf16_rebuild", "int8_rebuild", "bf16_path_s", "int8_frozen_path_s", "bf16_trained_path_s",
                        "int8_trained_path_s", "speedup", "nf4"},
                       at);
      TransferPoint p;
      p.bf16_bytes =
          fields.non_negative_integer(fields.require(j, "bf16_bytes", at + ".bf16_bytes"), at + ".bf16_bytes");
      p.int8_bytes =
          fields.non_negative_integer(fields.require(j, "int8_bytes", at + ".int8_bytes"), at + ".int8_bytes");
      if (p.bf16_bytes == 0) fields.fail(at + ".bf16_bytes", "expected a size > 0");
      const auto stats = [&](const char* key) {
        return stats_from_json(fields, fields.require(j, key, at + "." + key), at + "." + key);
      };
      p.bf16_copy = stats("bf16_copy");
      p.int8_copy = stats("int8_copy");
      p.int8_dequant = stats("int8_dequant");
      p.bf16_rebuild = stats("bf16_rebuild");
      p.int8_rebuild = stats("int8_rebuild");
      p.raw_copy_s = positive(fields, j, "raw_copy_s", at);
      p.bf16_path_s = positive(fields, j, "bf16_path_s", at);
      p.int8_frozen_path_s = positive(fields, j, "int8_frozen_path_s", at);
      p.bf16_trained_path_s = positive(fields, j, "bf16_trained_path_s", at);
      p.int8_trained_path_s = positive(fields, j, "int8_trained_path_s", at);
      // Each time is finite, but their ratio need not be (1e300 / 1e-300), and a policy
      // written from an infinite speedup would not load.
      if (!std::isfinite(p.bf16_path_s / p.int8_frozen_path_s) ||
          !std::isfinite(p.bf16_trained_path_s / p.int8_trained_path_s)) {
        fields.fail(at, "the INT8 speedup over BF16 it implies is not a finite number");
      }
      // Optional: reports written before NF4 have none, and NF4 then pays nowhere.
      if (j.contains("nf4")) {
        const std::string nat = at + ".nf4";
        const json& n = j.at("nf4");
        fields.require_object(n, nat);
        fields.only_keys(
            n, {"group_size", "nf4_bytes", "copy", "dequant", "rebuild", "frozen_path_s", "trained_path_s"}, nat);
        Nf4Measurement m;
        const uint64_t group =
            fields.non_negative_integer(fields.require(n, "group_size", nat + ".group_size"), nat + ".group_size");
        if (group > UINT32_MAX || !kernels::is_supported_nf4_group_size(static_cast<uint32_t>(group))) {
          fields.fail(nat + ".group_size", fmt::format("expected 32, 64, 128 or 256, got {}", group));
        }
        m.group_size = static_cast<uint32_t>(group);
        m.nf4_bytes =
            fields.non_negative_integer(fields.require(n, "nf4_bytes", nat + ".nf4_bytes"), nat + ".nf4_bytes");
        const auto nstats = [&](const char* key) {
          return stats_from_json(fields, fields.require(n, key, nat + "." + key), nat + "." + key);
        };
        m.copy = nstats("copy");
        m.dequant = nstats("dequant");
        m.rebuild = nstats("rebuild");
        m.frozen_path_s = positive(fields, n, "frozen_path_s", nat);
        m.trained_path_s = positive(fields, n, "trained_path_s", nat);
        if (!std::isfinite(p.bf16_path_s / m.frozen_path_s) ||
            !std::isfinite(p.bf16_trained_path_s / m.trained_path_s)) {
          fields.fail(nat, "the NF4 speedup over BF16 it implies is not a finite number");
        }
        p.nf4 = m;
      }
      report.points.push_back(p);
    }
    return report;
  } catch (const JsonFieldError& e) {
    throw TransferPolicyError(e.what());
  }
}

TransferReport load_report(const std::string& path) {
  return report_from_json(read_text_file(path, "transfer report"), path);
}

TransferPolicy TransferPolicy::merge(const std::vector<TransferReport>& reports, double speedup_threshold) {
  if (!std::isfinite(speedup_threshold) || speedup_threshold <= 0) {
    throw TransferPolicyError(fmt::format("--speedup-threshold: expected a number > 0, got {}", speedup_threshold));
  }
  if (reports.empty()) throw TransferPolicyError("merge-policy: at least one report is needed");
  TransferPolicy policy;
  policy.speedup_threshold_ = speedup_threshold;
  for (const TransferReport& report : reports) {
    if (report.points.empty()) {
      throw TransferPolicyError(fmt::format("report of machine \"{}\" has no measurement", report.machine));
    }
    policy.sources_.push_back({report.machine, report.backend, report.device});
  }
  for (const TransferPath path : transfer_paths()) {
    std::vector<Interval> allowed = allowed_by(reports.front(), path, speedup_threshold);
    for (size_t i = 1; i < reports.size(); ++i) {
      allowed = intersect(allowed, allowed_by(reports[i], path, speedup_threshold));
    }
    std::vector<TransferRule>& rules = policy.rules_[path];
    for (const Interval& iv : allowed) {
      rules.push_back({iv.lo, iv.hi == kUnbounded ? std::nullopt : std::optional<uint64_t>(iv.hi), iv.speedup});
    }
  }
  return policy;
}

std::string TransferPolicy::to_json() const {
  json sources = json::array();
  for (const MergeSource& s : sources_) {
    sources.push_back({{"machine", s.machine}, {"backend", s.backend}, {"device", s.device}});
  }
  json rules = json::object();
  for (const TransferPath path : transfer_paths()) {
    json list = json::array();
    for (const TransferRule& r : this->rules(path)) {
      list.push_back({{"min_bytes", r.min_bytes},
                      {"max_bytes", r.max_bytes ? json(*r.max_bytes) : json(nullptr)},
                      {"measured_speedup", r.measured_speedup}});
    }
    rules[transfer_path_name(path)] = list;
  }
  const json doc = {{"format", kPolicyFormat},
                    {"version", kFormatVersion},
                    {"speedup_threshold", speedup_threshold_},
                    {"sources", sources},
                    {"rules", rules}};
  return doc.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

TransferPolicy TransferPolicy::from_json(const std::string& text, const std::string& source_name) {
  try {
    const JsonFields fields(source_name);
    const json doc = parse_document(text, fields);
    check_format(doc, fields, kPolicyFormat, kFormatVersion);
    fields.only_keys(doc, {"format", "version", "speedup_threshold", "sources", "rules"}, "");
    TransferPolicy policy;
    policy.speedup_threshold_ = positive(fields, doc, "speedup_threshold", "");
    const json& sources = fields.require(doc, "sources", "sources");
    fields.require_array(sources, "sources");
    for (size_t i = 0; i < sources.size(); ++i) {
      const std::string at = fmt::format("sources[{}]", i);
      fields.require_object(sources[i], at);
      fields.only_keys(sources[i], {"machine", "backend", "device"}, at);
      policy.sources_.push_back({fields.string(fields.require(sources[i], "machine", at + ".machine"), at + ".machine"),
                                 fields.string(fields.require(sources[i], "backend", at + ".backend"), at + ".backend"),
                                 fields.string(fields.require(sources[i], "device", at + ".device"), at + ".device")});
    }
    const json& rules = fields.require(doc, "rules", "rules");
    fields.require_object(rules, "rules");
    for (const auto& [name, list] : rules.items()) {
      const std::optional<TransferPath> path = parse_transfer_path(name);
      if (!path) {
        std::vector<std::string> names;
        for (const TransferPath known : transfer_paths()) names.push_back(transfer_path_name(known));
        const std::string last = names.back();
        names.pop_back();
        fields.fail("rules." + name, fmt::format("unknown path (expected {} or {})", fmt::join(names, ", "), last));
      }
      fields.require_array(list, "rules." + name);
      std::vector<TransferRule>& out = policy.rules_[*path];
      for (size_t i = 0; i < list.size(); ++i) {
        const std::string at = fmt::format("rules.{}[{}]", name, i);
        const json& j = list[i];
        fields.require_object(j, at);
        fields.only_keys(j, {"min_bytes", "max_bytes", "measured_speedup"}, at);
        TransferRule rule;
        rule.min_bytes =
            fields.non_negative_integer(fields.require(j, "min_bytes", at + ".min_bytes"), at + ".min_bytes");
        const json& max = fields.require(j, "max_bytes", at + ".max_bytes");
        if (!max.is_null()) {
          rule.max_bytes = fields.non_negative_integer(max, at + ".max_bytes");
          if (*rule.max_bytes <= rule.min_bytes) {
            fields.fail(at + ".max_bytes",
                        fmt::format("expected a size > min_bytes ({}), got {}", rule.min_bytes, *rule.max_bytes));
          }
        }
        rule.measured_speedup = positive(fields, j, "measured_speedup", at);
        if (!out.empty() && (!out.back().max_bytes || *out.back().max_bytes > rule.min_bytes)) {
          fields.fail(at + ".min_bytes", "rules must be sorted by size and must not overlap the previous rule");
        }
        out.push_back(rule);
      }
    }
    return policy;
  } catch (const JsonFieldError& e) {
    throw TransferPolicyError(e.what());
  }
}

TransferPolicy TransferPolicy::load(const std::string& path) {
  return from_json(read_text_file(path, "transfer policy file"), path);
}

const std::vector<TransferRule>& TransferPolicy::rules(TransferPath path) const {
  static const std::vector<TransferRule> kNone;
  const auto it = rules_.find(path);
  return it == rules_.end() ? kNone : it->second;
}

const TransferRule* TransferPolicy::find_rule(TransferPath path, uint64_t bf16_bytes) const {
  for (const TransferRule& rule : rules(path)) {
    if (bf16_bytes >= rule.min_bytes && (!rule.max_bytes || bf16_bytes < *rule.max_bytes)) return &rule;
  }
  return nullptr;
}

bool TransferPolicy::pays(TransferPath path, uint64_t bf16_bytes) const {
  return find_rule(path, bf16_bytes) != nullptr;
}

TransferGate transfer_gate(const TransferPolicy& policy, BlockWeights weights,
                           const std::vector<uint64_t>& block_bf16_bytes) {
  // Per block, whether `path` pays for its BF16 image size.
  const auto verdicts = [&](TransferPath path) {
    std::vector<bool> pays(block_bf16_bytes.size());
    for (size_t b = 0; b < block_bf16_bytes.size(); ++b) pays[b] = policy.pays(path, block_bf16_bytes[b]);
    return pays;
  };
  TransferGate gate;
  for (const Precision route : kPrecisions) {
    if (is_quantized(route)) gate.pays[route] = verdicts(transfer_path(route, weights));
  }
  return gate;
}

TransferPolicy load_transfer_policy_or_bf16(const std::string& path,
                                            const std::function<void(const std::string&)>& warn) {
  try {
    return TransferPolicy::load(path);
  } catch (const TransferPolicyError& e) {
    warn(fmt::format("{}; every block stays BF16 (no INT8 or NF4 transfer is known to pay on this machine)", e.what()));
    return TransferPolicy();
  }
}

}  // namespace sp::adapters
