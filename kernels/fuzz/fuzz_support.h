// What every libFuzzer harness of the project shares (docs/fuzzing.md): how a broken contract
// ends the run, and scratch files for the parsers that read from a path. Header-only; each
// harness includes it through selective_precision_add_fuzzer.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace sp::fuzz {

// Reports `what` on stderr, naming the harness, and aborts, so that libFuzzer keeps the input
// that broke the contract between the harness and the parser.
[[noreturn]] inline void contract_violated(const char *harness, const std::string &what) {
  std::fprintf(stderr, "%s: contract violated: %s\n", harness, what.c_str());
  std::abort();
}

// A file of its own under /tmp for this process (`name` tells the harness's files apart),
// removed when the scratch file is destroyed: make it a static of the harness.
class ScratchFile {
 public:
  explicit ScratchFile(const std::string &name)
      : path_("/tmp/sp-fuzz-" + std::to_string(::getpid()) + "-" + name) {}
  ~ScratchFile() { std::remove(path_.c_str()); }
  ScratchFile(const ScratchFile &) = delete;
  ScratchFile &operator=(const ScratchFile &) = delete;

  const std::string &path() const { return path_; }
  // Replaces the file's contents with `size` bytes; a failure aborts (the input is not to blame,
  // but the run cannot go on).
  void write(const void *data, std::size_t size) const {
    std::FILE *file = std::fopen(path_.c_str(), "wb");
    if (file == nullptr) contract_violated("ScratchFile", "cannot write " + path_);
    const bool written = size == 0 || std::fwrite(data, 1, size, file) == size;
    if (std::fclose(file) != 0 || !written) contract_violated("ScratchFile", "cannot write all of " + path_);
  }

 private:
  std::string path_;
};

}  // namespace sp::fuzz
