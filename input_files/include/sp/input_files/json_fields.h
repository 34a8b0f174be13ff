// Typed access to user-written JSON whose errors name the place, the field and the
// expectation: "FILE:LINE: blocks[3].count: expected an integer >= 0, got -4".
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "sp/error.h"

namespace sp::input_files {

// Thrown by JsonFields; what() is the full message.
class JsonFieldError : public ErrorAs<std::runtime_error> {
 public:
  explicit JsonFieldError(const std::string& what) : ErrorAs(ErrorKind::bad_input, what) {}
};

class JsonFields {
 public:
  // `location` prefixes every message: a file name, or "file:line".
  explicit JsonFields(std::string location) : location_(std::move(location)) {}

  [[noreturn]] void fail(const std::string& field, const std::string& problem) const;

  const nlohmann::json& require(const nlohmann::json& object, const char* key, const std::string& field) const;
  // Rejects keys not in `allowed`, naming the first unknown one and the allowed set.
  void only_keys(const nlohmann::json& object, std::initializer_list<const char*> allowed,
                 const std::string& field_prefix) const;
  void only_keys(const nlohmann::json& object, const std::vector<std::string>& allowed,
                 const std::string& field_prefix) const;
  void require_object(const nlohmann::json& value, const std::string& field) const;
  void require_array(const nlohmann::json& value, const std::string& field) const;

  uint64_t non_negative_integer(const nlohmann::json& value, const std::string& field) const;
  // A finite number; with non_negative, also >= 0.
  double number(const nlohmann::json& value, const std::string& field, bool non_negative) const;
  std::string string(const nlohmann::json& value, const std::string& field) const;

  // "<type> <first 40 characters of the value>", for messages.
  static std::string describe(const nlohmann::json& value);

 private:
  std::string location_;
};

}  // namespace sp::input_files
