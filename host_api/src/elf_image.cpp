#include "elf_image.h"

#include "file_descriptor.h"

#include <sp/host/plugin_library.h>

#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/std.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <system_error>

namespace sp::host {
namespace {

constexpr unsigned char kNativeClass = sizeof(void*) == 8 ? ELFCLASS64 : ELFCLASS32;
constexpr unsigned char kNativeByteOrder = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ ? ELFDATA2LSB : ELFDATA2MSB;

#if defined(__x86_64__)
constexpr std::uint16_t kNativeMachine = EM_X86_64;
#elif defined(__aarch64__)
constexpr std::uint16_t kNativeMachine = EM_AARCH64;
#elif defined(__powerpc64__)
constexpr std::uint16_t kNativeMachine = EM_PPC64;
#else
#error "add this architecture's ELF e_machine"
#endif

class ImageFile {
 public:
  ImageFile(const std::filesystem::path& shown_as, const std::filesystem::path& file)
      : shown_as_(shown_as), fd_(::open(file.c_str(), O_RDONLY | O_CLOEXEC)) {
    struct stat file_stat {};
    if (fd_.get() < 0 || ::fstat(fd_.get(), &file_stat) != 0) {
      fail(fmt::format("cannot read {}: {}", file, std::generic_category().message(errno)));
    }
    size_ = static_cast<std::uint64_t>(file_stat.st_size);
  }

  std::uint64_t size() const { return size_; }

  template <typename T>
  T read(std::uint64_t offset, const char* what) const {
    require_inside(offset, sizeof(T), what);
    T value{};
    if (::pread(fd_.get(), &value, sizeof(T), static_cast<off_t>(offset)) != static_cast<ssize_t>(sizeof(T))) {
      fail(fmt::format("reading its {} failed: {}", what, std::generic_category().message(errno)));
    }
    return value;
  }

  void require_inside(std::uint64_t offset, std::uint64_t bytes, const std::string& what) const {
    if (offset > size_ || bytes > size_ - offset) {
      fail(
          fmt::format("its {} needs {} bytes at offset {}, but the file has {} bytes: it is truncated or "
                      "corrupt (was it still being copied into place?)",
                      what, bytes, offset, size_));
    }
  }

  [[noreturn]] void fail(const std::string& why) const {
    throw PluginError(fmt::format("cannot load policy plugin {}: {}", shown_as_, why));
  }

 private:
  const std::filesystem::path& shown_as_;
  FileDescriptor fd_;
  std::uint64_t size_ = 0;
};

const char* segment_type_name(std::uint32_t type) {
  switch (type) {
    case PT_LOAD:
      return "PT_LOAD";
    case PT_DYNAMIC:
      return "PT_DYNAMIC";
    case PT_NOTE:
      return "PT_NOTE";
    case PT_GNU_EH_FRAME:
      return "PT_GNU_EH_FRAME";
    default:
      return "segment";
  }
}

}  // namespace

void check_elf_image(const std::filesystem::path& shown_as, const std::filesystem::path& file) {
  const ImageFile image(shown_as, file);
  using Magic = std::array<char, SELFMAG>;
  if (image.size() < SELFMAG || std::memcmp(image.read<Magic>(0, "ELF magic").data(), ELFMAG, SELFMAG) != 0) {
    image.fail("it is not an ELF shared object (it does not start with the ELF magic)");
  }
  const auto header = image.read<ElfW(Ehdr)>(0, "ELF header");
  if (header.e_ident[EI_CLASS] != kNativeClass || header.e_ident[EI_DATA] != kNativeByteOrder ||
      header.e_machine != kNativeMachine) {
    image.fail(
        fmt::format("it is an ELF file for another machine (class {}, byte order {}, machine {}; this "
                    "host needs class {}, byte order {}, machine {})",
                    header.e_ident[EI_CLASS], header.e_ident[EI_DATA], header.e_machine, kNativeClass, kNativeByteOrder,
                    kNativeMachine));
  }
  if (header.e_type != ET_DYN)
    image.fail(fmt::format("it is an ELF file of type {}, not a shared object", header.e_type));
  if (header.e_phentsize != sizeof(ElfW(Phdr))) {
    image.fail(fmt::format("its ELF header gives program headers of {} bytes, expected {}", header.e_phentsize,
                           sizeof(ElfW(Phdr))));
  }
  image.require_inside(header.e_phoff, std::uint64_t{header.e_phnum} * sizeof(ElfW(Phdr)), "program header table");
  for (std::uint16_t i = 0; i < header.e_phnum; ++i) {
    const auto segment =
        image.read<ElfW(Phdr)>(header.e_phoff + std::uint64_t{i} * sizeof(ElfW(Phdr)), "program header");
    // A segment with no file bytes (PT_GNU_STACK, say) maps nothing from the file, wherever
    // its offset points.
    if (segment.p_filesz == 0) continue;
    image.require_inside(segment.p_offset, segment.p_filesz,
                         fmt::format("{} (program header {})", segment_type_name(segment.p_type), i));
  }
  if (header.e_shnum != 0) {
    image.require_inside(header.e_shoff, std::uint64_t{header.e_shnum} * header.e_shentsize, "section header table");
  }
}

}  // namespace sp::host
