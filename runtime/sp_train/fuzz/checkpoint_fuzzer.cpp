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

[[noreturn]] void fail(const std::string &what) {
  std::fprintf(stderr, "checkpoint_fuzzer: contract violated: %s\n", what.c_str());
  std::abort();
}

struct ScratchFiles {
  std::string input = "/tmp/sp-fuzz-checkpoint-" + std::to_string(::getpid()) + ".bin";
  std::string rewritten = "/tmp/sp-fuzz-checkpoint-" + std::to_string(::getpid()) + "-rewritten.bin";
  ~ScratchFiles() {
    std::remove(input.c_str());
    std::remove(rewritten.c_str());
  }
};

const ScratchFiles &scratch() {
  static const ScratchFiles files;
  return files;
}

void write_file(const std::string &path, const std::uint8_t *data, std::size_t size) {
  std::FILE *f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) fail("cannot write the scratch file " + path);
  if (size != 0 && std::fwrite(data, 1, size, f) != size) fail("short write to " + path);
  if (std::fclose(f) != 0) fail("cannot close " + path);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t flags = data[0];
  std::vector<std::uint8_t> file(data + 1, data + size);
  if ((flags & 1u) && file.size() >= 8) {
    const std::uint64_t sum = sp::runtime::fnv1a64(file.data(), file.size() - 8);
    std::memcpy(file.data() + file.size() - 8, &sum, sizeof sum);
  }
  const ScratchFiles &files = scratch();
  write_file(files.input, file.data(), file.size());

  sp::train::CheckpointSections sections;
  try {
    sections = sp::train::CheckpointSections::read(files.input);
  } catch (const sp::train::CheckpointError &error) {
    if (std::string(error.what()).find(files.input) == std::string::npos) fail("the error does not name the file");
    return 0;
  }

  sections.write_atomically(files.rewritten);
  sp::train::CheckpointSections again;
  try {
    again = sp::train::CheckpointSections::read(files.rewritten);
  } catch (const sp::train::CheckpointError &error) {
    fail(std::string("a rewritten checkpoint is rejected: ") + error.what());
  }
  if (again.all() != sections.all()) fail("a rewritten checkpoint reads back with other sections");

  std::string absent = "absent";
  while (sections.has(absent)) absent += "!";
  try {
    (void)sections.get(absent);
    fail("get() of a missing section returned");
  } catch (const sp::train::CheckpointError &) {
  }
  return 0;
}
