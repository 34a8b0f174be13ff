#include "sp/yaml_diagnostics/yaml_diagnostics.h"

#include <algorithm>
#include <cctype>
#include <vector>

#include <fmt/format.h>

namespace sp::yaml_diagnostics {
namespace {

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      const bool same =
          std::tolower(static_cast<unsigned char>(a[i - 1])) == std::tolower(static_cast<unsigned char>(b[j - 1]));
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (same ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined:
      return "nothing (null)";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a mapping";
    case YAML::NodeType::Scalar:
      break;
  }
  // yaml-cpp tags quoted scalars "!" and plain ones "?".
  if (node.Tag() == "!") return fmt::format("the string \"{}\"", node.Scalar());
  return fmt::format("'{}'", node.Scalar());
}

bool is_plain_scalar(const YAML::Node& node) {
  if (!node.IsScalar() || node.Tag() == "!") return false;
  // YAML strips the blanks around a plain scalar, so one that still has them came from bytes
  // yaml-cpp reads as blanks (a NUL byte: "threads: 1<NUL> # ..." reads as "1     "). Its
  // converters accept such a number, but the emitter writes the scalar back quoted, so the
  // config a host resolves and hands on would read as a string (found by fuzzing, docs/fuzzing.md).
  const std::string& text = node.Scalar();
  const auto blank = [](char c) { return c == '\0' || std::isspace(static_cast<unsigned char>(c)) != 0; };
  return text.empty() || (!blank(text.front()) && !blank(text.back()));
}

std::optional<std::string_view> closest_key(std::string_view unknown, const char* const* candidates,
                                            std::size_t count) {
  std::optional<std::string_view> best;
  std::size_t best_distance = std::max<std::size_t>(3, unknown.size() / 3) + 1;
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t distance = edit_distance(unknown, candidates[i]);
    if (distance < best_distance) {
      best = candidates[i];
      best_distance = distance;
    }
  }
  return best;
}

}  // namespace sp::yaml_diagnostics
