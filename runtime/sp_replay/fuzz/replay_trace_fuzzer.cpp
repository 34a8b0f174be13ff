// Fuzzes sp-replay's trace reader (runtime/sp_replay/src/replay_inputs.h): TraceReader::next over
// the input as a JSONL trace of a 4-block model.
//
// Contract checked:
//   - next() either returns a step, returns nullopt at the end, or throws sp::replay::InputError
//     ("FILE:LINE: FIELD: problem", naming the source); anything else escapes and the fuzzer
//     reports it;
//   - every step it returns is valid for the policy: steps 0, 1, 2, ... in order; block ids
//     below n_blocks, each at most once; sum_sq and max_abs finite and >= 0, sum finite;
//     nonfinite <= count; loss finite or NaN (unknown).
// Any violation aborts.
#include "fuzz_support.h"
#include "replay_inputs.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr std::uint32_t kBlocks = 4;

[[noreturn]] void fail(const std::string &what) { sp::fuzz::contract_violated("replay_trace_fuzzer", what); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char *>(data), size));
  sp::replay::TraceReader reader(in, "fuzz-trace.jsonl", kBlocks);
  std::int64_t expected = 0;
  try {
    while (const std::optional<sp::replay::TraceStep> step = reader.next()) {
      if (step->step != expected++) fail("steps out of order");
      if (step->moments.size() > kBlocks) fail("more moments than blocks");
      std::vector<bool> seen(kBlocks, false);
      for (const sp_grad_moments_v1 &m : step->moments) {
        if (m.block_id >= kBlocks) fail("a block id out of range");
        if (seen[m.block_id]) fail("a block twice in one step");
        seen[m.block_id] = true;
        if (!std::isfinite(m.sum_sq) || m.sum_sq < 0 || !std::isfinite(m.max_abs) || m.max_abs < 0 ||
            !std::isfinite(m.sum)) {
          fail("a moment that is not a finite number (>= 0 for sum_sq and max_abs)");
        }
        if (m.nonfinite > m.count) fail("nonfinite > count");
      }
      if (std::isinf(step->loss)) fail("an infinite loss");
    }
  } catch (const sp::replay::InputError &error) {
    if (std::string(error.what()).rfind("fuzz-trace.jsonl:", 0) != 0) fail("an InputError that does not name the file");
  }
  return 0;
}
