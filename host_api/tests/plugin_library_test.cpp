#include <sp/host/plugin_library.h>

#include "test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

namespace sp::host {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::TempDir;

std::string load_error(const std::filesystem::path& file) {
  try {
    PluginLibrary::load(file);
  } catch (const PluginError& error) {
    return error.what();
  }
  ADD_FAILURE() << "loading " << file << " succeeded";
  return {};
}

// A copy of the minimal example inside a fresh directory, with a chosen file mode.
std::filesystem::path copy_example_into(const TempDir& dir, std::filesystem::perms mode) {
  const std::filesystem::path copy = dir.path() / "libsp_example_minimal_c.so";
  std::filesystem::copy_file(SP_EXAMPLE_MINIMAL_C, copy);
  std::filesystem::permissions(copy, mode);
  return copy;
}

constexpr auto kOwnerOnly = std::filesystem::perms::owner_all;
constexpr auto kReadableByAll = std::filesystem::perms::owner_all | std::filesystem::perms::group_read |
                                std::filesystem::perms::group_exec | std::filesystem::perms::others_read |
                                std::filesystem::perms::others_exec;

TEST(PluginLibrary, LoadsTheMinimalExampleFromAPrivateCopyThatLeavesNothingOnDisk) {
  PluginLibrary library = PluginLibrary::load(SP_EXAMPLE_MINIMAL_C);
  EXPECT_EQ(library.plugin_name(), "minimal_c");
  EXPECT_EQ(library.plugin_version(), "1.0.0");
  EXPECT_EQ(library.source_path(), SP_EXAMPLE_MINIMAL_C);
  EXPECT_NE(library.loaded_path(), library.source_path());
  EXPECT_EQ(library.loaded_path().filename(), library.source_path().filename());
  EXPECT_GT(testing::mapped_regions_containing(library.loaded_path().string()), 0u);
  // A process killed now must not leave a copy in TMPDIR (each one is megabytes).
  EXPECT_FALSE(std::filesystem::exists(library.loaded_path()));
  EXPECT_FALSE(std::filesystem::exists(library.loaded_path().parent_path()));
}

TEST(PluginLibrary, RefusesAnAbiMajorOtherThanTheHosts) {
  EXPECT_THAT(load_error(SP_FIXTURE_BAD_ABI_MAJOR),
              AllOf(HasSubstr(SP_FIXTURE_BAD_ABI_MAJOR), HasSubstr("built for plugin ABI 2.0"),
                    HasSubstr("this host implements ABI 1.4"), HasSubstr("major versions must be equal")));
}

TEST(PluginLibrary, RefusesAPluginBuiltForANewerMinor) {
  EXPECT_THAT(load_error(SP_FIXTURE_NEWER_ABI_MINOR),
              AllOf(HasSubstr(SP_FIXTURE_NEWER_ABI_MINOR), HasSubstr("built for plugin ABI 1.5"),
                    HasSubstr("host's ABI 1.4"), HasSubstr("minor version must be >= the plugin's")));
}

TEST(PluginLibrary, RefusesALibraryWithoutTheEntrySymbol) {
  EXPECT_THAT(
      load_error(SP_FIXTURE_MISSING_ENTRY),
      AllOf(HasSubstr(SP_FIXTURE_MISSING_ENTRY), HasSubstr("does not export the entry symbol sp_policy_plugin_v1")));
}

TEST(PluginLibrary, RefusesATableSmallerThanItsAbiVersionNeeds) {
  EXPECT_THAT(load_error(SP_FIXTURE_SMALL_TABLE),
              AllOf(HasSubstr(SP_FIXTURE_SMALL_TABLE),
                    HasSubstr("struct_size = " + std::to_string(offsetof(sp_policy_plugin_v1_table, last_error))),
                    HasSubstr("ABI 1.0 needs at least " + std::to_string(SP_PLUGIN_TABLE_V1_0_SIZE) + " bytes"),
                    HasSubstr("every field up to last_error")));
}

TEST(PluginLibrary, RefusesANullFunctionPointer) {
  EXPECT_THAT(load_error(SP_FIXTURE_NULL_HOOK),
              AllOf(HasSubstr(SP_FIXTURE_NULL_HOOK), HasSubstr("field end_step of its function table is NULL")));
}

TEST(PluginLibrary, RefusesAMissingFile) {
  EXPECT_THAT(load_error("/nonexistent/libsp_nothing.so"),
              AllOf(HasSubstr("/nonexistent/libsp_nothing.so"), HasSubstr("No such file")));
}

TEST(PluginLibrary, AnEmptyPathIsReportedAsUnset) {
  EXPECT_THAT(load_error(""), HasSubstr("its file is unset (an empty path"));
}

TEST(PluginLibrary, RefusesAFifoWithoutWaitingOnIt) {
  TempDir dir;
  const std::filesystem::path fifo = dir.path() / "libsp_fifo.so";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THAT(load_error(fifo), AllOf(HasSubstr(fifo.string()), HasSubstr("it is not a regular file")));
}

TEST(PluginLibrary, RefusesAFileThatIsNotASharedLibrary) {
  TempDir dir;
  const std::filesystem::path file = dir.path() / "libsp_text.so";
  { std::ofstream(file) << "not an ELF file\n"; }
  std::filesystem::permissions(file, kOwnerOnly);
  EXPECT_THAT(load_error(file), AllOf(HasSubstr(file.string()), HasSubstr("not an ELF shared object")));
}

// A plugin cut short (still being copied into the plugin directory, say) would have its
// missing pages mapped by the loader and kill the host with SIGBUS on first touch; the load
// must fail instead, at every cut point, and leave no private copy behind.
TEST(PluginLibrary, RefusesATruncatedPluginWithoutMappingIt) {
  TempDir dir;
  const std::filesystem::path whole = copy_example_into(dir, kOwnerOnly);
  std::string bytes;
  {
    std::ifstream in(whole, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  // Private copies go under TMPDIR: point it at an empty directory of this test's own.
  const std::filesystem::path copies = dir.path() / "copies";
  std::filesystem::create_directory(copies);
  const char* saved_tmpdir = std::getenv("TMPDIR");
  const std::string restore = saved_tmpdir != nullptr ? saved_tmpdir : "";
  ::setenv("TMPDIR", copies.c_str(), 1);
  for (const double kept : {0.02, 0.25, 0.5, 0.75, 0.99}) {
    const auto cut = static_cast<std::size_t>(static_cast<double>(bytes.size()) * kept);
    const std::filesystem::path file = dir.path() / ("libsp_cut_" + std::to_string(cut) + ".so");
    {
      std::ofstream out(file, std::ios::binary);
      out.write(bytes.data(), static_cast<std::streamsize>(cut));
    }
    std::filesystem::permissions(file, kOwnerOnly);
    SCOPED_TRACE(file.string());
    EXPECT_THAT(load_error(file), AllOf(HasSubstr(file.string()), HasSubstr("truncated or corrupt"),
                                        HasSubstr("the file has " + std::to_string(cut) + " bytes")));
  }
  saved_tmpdir != nullptr ? ::setenv("TMPDIR", restore.c_str(), 1) : ::unsetenv("TMPDIR");
  EXPECT_TRUE(std::filesystem::is_empty(copies));
}

// A segment with no file bytes maps nothing from the file, so where its offset points does
// not matter (a plugin stripped of its section headers can have such an offset past its end).
TEST(PluginLibrary, ASegmentWithoutFileBytesMayPointPastTheEnd) {
  TempDir dir;
  const std::filesystem::path plugin = copy_example_into(dir, kOwnerOnly);
  std::fstream image(plugin, std::ios::in | std::ios::out | std::ios::binary);
  ElfW(Ehdr) header{};
  image.read(reinterpret_cast<char*>(&header), sizeof header);
  bool moved = false;
  for (std::uint16_t i = 0; i < header.e_phnum && !moved; ++i) {
    const auto at = static_cast<std::streamoff>(header.e_phoff + i * sizeof(ElfW(Phdr)));
    ElfW(Phdr) segment{};
    image.seekg(at);
    image.read(reinterpret_cast<char*>(&segment), sizeof segment);
    if (segment.p_type != PT_GNU_STACK || segment.p_filesz != 0) continue;
    segment.p_offset = std::uint64_t{1} << 40;
    image.seekp(at);
    image.write(reinterpret_cast<const char*>(&segment), sizeof segment);
    moved = true;
  }
  image.close();
  ASSERT_TRUE(moved) << "the example plugin has no PT_GNU_STACK header";
  EXPECT_EQ(PluginLibrary::load(plugin).plugin_name(), "minimal_c");
}

TEST(PluginTrust, RefusesAWorldWritableDirectory) {
  TempDir dir;
  const std::filesystem::path plugin = copy_example_into(dir, kOwnerOnly);
  std::filesystem::permissions(dir.path(), std::filesystem::perms::all);
  EXPECT_THAT(load_error(plugin), AllOf(HasSubstr(dir.path().string()), HasSubstr("is world-writable (mode 0777)")));
  std::filesystem::permissions(dir.path(), kReadableByAll);
  EXPECT_NO_THROW(PluginLibrary::load(plugin));
}

TEST(PluginTrust, RefusesADirectoryUnderAWorldWritableOneUnlessItIsSticky) {
  TempDir dir;
  const std::filesystem::path plugins = dir.path() / "open" / "plugins";
  std::filesystem::create_directories(plugins);
  const std::filesystem::path plugin = plugins / "libsp_example_minimal_c.so";
  std::filesystem::copy_file(SP_EXAMPLE_MINIMAL_C, plugin);
  std::filesystem::permissions(plugin, kOwnerOnly);
  std::filesystem::permissions(plugins, kOwnerOnly);
  std::filesystem::permissions(dir.path() / "open", std::filesystem::perms::all);
  EXPECT_THAT(load_error(plugin), AllOf(HasSubstr((dir.path() / "open").string() + "\" above it is world-writable"),
                                        HasSubstr("mode 0777")));
  // /tmp's mode: others may add entries but not rename this one.
  std::filesystem::permissions(dir.path() / "open", std::filesystem::perms::all | std::filesystem::perms::sticky_bit);
  EXPECT_NO_THROW(PluginLibrary::load(plugin));
}

TEST(PluginTrust, RefusesAGroupWritableFile) {
  TempDir dir;
  const std::filesystem::path plugin =
      copy_example_into(dir, kOwnerOnly | std::filesystem::perms::group_read | std::filesystem::perms::group_write);
  EXPECT_THAT(load_error(plugin), AllOf(HasSubstr(plugin.string()), HasSubstr("writable by its group (mode 0760)")));
}

TEST(PluginTrust, RefusesAWorldWritableFile) {
  TempDir dir;
  const std::filesystem::path plugin = copy_example_into(dir, kOwnerOnly | std::filesystem::perms::others_write);
  EXPECT_THAT(load_error(plugin), AllOf(HasSubstr(plugin.string()), HasSubstr("writable by others (mode 0702)")));
  EXPECT_THROW(check_plugin_file_is_trusted(plugin), PluginError);
}

TEST(PluginTrust, RefusesAFileOwnedByAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "changing a file's owner needs root";
  TempDir dir;
  const std::filesystem::path plugin = copy_example_into(dir, kOwnerOnly);
  constexpr uid_t kNobody = 65534;
  ASSERT_EQ(::chown(plugin.c_str(), kNobody, kNobody), 0);
  EXPECT_THAT(load_error(plugin), AllOf(HasSubstr(plugin.string()), HasSubstr("owned by uid 65534")));
}

TEST(PluginTrust, AcceptsTheBuiltPlugins) {
  EXPECT_NO_THROW(check_plugin_file_is_trusted(SP_EXAMPLE_MINIMAL_C));
  EXPECT_NO_THROW(check_plugin_file_is_trusted(SP_FIXTURE_SCRIPTED));
}

TEST(PluginLibrary, SameFileLoadedTwiceGivesTwoIndependentLibraries) {
  PluginLibrary first = PluginLibrary::load(SP_EXAMPLE_MINIMAL_C);
  PluginLibrary second = PluginLibrary::load(SP_EXAMPLE_MINIMAL_C);
  EXPECT_NE(first.loaded_path(), second.loaded_path());
  EXPECT_NE(&first.table(), &second.table()) << "dlopen returned the same handle for both loads";
  EXPECT_NE(first.table().create, second.table().create);
}

TEST(PluginLibrary, UnloadRemovesTheLibraryAndItsPrivateCopy) {
  PluginLibrary library = PluginLibrary::load(SP_EXAMPLE_MINIMAL_C);
  const std::filesystem::path loaded = library.loaded_path();
  const UnloadReport report = library.unload();
  EXPECT_TRUE(report.unloaded) << report.detail;
  EXPECT_FALSE(library.is_loaded());
  EXPECT_EQ(testing::mapped_regions_containing(loaded.string()), 0u);
  EXPECT_FALSE(std::filesystem::exists(loaded));
  EXPECT_FALSE(std::filesystem::exists(loaded.parent_path()));
}

TEST(PluginLibrary, UnloadReportsALibraryThatStaysLoaded) {
  PluginLibrary library = PluginLibrary::load(SP_EXAMPLE_MINIMAL_C);
  // A second reference keeps the library mapped, as a GNU-unique symbol would.
  void* extra_reference = ::dlopen(library.loaded_path().c_str(), RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(extra_reference, nullptr);
  const UnloadReport report = library.unload();
  EXPECT_FALSE(report.unloaded);
  EXPECT_THAT(report.detail, AllOf(HasSubstr(SP_EXAMPLE_MINIMAL_C), HasSubstr("still mapped after dlclose")));
  ::dlclose(extra_reference);
}

}  // namespace
}  // namespace sp::host
