#include "sp/yaml_diagnostics/yaml_diagnostics.h"

#include <array>
#include <string>
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

// Found by fuzzing sp-train's config (docs/fuzzing.md): yaml-cpp reads "1<NUL>" as "1" and
// blanks, which its converters took for the number 1, while the emitter writes it back quoted,
// so the resolved config (the run directory's config.yaml, the plugin's text) read as a string.
TEST(Describe, ABlankEdgedScalarIsNoNumber) {
  const YAML::Node doc = YAML::Load(std::string("threads: 1   \0   # two cores\nsteps: 3\n", 38));
  ASSERT_TRUE(doc["threads"].IsScalar());
  EXPECT_FALSE(is_plain_scalar(doc["threads"]));
  EXPECT_TRUE(is_plain_scalar(doc["steps"]));
  YAML::Emitter out;
  out << doc;
  EXPECT_FALSE(is_plain_scalar(YAML::Load(out.c_str())["threads"]));  // written back quoted
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
