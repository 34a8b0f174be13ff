// The state blob: round trips, window resizing, and rejection of every kind of bad blob
// with the engine left exactly as it was.
#include "policy_test_support.h"

#include "sp/policy/errors.h"
#include "sp/policy/state_codec.h"

#include <boost/crc.hpp>
#include <gtest/gtest.h>

#include <cstring>
#include <limits>

namespace sp::policy::testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Layout offsets of format version 1, which format 2 keeps and appends to (state_codec.h).
constexpr std::size_t kVersionOffset = 8;
constexpr std::size_t kPolicyPayload = 24 + 12;
constexpr std::size_t kBlocksOffset = kPolicyPayload + 4 + 4 + 8 + 1 + 32;
constexpr std::size_t kFirstBlockRecord = kBlocksOffset + 12;
constexpr std::size_t kFirstSample = kFirstBlockRecord + 5 + 8 + 8 + 5 * 8 + 4;

std::string settings(int history_window) {
  return standalone(
      "  warmup_steps: 1\n  update_interval_steps: 2\n  min_steps_between_switches: 3\n"
      "  telemetry_enabled: false\n  history_window: " +
      std::to_string(history_window) + "\n");
}

// A policy mid-run: samples, assignments, switches, calibration errors, an unsafe flag.
void run_some_steps(Driver &driver) {
  const std::uint32_t ids[] = {1, 3};
  const double errors[] = {0.01, 0.2};
  driver.engine().set_calibration_errors(ids, errors, 2);
  for (int step = 0; step < 9; ++step) {
    driver.step_l2(step, {0.1 * (step + 1), 1.0, 3.0 + step % 2, step % 3 == 0 ? kNaN : 0.5});
  }
  driver.engine().begin_step(9);
  const sp_grad_moments_v1 moments[] = {nonfinite_moments(2), moments_with_l2(0, 2.0)};
  driver.engine().post_backward(9, moments, 2);
}

class PolicyStateBlob : public ::testing::Test {
 protected:
  PolicyStateBlob() : source(settings(4), 4), target(settings(4), 4) {
    run_some_steps(source);
    blob = source.engine().export_state();
    target.step_l2(0, {1.0, 1.0, 1.0, 1.0});
    target_before = target.engine().export_state();
  }

  void expect_rejected(const std::vector<std::uint8_t> &bad, const std::string &message_part) {
    try {
      target.engine().import_state(bad.data(), bad.size());
      ADD_FAILURE() << "accepted a blob that should say: " << message_part;
    } catch (const StateError &error) {
      EXPECT_NE(std::string(error.what()).find(message_part), std::string::npos) << error.what();
    }
    EXPECT_EQ(target.engine().export_state(), target_before);
  }

  Driver source;
  Driver target;
  std::vector<std::uint8_t> blob;
  std::vector<std::uint8_t> target_before;
};

TEST_F(PolicyStateBlob, RoundTripRestoresEveryField) {
  target.engine().import_state(blob.data(), blob.size());
  EXPECT_EQ(target.engine().export_state(), blob);
  const PolicyState &restored = target.engine().state();
  EXPECT_EQ(restored.current_step, 9);
  EXPECT_EQ(restored.phase, StepPhase::backward_done);
  EXPECT_TRUE(restored.blocks[2].unsafe);
  EXPECT_EQ(restored.blocks[3].calibration_error, 0.2);
  EXPECT_EQ(restored.windows.size(3), source.engine().state().windows.size(3));
}

TEST_F(PolicyStateBlob, ImportedPolicyDecidesExactlyAsTheOriginal) {
  target.engine().import_state(blob.data(), blob.size());
  std::vector<sp_hint_v1> original(4);
  std::vector<sp_hint_v1> imported(4);
  source.engine().compute_hints(9, original.data(), 4);
  target.engine().compute_hints(9, imported.data(), 4);
  source.engine().end_step(9, nullptr);
  target.engine().end_step(9, nullptr);
  for (int step = 10; step < 30; ++step) {
    const std::vector<double> l2 = {0.05 * step, 1.0 / step, 2.0, step % 4 == 0 ? kNaN : 0.3};
    const auto a = source.step_l2(step, l2);
    const auto b = target.step_l2(step, l2);
    for (int block = 0; block < 4; ++block) {
      EXPECT_EQ(a[block].precision, b[block].precision) << step;
      EXPECT_EQ(a[block].reason, b[block].reason) << step;
    }
  }
  EXPECT_EQ(source.engine().export_state(), target.engine().export_state());
}

TEST_F(PolicyStateBlob, ASmallerHistoryWindowKeepsTheNewestSamples) {
  Driver smaller(settings(2), 4);
  smaller.engine().import_state(blob.data(), blob.size());
  const SampleWindows &before = source.engine().state().windows;
  const SampleWindows &after = smaller.engine().state().windows;
  ASSERT_EQ(after.size(0), 2u);
  EXPECT_EQ(after.at(0, 0).l2, before.at(0, before.size(0) - 2).l2);
  EXPECT_EQ(after.at(0, 1).l2, before.at(0, before.size(0) - 1).l2);
}

TEST_F(PolicyStateBlob, ALargerHistoryWindowKeepsEverySample) {
  Driver larger(settings(16), 4);
  larger.engine().import_state(blob.data(), blob.size());
  EXPECT_EQ(larger.engine().state().windows.size(0), source.engine().state().windows.size(0));
}

TEST_F(PolicyStateBlob, EveryTruncationIsRejected) {
  for (std::size_t size = 0; size < blob.size(); ++size) {
    const std::vector<std::uint8_t> truncated(blob.begin(), blob.begin() + static_cast<std::ptrdiff_t>(size));
    EXPECT_THROW(target.engine().import_state(truncated.data(), truncated.size()), StateError) << size;
  }
  EXPECT_EQ(target.engine().export_state(), target_before);
}

TEST_F(PolicyStateBlob, EverySingleBitFlipIsRejected) {
  for (std::size_t bit = 0; bit < blob.size() * 8; ++bit) {
    std::vector<std::uint8_t> flipped = blob;
    flipped[bit / 8] ^= static_cast<std::uint8_t>(1u << (bit % 8));
    EXPECT_THROW(target.engine().import_state(flipped.data(), flipped.size()), StateError) << bit;
  }
  EXPECT_EQ(target.engine().export_state(), target_before);
}

TEST_F(PolicyStateBlob, ResealedRandomCorruptionNeverCrashesAndNeverHalfApplies) {
  std::uint64_t seed = 7;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<std::uint8_t> corrupted = blob;
    for (int flips = 0; flips < 1 + trial % 4; ++flips) {
      seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
      const std::size_t at = 24 + (seed >> 33) % (corrupted.size() - 28);
      corrupted[at] ^= static_cast<std::uint8_t>(1u << ((seed >> 20) % 8));
    }
    reseal(corrupted);
    const std::vector<std::uint8_t> before = target.engine().export_state();
    try {
      target.engine().import_state(corrupted.data(), corrupted.size());
      target.engine().import_state(target_before.data(), target_before.size());
    } catch (const StateError &) {
      ASSERT_EQ(target.engine().export_state(), before) << trial;
    }
  }
}

TEST_F(PolicyStateBlob, RejectsEmptyAndNullBlobs) {
  expect_rejected({}, "shorter than its 28-byte header");
  EXPECT_THROW(target.engine().import_state(nullptr, 100), StateError);
}

TEST_F(PolicyStateBlob, RejectsForeignBytes) {
  std::vector<std::uint8_t> foreign = blob;
  foreign[0] = 'X';
  expect_rejected(foreign, "magic");
}

TEST_F(PolicyStateBlob, RejectsAnotherFormatVersion) {
  std::vector<std::uint8_t> other = blob;
  store_u32(other, kVersionOffset, 5);
  reseal(other);
  expect_rejected(other, "format version 5 is not supported; this plugin reads versions 1 to 4");
}

TEST_F(PolicyStateBlob, RejectsFormatFourWithoutARuleSection) {
  std::vector<std::uint8_t> other = blob;
  store_u32(other, kVersionOffset, 4);
  reseal(other);
  expect_rejected(other, "format version 4 has more than 5");
}

TEST_F(PolicyStateBlob, RejectsAChecksumMismatch) {
  std::vector<std::uint8_t> corrupted = blob;
  corrupted[kFirstSample] ^= 0x40;
  expect_rejected(corrupted, "checksum");
}

TEST_F(PolicyStateBlob, RejectsPaddedBlobs) {
  std::vector<std::uint8_t> padded = blob;
  padded.push_back(0);
  expect_rejected(padded, "header says");
}

TEST_F(PolicyStateBlob, RejectsABlobForAnotherBlockCount) {
  Driver other(settings(4), 5);
  const std::vector<std::uint8_t> before = other.engine().export_state();
  try {
    other.engine().import_state(blob.data(), blob.size());
    FAIL();
  } catch (const StateError &error) {
    EXPECT_NE(std::string(error.what()).find("for 4 blocks, but this policy has 5"), std::string::npos);
  }
  EXPECT_EQ(other.engine().export_state(), before);
}

TEST_F(PolicyStateBlob, RejectsAnUnknownAssignmentCode) {
  std::vector<std::uint8_t> bad = blob;
  bad[kFirstBlockRecord] = 7;
  reseal(bad);
  expect_rejected(bad, "block 0: assignment code must be 0 (unassigned), 1 (bf16), 2 (int8) or 3 (nf4), found 7");
}

TEST_F(PolicyStateBlob, RejectsANonFiniteSample) {
  std::vector<std::uint8_t> bad = blob;
  store_f64(bad, kFirstSample, kNaN);
  reseal(bad);
  expect_rejected(bad, "block 0: sample l2 must be a finite number >= 0");
}

TEST_F(PolicyStateBlob, RejectsASensitivityOutsideTheUnitInterval) {
  std::vector<std::uint8_t> bad = blob;
  store_f64(bad, kFirstBlockRecord + 5 + 8 + 8 + 4 * 8, 1.5);
  reseal(bad);
  expect_rejected(bad, "block 0: grad_score, error_score and sensitivity must lie in [0, 1]");
}

TEST_F(PolicyStateBlob, RejectsAWindowLargerThanItsCapacity) {
  std::vector<std::uint8_t> bad = blob;
  store_u32(bad, kFirstSample - 4, 5);
  reseal(bad);
  expect_rejected(bad, "block 0: window holds 5 samples, more than its capacity 4");
}

TEST_F(PolicyStateBlob, RejectsAStepPhaseThatDoesNotExist) {
  std::vector<std::uint8_t> bad = blob;
  bad[kPolicyPayload + 16] = 9;
  reseal(bad);
  expect_rejected(bad, "step phase must be in [0, 4], found 9");
}

TEST(PolicyStateFresh, AFreshPolicyRoundTrips) {
  Driver fresh(settings(3), 2);
  const std::vector<std::uint8_t> blob = fresh.engine().export_state();
  Driver other(settings(3), 2);
  other.engine().import_state(blob.data(), blob.size());
  EXPECT_EQ(other.engine().export_state(), blob);
  EXPECT_EQ(other.engine().state().current_step, -1);
}

}  // namespace
}  // namespace sp::policy::testing
