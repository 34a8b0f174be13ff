#include "sp/error.h"

#include <stdexcept>
#include <string>

#include <gtest/gtest.h>

namespace sp {
namespace {

// An sp::Error is caught as itself, with its kind, and as the standard exception it also is,
// with the same message: existing catch sites and Python's exception mapping do not change.
TEST(Error, IsCaughtAsItselfAndAsItsStandardException) {
  const auto throw_it = [] { throw ErrorAs<std::invalid_argument>(ErrorKind::bad_input, "blocks.0: shape [3]"); };
  try {
    throw_it();
    FAIL() << "nothing thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::bad_input);
    EXPECT_STREQ(e.what(), "blocks.0: shape [3]");
  }
  EXPECT_THROW(throw_it(), std::invalid_argument);
  try {
    throw_it();
  } catch (const std::exception& e) {  // one std::exception base, so this handler matches
    EXPECT_STREQ(e.what(), "blocks.0: shape [3]");
  }
}

TEST(Error, EveryKindHasAName) {
  for (ErrorKind kind : {ErrorKind::bad_input, ErrorKind::plugin, ErrorKind::collective, ErrorKind::device,
                         ErrorKind::internal}) {
    EXPECT_STRNE(error_kind_name(kind), "unknown");
  }
}

}  // namespace
}  // namespace sp
