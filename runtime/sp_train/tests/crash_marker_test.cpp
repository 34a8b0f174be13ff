#include "crash_marker.h"

#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "sp/host/policy_host.h"

namespace sp::train {
namespace {

namespace fs = std::filesystem;

// Named without the pid: a death test's child is another process (it re-runs the test from the
// start) and must find the same directory.
fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / "sp-crash-marker-test" / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A policy plugin that writes through NULL in compute_hints at step 2 (the host tests' scripted
// fixture), driven as a trainer drives it.
[[noreturn]] void crash_inside_a_plugin(const fs::path& marker) {
  install_crash_marker(marker);
  std::vector<host::BlockDescription> blocks;
  for (std::uint32_t id = 0; id < 4; ++id)
    blocks.push_back({id, 1000, {{2000, 1016, 0}}, "block." + std::to_string(id)});
  host::PolicyHost policy(SP_FIXTURE_SCRIPTED,
                          {"fixture_crash_hook: compute_hints\nfixture_fail_at_step: 2\n", "scripted.yaml"}, blocks);
  for (std::int64_t step = 0;; ++step) {
    policy.begin_step(step);
    std::vector<sp_grad_moments_v1> moments(blocks.size());
    for (std::uint32_t id = 0; id < blocks.size(); ++id) moments[id] = {id, 0, 1.0, 0.0, 1.0, 100, 0};
    policy.post_backward(step, moments);
    policy.compute_hints(step);
    policy.end_step(step, nullptr);
  }
}

TEST(CrashMarkerDeathTest, NamesThePluginAndTheCallThatCrashedTheRun) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const fs::path marker = fresh_dir("plugin") / kCrashMarkerFile;
  EXPECT_EXIT(crash_inside_a_plugin(marker), ::testing::KilledBySignal(SIGSEGV), "");
  const std::optional<std::string> text = take_crash_marker(marker);
  ASSERT_TRUE(text.has_value()) << "no marker was left";
  EXPECT_NE(text->find("died of SIGSEGV inside policy plugin scripted_fixture"), std::string::npos) << *text;
  EXPECT_NE(text->find("in compute_hints at step 2"), std::string::npos) << *text;
  EXPECT_FALSE(fs::exists(marker)) << "taking the marker removes it";
  EXPECT_FALSE(take_crash_marker(marker).has_value());
}

TEST(CrashMarkerDeathTest, SaysSoWhenTheCrashWasOutsideAnyPluginCall) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const fs::path marker = fresh_dir("outside") / kCrashMarkerFile;
  EXPECT_EXIT(
      {
        install_crash_marker(marker);
        std::abort();
      },
      ::testing::KilledBySignal(SIGABRT), "");
  const std::optional<std::string> text = take_crash_marker(marker);
  ASSERT_TRUE(text.has_value());
  EXPECT_NE(text->find("died of SIGABRT outside any policy plugin call"), std::string::npos) << *text;
}

TEST(CrashMarker, ARunWithoutACrashLeavesNone) {
  const fs::path marker = fresh_dir("none") / kCrashMarkerFile;
  EXPECT_FALSE(take_crash_marker(marker).has_value());
}

}  // namespace
}  // namespace sp::train
