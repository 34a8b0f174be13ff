// Fuzzes the ELF pre-check that runs before a plugin file is handed to the dynamic loader
// (host_api/src/elf_image.h): the input is written to a file under /tmp and checked.
//
// Contract checked: check_elf_image() either returns or throws sp::host::PluginError whose
// message names the file; no other exception, no crash, no sanitizer report. When it accepts a
// file, the file is a native ELF shared object whose program header table and every segment with
// file bytes lie inside the file (checked here again, independently); otherwise abort().
#include "fuzz_support.h"
#include "elf_image.h"

#include <sp/host/plugin_library.h>

#include <elf.h>
#include <link.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

[[noreturn]] void fail(const std::string &what) { sp::fuzz::contract_violated("elf_image_fuzzer", what); }


bool inside(std::uint64_t offset, std::uint64_t bytes, std::uint64_t size) {
  return offset <= size && bytes <= size - offset;
}

void check_accepted(const std::uint8_t *data, std::size_t size) {
  if (size < sizeof(ElfW(Ehdr))) fail("accepted a file shorter than an ELF header");
  ElfW(Ehdr) header;
  std::memcpy(&header, data, sizeof header);
  if (std::memcmp(header.e_ident, ELFMAG, SELFMAG) != 0) fail("accepted a file without the ELF magic");
  if (header.e_type != ET_DYN) fail("accepted an ELF file that is not a shared object");
  if (header.e_phentsize != sizeof(ElfW(Phdr))) fail("accepted an unexpected program header size");
  const std::uint64_t table = std::uint64_t{header.e_phnum} * sizeof(ElfW(Phdr));
  if (!inside(header.e_phoff, table, size)) fail("accepted a program header table outside the file");
  for (std::uint16_t i = 0; i < header.e_phnum; ++i) {
    ElfW(Phdr) segment;
    std::memcpy(&segment, data + header.e_phoff + std::size_t{i} * sizeof segment, sizeof segment);
    if (segment.p_filesz != 0 && !inside(segment.p_offset, segment.p_filesz, size)) {
      fail("accepted a segment whose file bytes lie outside the file");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  static const sp::fuzz::ScratchFile scratch("elf-image.so");
  scratch.write(data, size);
  const std::string &path = scratch.path();
  try {
    sp::host::check_elf_image("fuzz-plugin.so", path);
  } catch (const sp::host::PluginError &error) {
    if (std::string(error.what()).find("fuzz-plugin.so") == std::string::npos) fail("the error does not name the file");
    return 0;
  }
  check_accepted(data, size);
  return 0;
}
