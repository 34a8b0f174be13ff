#include "replay_inputs.hpp"

#include <cmath>
#include <fstream>
#include <limits>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

namespace sp::replay {
namespace {

using nlohmann::json;

std::string describe(const json& value) {
  std::string text = value.dump();
  constexpr size_t kMaxShown = 40;
  if (text.size() > kMaxShown) text = text.substr(0, kMaxShown) + "...";
  return fmt::format("{} {}", value.type_name(), text);
}

// Field access that names the offending field in the error.
class FieldReader {
 public:
  FieldReader(std::string location) : location_(std::move(location)) {}

  [[noreturn]] void fail(const std::string& field, const std::string& problem) const {
    throw InputError(fmt::format("{}: {}: {}", location_, field, problem));
  }

  const json& require(const json& object, const char* key, const std::string& field) const {
    const auto it = object.find(key);
    if (it == object.end()) fail(field, "missing");
    return *it;
  }

  uint64_t non_negative_integer(const json& value, const std::string& field) const {
    if (value.is_number_unsigned()) return value.get<uint64_t>();
    if (value.is_number_integer()) {
      fail(field, fmt::format("expected an integer >= 0, got {}", value.get<int64_t>()));
    }
    fail(field, fmt::format("expected an integer >= 0, got {}", describe(value)));
  }

  double number(const json& value, const std::string& field, bool non_negative) const {
    if (!value.is_number()) {
      fail(field, fmt::format("expected a number, got {}", describe(value)));
    }
    const double x = value.get<double>();
    if (!std::isfinite(x)) fail(field, "expected a finite number (count non-finite gradients in \"nonfinite\")");
    if (non_negative && x < 0) fail(field, fmt::format("expected a number >= 0, got {}", x));
    return x;
  }

 private:
  std::string location_;
};

}  // namespace

TraceReader::TraceReader(std::istream& in, std::string source_name, uint32_t n_blocks)
    : in_(in), source_name_(std::move(source_name)), n_blocks_(n_blocks) {}

std::optional<TraceStep> TraceReader::next() {
  std::string line;
  while (std::getline(in_, line)) {
    ++line_number_;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;

    const FieldReader field(fmt::format("{}:{}", source_name_, line_number_));
    json record;
    try {
      record = json::parse(line);
    } catch (const json::parse_error& e) {
      field.fail("line", fmt::format("not valid JSON ({})", e.what()));
    }
    if (!record.is_object()) field.fail("line", fmt::format("expected a JSON object, got {}", describe(record)));
    for (const auto& [key, value] : record.items()) {
      if (key != "step" && key != "blocks") field.fail(key, "unknown key (expected \"step\" and \"blocks\")");
    }

    TraceStep out;
    const uint64_t step = field.non_negative_integer(field.require(record, "step", "step"), "step");
    if (step != static_cast<uint64_t>(expected_step_)) {
      field.fail("step", fmt::format("expected step {} (steps start at 0 and increase by one), got {}",
                                     expected_step_, step));
    }
    out.step = expected_step_++;

    const json& blocks = field.require(record, "blocks", "blocks");
    if (!blocks.is_array()) field.fail("blocks", fmt::format("expected an array, got {}", describe(blocks)));
    std::vector<bool> seen(n_blocks_, false);
    out.moments.reserve(blocks.size());
    for (size_t i = 0; i < blocks.size(); ++i) {
      const json& entry = blocks[i];
      const std::string at = fmt::format("blocks[{}]", i);
      if (!entry.is_object()) field.fail(at, fmt::format("expected an object, got {}", describe(entry)));
      for (const auto& [key, value] : entry.items()) {
        if (key != "id" && key != "sum_sq" && key != "sum" && key != "max_abs" && key != "count" &&
            key != "nonfinite") {
          field.fail(at + "." + key,
                     "unknown key (expected id, sum_sq, sum, max_abs, count, nonfinite)");
        }
      }
      sp_grad_moments_v1 m{};
      const uint64_t id = field.non_negative_integer(field.require(entry, "id", at + ".id"), at + ".id");
      if (id >= n_blocks_) {
        field.fail(at + ".id", fmt::format("block id {} is out of range: --blocks is {}", id, n_blocks_));
      }
      if (seen[id]) field.fail(at + ".id", fmt::format("block {} is listed twice in this step", id));
      seen[id] = true;
      m.block_id = static_cast<uint32_t>(id);
      m.sum_sq = field.number(field.require(entry, "sum_sq", at + ".sum_sq"), at + ".sum_sq", true);
      m.sum = field.number(field.require(entry, "sum", at + ".sum"), at + ".sum", false);
      m.max_abs = field.number(field.require(entry, "max_abs", at + ".max_abs"), at + ".max_abs", true);
      m.count = field.non_negative_integer(field.require(entry, "count", at + ".count"), at + ".count");
      m.nonfinite = field.non_negative_integer(field.require(entry, "nonfinite", at + ".nonfinite"),
                                               at + ".nonfinite");
      if (m.nonfinite > m.count) {
        field.fail(at + ".nonfinite",
                   fmt::format("{} non-finite elements exceed count {}", m.nonfinite, m.count));
      }
      out.moments.push_back(m);
    }
    return out;
  }
  if (in_.bad()) {
    throw InputError(fmt::format("{}:{}: read error", source_name_, line_number_ + 1));
  }
  return std::nullopt;
}

CalibrationErrors read_calibration_file(const std::string& path, uint32_t n_blocks) {
  std::ifstream in(path);
  if (!in) throw InputError(fmt::format("{}: cannot open the calibration file", path));
  json document;
  try {
    document = json::parse(in);
  } catch (const json::parse_error& e) {
    throw InputError(fmt::format("{}: not valid JSON ({})", path, e.what()));
  }
  const FieldReader field(path);
  if (!document.is_object()) field.fail("document", "expected an object {\"block_errors\": {...}}");
  for (const auto& [key, value] : document.items()) {
    if (key != "block_errors") field.fail(key, "unknown key (expected \"block_errors\")");
  }
  const json& errors = field.require(document, "block_errors", "block_errors");
  if (!errors.is_object()) {
    field.fail("block_errors", fmt::format("expected an object of \"<block id>\": error, got {}", describe(errors)));
  }
  CalibrationErrors out;
  for (const auto& [key, value] : errors.items()) {
    const std::string at = "block_errors." + key;
    uint64_t id = 0;
    size_t used = 0;
    try {
      id = std::stoull(key, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != key.size() || key[0] == '-' || key[0] == '+') {
      field.fail(at, "the key must be a block id (a non-negative integer)");
    }
    if (id >= n_blocks) field.fail(at, fmt::format("block id {} is out of range: --blocks is {}", id, n_blocks));
    out.block_ids.push_back(static_cast<uint32_t>(id));
    out.errors.push_back(field.number(value, at, true));
  }
  return out;
}

}  // namespace sp::replay
