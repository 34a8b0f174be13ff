// How this project's death tests start their child: re-executed ("threadsafe", so that the
// child holds no other thread's locks) from a fork(). gtest's default, a clone() whose child
// starts on two pages of stack, died in the parent with SIGSEGV on an H100 host (2026-11-26),
// where a lazily bound call saves a processor state larger than that.
#pragma once

#include <gtest/gtest.h>

// A command-line flag (--gtest_death_test_use_fork) that gtest declares in no public header.
GTEST_DECLARE_bool_(death_test_use_fork);

namespace sp::testing {

// Call at the start of a death test.
inline void fork_death_test_children() {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  GTEST_FLAG_SET(death_test_use_fork, true);
}

}  // namespace sp::testing
