#include "replay_inputs.h"

#include <algorithm>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "sp/input_files/json_fields.h"
#include "sp/input_files/read_file.h"

namespace sp::replay {
namespace {

using nlohmann::json;
using input_files::JsonFieldError;
using input_files::JsonFields;

sp_grad_moments_v1 read_block(const JsonFields& fields, const json& entry, const std::string& at, uint32_t n_blocks,
                              std::vector<bool>& seen) {
  fields.require_object(entry, at);
  fields.only_keys(entry, {"id", "sum_sq", "sum", "max_abs", "count", "nonfinite"}, at);
  const auto field = [&](const char* key) -> const json& { return fields.require(entry, key, at + "." + key); };
  sp_grad_moments_v1 m{};
  const uint64_t id = fields.non_negative_integer(field("id"), at + ".id");
  if (id >= n_blocks) {
    fields.fail(at + ".id", fmt::format("block id {} is out of range: --blocks is {}", id, n_blocks));
  }
  if (seen[id]) fields.fail(at + ".id", fmt::format("block {} is listed twice in this step", id));
  seen[id] = true;
  m.block_id = static_cast<uint32_t>(id);
  m.sum_sq = fields.number(field("sum_sq"), at + ".sum_sq", true);
  m.sum = fields.number(field("sum"), at + ".sum", false);
  m.max_abs = fields.number(field("max_abs"), at + ".max_abs", true);
  m.count = fields.non_negative_integer(field("count"), at + ".count");
  m.nonfinite = fields.non_negative_integer(field("nonfinite"), at + ".nonfinite");
  if (m.nonfinite > m.count) {
    fields.fail(at + ".nonfinite", fmt::format("{} non-finite elements exceed count {}", m.nonfinite, m.count));
  }
  return m;
}

// {"<id>": error, ...} under `key`: ids in [0, n_blocks), each once, errors finite and >= 0.
BlockErrors read_block_errors(const JsonFields& fields, const json& document, const char* key,
                                    uint32_t n_blocks) {
  const json& errors = fields.require(document, key, key);
  fields.require_object(errors, key);
  BlockErrors out;
  for (const auto& [id_text, value] : errors.items()) {
    const std::string at = std::string(key) + "." + id_text;
    if (id_text.empty() || id_text.size() > 10 || id_text.find_first_not_of("0123456789") != std::string::npos) {
      fields.fail(at, "the key must be a block id (a non-negative integer)");
    }
    const uint64_t id = std::stoull(id_text);
    if (id >= n_blocks) fields.fail(at, fmt::format("block id {} is out of range: --blocks is {}", id, n_blocks));
    // "0" and "00" are two JSON keys for one block.
    if (std::find(out.block_ids.begin(), out.block_ids.end(), id) != out.block_ids.end()) {
      fields.fail(at, fmt::format("block id {} is given twice", id));
    }
    out.block_ids.push_back(static_cast<uint32_t>(id));
    out.errors.push_back(fields.number(value, at, true));
  }
  return out;
}

}  // namespace

TraceReader::TraceReader(std::istream& in, std::string source_name, uint32_t n_blocks)
    : in_(in), source_name_(std::move(source_name)), n_blocks_(n_blocks) {}

std::optional<TraceStep> TraceReader::next() {
  std::string line;
  while (std::getline(in_, line)) {
    ++line_number_;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      const JsonFields fields(fmt::format("{}:{}", source_name_, line_number_));
      json record;
      try {
        record = json::parse(line);
      } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e400
        fields.fail("line", fmt::format("not valid JSON ({})", e.what()));
      }
      if (!record.is_object()) {
        fields.fail("line", fmt::format("expected a JSON object, got {}", JsonFields::describe(record)));
      }
      fields.only_keys(record, {"step", "blocks", "loss"}, "");

      const uint64_t step = fields.non_negative_integer(fields.require(record, "step", "step"), "step");
      if (step != static_cast<uint64_t>(expected_step_)) {
        fields.fail("step", fmt::format("expected step {} (steps start at 0 and increase by one), got {}",
                                        expected_step_, step));
      }
      const json& blocks = fields.require(record, "blocks", "blocks");
      fields.require_array(blocks, "blocks");

      TraceStep out;
      out.step = expected_step_;
      std::vector<bool> seen(n_blocks_, false);
      out.moments.reserve(blocks.size());
      for (size_t i = 0; i < blocks.size(); ++i) {
        out.moments.push_back(read_block(fields, blocks[i], fmt::format("blocks[{}]", i), n_blocks_, seen));
      }
      if (record.contains("loss") && !record["loss"].is_null()) {
        out.loss = fields.number(record["loss"], "loss", false);
      }
      ++expected_step_;
      return out;
    } catch (const JsonFieldError& e) {
      throw InputError(e.what());
    }
  }
  if (in_.bad()) throw InputError(fmt::format("{}:{}: read error", source_name_, line_number_ + 1));
  return std::nullopt;
}

std::string calibration_errors_key(sp::Precision route) {
  if (route == sp::Precision::int8) return "block_errors";
  return fmt::format("{}_block_errors", sp::precision_name(route));
}

CalibrationFile read_calibration_file(const std::string& path, uint32_t n_blocks) {
  std::string text;
  try {
    text = sp::input_files::read_whole_file(path, "calibration file");
  } catch (const sp::input_files::FileReadError& e) {
    throw InputError(e.what());
  }
  try {
    const JsonFields fields(path);
    json document;
    try {
      document = json::parse(text);
    } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e400
      fields.fail("document", fmt::format("not valid JSON ({})", e.what()));
    }
    fields.require_object(document, "document");
    std::vector<std::string> keys;
    for (const sp::Precision route : sp::kQuantizedPrecisions) keys.push_back(calibration_errors_key(route));
    fields.only_keys(document, keys, "");
    CalibrationFile out;
    bool any = false;
    for (const sp::Precision route : sp::kQuantizedPrecisions) {
      const std::string key = calibration_errors_key(route);
      if (!document.contains(key)) continue;
      out.errors[route] = read_block_errors(fields, document, key.c_str(), n_blocks);
      any = true;
    }
    if (!any) {
      std::string expected;
      for (const sp::Precision route : sp::kQuantizedPrecisions) {
        expected += fmt::format("{}\"{}\" ({})", expected.empty() ? "" : ", ", calibration_errors_key(route),
                                sp::route_traits(route).label);
      }
      fields.fail("document", fmt::format("expected at least one of {}; found none", expected));
    }
    return out;
  } catch (const JsonFieldError& e) {
    throw InputError(e.what());
  }
}

}  // namespace sp::replay
