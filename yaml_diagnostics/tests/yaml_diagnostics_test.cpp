#include "sp/yaml_diagnostics/yaml_diagnostics.h"

#include <array>
#include <vector>

#include <gtest/gtest.h>

namespace sp::yaml_diagnostics {
namespace {

TEST(Describe, SaysWhatYamlMadeOfTheValue) {
  const YAML::Node doc = YAML::Load("{quoted: \"0.5\", plain: 0.5, empty: , list: [1], map: {a: 1}}");
  EXPECT_EQ(describe(doc["quoted"]), "the string \"0.5\"");
  EXPECT_EQ(describe(doc["plain"]), "'0.5'");
  EXPECT_EQ(describe(doc["empty"]), "nothing (null)");
  EXPECT_EQ(describe(doc["list"]), "a list");
  EXPECT_EQ(describe(doc["map"]), "a mapping");
  EXPECT_TRUE(is_plain_scalar(doc["plain"]));
  EXPECT_FALSE(is_plain_scalar(doc["quoted"]));
  EXPECT_FALSE(is_plain_scalar(doc["list"]));
}

TEST(ClosestKey, SuggestsOnlyANearMisspelling) {
  const std::array<const char*, 3> keys = {"bf16_threshold", "int8_threshold", "history_window"};
  EXPECT_EQ(closest_key("bf16_treshold", keys), "bf16_threshold");
  EXPECT_EQ(closest_key("HISTROY_WINDOW", keys), "history_window");
  EXPECT_EQ(closest_key("learning_rate", keys), std::nullopt);
  const std::vector<const char*> short_keys = {"lr", "eps"};
  EXPECT_EQ(closest_key("lr2", short_keys), "lr");
  EXPECT_EQ(closest_key("", std::vector<const char*>{}), std::nullopt);
}

}  // namespace
}  // namespace sp::yaml_diagnostics
