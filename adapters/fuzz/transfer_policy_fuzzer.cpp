// Fuzzes the transfer policy reader (sp/adapters/transfer_policy.h): TransferPolicy::from_json on
// the text of the file that memory.stagehand.streaming.transfer_policy_path names.
//
// Contract checked:
//   - from_json either returns or throws sp::adapters::TransferPolicyError; anything else
//     escapes and the fuzzer reports it;
//   - an accepted policy round-trips: to_json, read back, written again, gives the same text;
//   - its rules per path are sorted, disjoint and non-empty (min_bytes < max_bytes), as the
//     lookups assume, and find_rule / pays agree with them at every rule's edges.
// Any violation aborts.
#include "fuzz_support.h"
#include "sp/adapters/transfer_policy.h"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

namespace a = sp::adapters;

[[noreturn]] void fail(const std::string &what) { sp::fuzz::contract_violated("transfer_policy_fuzzer", what); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  const std::string text(reinterpret_cast<const char *>(data), size);
  a::TransferPolicy policy;
  try {
    policy = a::TransferPolicy::from_json(text, "fuzz-policy.json");
  } catch (const a::TransferPolicyError &) {
    return 0;
  }

  const std::string written = policy.to_json();
  try {
    if (a::TransferPolicy::from_json(written, "rewritten-policy.json").to_json() != written) {
      fail("policy -> json -> policy -> json is not a fixed point");
    }
  } catch (const a::TransferPolicyError &error) {
    fail(std::string("to_json wrote a policy that from_json rejects: ") + error.what());
  }

  for (const a::TransferPath path : a::transfer_paths()) {
    const auto &rules = policy.rules(path);
    for (std::size_t i = 0; i < rules.size(); ++i) {
      const a::TransferRule &rule = rules[i];
      if (rule.max_bytes && *rule.max_bytes <= rule.min_bytes) fail("an accepted rule is empty");
      if (i + 1 < rules.size() && (!rule.max_bytes || *rule.max_bytes > rules[i + 1].min_bytes)) {
        fail("accepted rules are not sorted and disjoint");
      }
      if (policy.find_rule(path, rule.min_bytes) != &rule) fail("find_rule misses a rule's min_bytes");
      if (!policy.pays(path, rule.min_bytes)) fail("pays() is false at a rule's min_bytes");
      if (rule.max_bytes) {
        const a::TransferRule *next = policy.find_rule(path, *rule.max_bytes);
        if (next == &rule) fail("find_rule finds a rule at its exclusive max_bytes");
        if (*rule.max_bytes - 1 != rule.min_bytes && policy.find_rule(path, *rule.max_bytes - 1) != &rule) {
          fail("find_rule misses a rule's last byte size");
        }
      }
    }
    if (!rules.empty() && rules.front().min_bytes > 0 && policy.pays(path, rules.front().min_bytes - 1)) {
      fail("pays() below the smallest rule");
    }
  }
  return 0;
}
