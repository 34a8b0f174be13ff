#include "sp/runtime/hash.h"

#include <string>

#include <gtest/gtest.h>

namespace sp::runtime {
namespace {

// These values are written into checkpoints, calibration caches and run summaries: a change
// here invalidates every file on disk.
TEST(HashTest, Fnv1a64MatchesTheReferenceVectors) {
  EXPECT_EQ(fnv1a64(nullptr, 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a", 1), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("foobar", 6), 0x85944171f73967e8ull);
}

TEST(HashTest, Fnv1a64ContinuesFromAState) {
  const std::string foo = "foo";
  const std::string bar = "bar";
  EXPECT_EQ(fnv1a64(bar.data(), bar.size(), fnv1a64(foo.data(), foo.size())), fnv1a64("foobar", 6));
}

TEST(HashTest, Mix64IsSplitMix64) {
  EXPECT_EQ(mix64(0), 0xe220a8397b1dcdafull);
  EXPECT_EQ(mix64(1), 0x910a2dec89025cc1ull);
  EXPECT_EQ(mix64(0xffffffffffffffffull), 0xe4d971771b652c20ull);
}

}  // namespace
}  // namespace sp::runtime
