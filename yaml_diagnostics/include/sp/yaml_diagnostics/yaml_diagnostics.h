// The wording of YAML config errors, shared by the policy plugin and the reference host so
// that both describe a rejected value and suggest a misspelled key the same way.
#pragma once

#include <cstddef>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>

#include <yaml-cpp/yaml.h>

namespace sp::yaml_diagnostics {

// How a rejected value reads in a message: "nothing (null)", "a list", "a mapping", the
// string "x" (quoted in the file) or 'x' (plain).
std::string describe(const YAML::Node& node);

// A scalar that YAML may read as a number or a boolean. A quoted scalar is a string even when
// it looks like a number, so `"0.5"` is not a threshold; so is one with blanks at either end,
// which a plain scalar can only have from bytes such as NUL (it would be written back quoted).
bool is_plain_scalar(const YAML::Node& node);

// The candidate closest to `unknown` by case-insensitive edit distance, if it is near enough
// to be a misspelling (at most max(3, |unknown|/3) edits); nothing otherwise. The view points
// into `candidates`.
std::optional<std::string_view> closest_key(std::string_view unknown, const char* const* candidates, std::size_t count);

template <typename Container>
std::optional<std::string_view> closest_key(std::string_view unknown, const Container& candidates) {
  return closest_key(unknown, std::data(candidates), std::size(candidates));
}

}  // namespace sp::yaml_diagnostics
