// Fuzzes sp-replay's calibration file reader (runtime/sp_replay/src/replay_inputs.h):
// read_calibration_file on a file under /tmp holding the input, for a 4-block model.
//
// Contract checked:
//   - read_calibration_file either returns or throws sp::replay::InputError naming the file;
//     anything else escapes and the fuzzer reports it;
//   - what it returns is valid for the plugin's set_calibration_errors: per precision one error
//     per id, ids below n_blocks and distinct, errors finite and >= 0.
// Any violation aborts.
#include "fuzz_support.h"
#include "replay_inputs.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

constexpr std::uint32_t kBlocks = 4;

[[noreturn]] void fail(const std::string &what) { sp::fuzz::contract_violated("replay_calibration_fuzzer", what); }

void check(const sp::replay::BlockErrors &errors) {
  if (errors.block_ids.size() != errors.errors.size()) fail("ids and errors differ in count");
  for (std::size_t i = 0; i < errors.block_ids.size(); ++i) {
    if (errors.block_ids[i] >= kBlocks) fail("a block id out of range");
    if (std::count(errors.block_ids.begin(), errors.block_ids.end(), errors.block_ids[i]) != 1) fail("an id twice");
    if (!std::isfinite(errors.errors[i]) || errors.errors[i] < 0) fail("an error that is not finite and >= 0");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  static const sp::fuzz::ScratchFile scratch("replay-calibration.json");
  scratch.write(data, size);
  const std::string &path = scratch.path();

  sp::replay::CalibrationFile file;
  try {
    file = sp::replay::read_calibration_file(path, kBlocks);
  } catch (const sp::replay::InputError &error) {
    if (std::string(error.what()).find(path) == std::string::npos) fail("an InputError that does not name the file");
    return 0;
  }
  for (const sp::replay::BlockErrors &errors : file.errors.values) check(errors);
  return 0;
}
