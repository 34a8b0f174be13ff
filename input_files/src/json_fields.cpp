#include "sp/input_files/json_fields.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace sp::input_files {

using nlohmann::json;

std::string JsonFields::describe(const json& value) {
  // A container is described by its size: dumping one recurses as deep as it is nested, and a
  // 200 kB file of brackets overflows the stack.
  if (value.is_array()) return fmt::format("array of {} element(s)", value.size());
  if (value.is_object()) return fmt::format("object with {} key(s)", value.size());
  if (value.is_null()) return "null";
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  constexpr size_t kMaxShown = 40;
  if (text.size() > kMaxShown) text = text.substr(0, kMaxShown) + "...";
  return fmt::format("{} {}", value.type_name(), text);
}

void JsonFields::fail(const std::string& field, const std::string& problem) const {
  throw JsonFieldError(fmt::format("{}: {}: {}", location_, field, problem));
}

const json& JsonFields::require(const json& object, const char* key, const std::string& field) const {
  const auto it = object.find(key);
  if (it == object.end()) fail(field, "missing");
  return *it;
}

void JsonFields::only_keys(const json& object, std::initializer_list<const char*> allowed,
                           const std::string& field_prefix) const {
  only_keys(object, std::vector<std::string>(allowed.begin(), allowed.end()), field_prefix);
}

void JsonFields::only_keys(const json& object, const std::vector<std::string>& allowed,
                           const std::string& field_prefix) const {
  for (const auto& item : object.items()) {
    if (std::find(allowed.begin(), allowed.end(), item.key()) != allowed.end()) continue;
    fail(field_prefix.empty() ? item.key() : field_prefix + "." + item.key(),
         fmt::format("unknown key (expected {})", fmt::join(allowed, ", ")));
  }
}

void JsonFields::require_object(const json& value, const std::string& field) const {
  if (!value.is_object()) fail(field, fmt::format("expected an object, got {}", describe(value)));
}

void JsonFields::require_array(const json& value, const std::string& field) const {
  if (!value.is_array()) fail(field, fmt::format("expected an array, got {}", describe(value)));
}

uint64_t JsonFields::non_negative_integer(const json& value, const std::string& field) const {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer()) {
    fail(field, fmt::format("expected an integer >= 0, got {}", value.get<int64_t>()));
  }
  fail(field, fmt::format("expected an integer >= 0, got {}", describe(value)));
}

double JsonFields::number(const json& value, const std::string& field, bool non_negative) const {
  if (!value.is_number()) fail(field, fmt::format("expected a number, got {}", describe(value)));
  const double x = value.get<double>();
  if (!std::isfinite(x)) fail(field, "expected a finite number");
  if (non_negative && x < 0) fail(field, fmt::format("expected a number >= 0, got {}", x));
  return x;
}

std::string JsonFields::string(const json& value, const std::string& field) const {
  if (!value.is_string()) fail(field, fmt::format("expected a string, got {}", describe(value)));
  return value.get<std::string>();
}

}  // namespace sp::input_files
