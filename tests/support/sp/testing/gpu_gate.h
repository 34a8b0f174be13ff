// How a GPU test leaves a machine without a usable device: it skips, unless the run says a
// GPU must be there (SP_REQUIRE_GPU=1, as on the lent device machines), where it fails, so
// that a broken driver or toolkit setup cannot pass as a suite of skips.
#pragma once

#include <cstdlib>
#include <cstring>

#include <gtest/gtest.h>

namespace sp::testing {

inline bool gpu_required() {
  const char* value = std::getenv("SP_REQUIRE_GPU");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

}  // namespace sp::testing

// In a test body or SetUp: returns from it, failed or skipped, when `usable` is false.
#define SP_SKIP_UNLESS_GPU(usable, why)                                               \
  do {                                                                                \
    if (!(usable)) {                                                                  \
      if (::sp::testing::gpu_required()) FAIL() << "SP_REQUIRE_GPU=1, but " << (why); \
      GTEST_SKIP() << (why);                                                          \
    }                                                                                 \
  } while (false)
