// Fuzzes sp-train's checkpoint reader (runtime/sp_train/src/checkpoint_file.h):
// CheckpointSections::read on a file under /tmp holding the input.
//
// Input: one flags byte, then the file. Flags bit 0: re-seal the FNV-1a trailer (the last 8
// bytes) before writing the file, so that mutations reach the parser behind the checksum.
//
// Contract checked:
//   - read either returns or throws sp::train::CheckpointError (exit code 4) naming the file;
//     anything else escapes and the fuzzer reports it;
//   - accepted sections round-trip: write_atomically, read again, same names and payloads;
//   - get() of a section that is not there throws CheckpointError.
// Any violation aborts.
#include "fuzz_support.h"
#include "checkpoint_file.h"

#include "sp/runtime/hash.h"

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

[[noreturn]] void fail(const std::string &what) { sp::fuzz::contract_violated("checkpoint_fuzzer", what); }


}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t flags = data[0];
  std::vector<std::uint8_t> file(data + 1, data + size);
  if ((flags & 1u) && file.size() >= 8) {
    const std::uint64_t sum = sp::runtime::fnv1a64(file.data(), file.size() - 8);
    std::memcpy(file.data() + file.size() - 8, &sum, sizeof sum);
  }
  static const sp::fuzz::ScratchFile input("checkpoint.bin"), rewritten("checkpoint-rewritten.bin");
  input.write(file.data(), file.size());

  sp::train::CheckpointSections sections;
  try {
    sections = sp::train::CheckpointSections::read(input.path());
  } catch (const sp::train::CheckpointError &error) {
    if (std::string(error.what()).find(input.path()) == std::string::npos) fail("the error does not name the file");
    return 0;
  }

  sections.write_atomically(rewritten.path());
  sp::train::CheckpointSections again;
  try {
    again = sp::train::CheckpointSections::read(rewritten.path());
  } catch (const sp::train::CheckpointError &error) {
    fail(std::string("a rewritten checkpoint is rejected: ") + error.what());
  }
  if (again.names() != sections.names()) fail("a rewritten checkpoint reads back with other section names");
  for (const std::string &name : sections.names()) {
    if (again.get(name) != sections.get(name)) fail("a rewritten checkpoint reads back with other bytes in " + name);
  }

  std::string absent = "absent";
  while (sections.has(absent)) absent += "!";
  try {
    (void)sections.get(absent);
    fail("get() of a missing section returned");
  } catch (const sp::train::CheckpointError &) {
  }
  return 0;
}
