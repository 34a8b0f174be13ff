// Every plugin the build produces must be unloadable: no GNU-unique symbols (they make
// glibc mark the library NODELETE) and nothing exported but the versioned entry symbol.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "sp/runtime/run_command.h"

namespace {

struct Symbol {
  char type;
  std::string name;
};

// Defined symbols of `file` as nm reports them; `dynamic` selects the dynamic table.
std::vector<Symbol> defined_symbols(const std::filesystem::path& file, bool dynamic) {
  const std::string command =
      std::string("nm -C --defined-only ") + (dynamic ? "-D " : "") + "'" + file.string() + "' 2>&1";
  const sp::runtime::CommandResult nm = sp::runtime::run_command(command);
  EXPECT_EQ(nm.exit_code, 0) << command << " failed:\n" << nm.output;
  const std::string& output = nm.output;

  std::vector<Symbol> symbols;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line);
    std::string address;
    std::string type;
    std::string name;
    if (!(fields >> address >> type)) continue;
    std::getline(fields >> std::ws, name);
    symbols.push_back(Symbol{type.size() == 1 ? type[0] : '?', name});
  }
  return symbols;
}

std::vector<std::filesystem::path> shared_objects_in(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() == ".so") files.push_back(entry.path());
  }
  return files;
}

std::vector<std::filesystem::path> every_built_plugin() {
  std::vector<std::filesystem::path> plugins = shared_objects_in(SP_PLUGIN_OUTPUT_DIR);
  const std::vector<std::filesystem::path> fixtures = shared_objects_in(SP_FIXTURE_OUTPUT_DIR);
  plugins.insert(plugins.end(), fixtures.begin(), fixtures.end());
  return plugins;
}

TEST(PluginHygiene, TheScanFindsTheKnownPlugins) {
  const std::vector<std::filesystem::path> plugins = every_built_plugin();
  for (const char* expected :
       {SP_SELECTIVE_PRECISION_V1, SP_SELECTIVE_PRECISION_V2, SP_EXAMPLE_MINIMAL_C, SP_FIXTURE_SCRIPTED}) {
    EXPECT_THAT(plugins, ::testing::Contains(std::filesystem::path(expected)));
  }
}

TEST(PluginHygiene, NoPluginHasGnuUniqueSymbols) {
  for (const std::filesystem::path& plugin : every_built_plugin()) {
    const std::vector<Symbol> symbols = defined_symbols(plugin, false);
    EXPECT_FALSE(symbols.empty()) << plugin << ": nm listed no symbols";
    for (const Symbol& symbol : symbols) {
      EXPECT_NE(symbol.type, 'u') << plugin << " has the GNU-unique symbol " << symbol.name
                                  << "; build it with -fno-gnu-unique (sp_add_plugin does)";
    }
  }
}

TEST(PluginHygiene, EachPluginExportsOnlyItsEntrySymbol) {
  for (const std::filesystem::path& plugin : every_built_plugin()) {
    std::vector<std::string> exported;
    for (const Symbol& symbol : defined_symbols(plugin, true)) {
      // The linker's own markers (absolute symbols such as the version node) are no code.
      if (symbol.type != 'A') exported.push_back(symbol.name);
    }
    ASSERT_EQ(exported.size(), 1u) << plugin << " exports " << ::testing::PrintToString(exported);
    EXPECT_THAT(exported.front(), ::testing::StartsWith("sp_policy_plugin_v")) << plugin;
  }
}

}  // namespace
