// Fuzzes the transfer report reader (sp/adapters/transfer_policy.h): report_from_json on the
// text of a report file that `sp-bench transfer` wrote, or someone edited.
//
// Contract checked:
//   - report_from_json either returns or throws sp::adapters::TransferPolicyError; anything else
//     escapes and the fuzzer reports it;
//   - an accepted report round-trips: report_to_json, read back, written again, gives the same
//     text;
//   - merge-policy accepts it (or refuses it with TransferPolicyError: no measurement), and the
//     merged policy's file reads back (TransferPolicy::from_json) to the same text: what
//     sp-bench writes, a run can load;
//   - the gate of the merged policy answers for every path without throwing.
// Any violation aborts.
#include "fuzz_support.h"
#include "sp/adapters/transfer_policy.h"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

namespace a = sp::adapters;

[[noreturn]] void fail(const std::string &what) { sp::fuzz::contract_violated("transfer_report_fuzzer", what); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  const std::string text(reinterpret_cast<const char *>(data), size);
  a::TransferReport report;
  try {
    report = a::report_from_json(text, "fuzz-report.json");
  } catch (const a::TransferPolicyError &) {
    return 0;
  }

  const std::string written = a::report_to_json(report);
  a::TransferReport again;
  try {
    again = a::report_from_json(written, "rewritten-report.json");
  } catch (const a::TransferPolicyError &error) {
    fail(std::string("report_to_json wrote a report that report_from_json rejects: ") + error.what());
  }
  if (a::report_to_json(again) != written) fail("report -> json -> report -> json is not a fixed point");

  a::TransferPolicy merged;
  try {
    merged = a::TransferPolicy::merge({report}, 1.0);
  } catch (const a::TransferPolicyError &) {
    if (!report.points.empty()) fail("merge-policy refused a report that has measurements");
    return 0;
  }
  const std::string policy_text = merged.to_json();
  try {
    if (a::TransferPolicy::from_json(policy_text, "merged-policy.json").to_json() != policy_text) {
      fail("a merged policy does not read back to the same text");
    }
  } catch (const a::TransferPolicyError &error) {
    fail(std::string("TransferPolicy::from_json rejects what merge + to_json wrote: ") + error.what());
  }
  std::vector<std::uint64_t> sizes;
  for (const a::TransferPoint &point : report.points) {
    sizes.push_back(point.bf16_bytes);
    sizes.push_back(point.bf16_bytes + 1);
    if (point.bf16_bytes != 0) sizes.push_back(point.bf16_bytes - 1);
  }
  for (a::BlockWeights weights : {a::BlockWeights::kFrozen, a::BlockWeights::kTrained}) {
    const a::TransferGate gate = a::transfer_gate(merged, weights, sizes);
    (void)gate;
  }
  return 0;
}
