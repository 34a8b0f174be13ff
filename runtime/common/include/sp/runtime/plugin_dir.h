// Where the reference tools look for policy plugins when --plugin-dir is not given.
#pragma once

#include <filesystem>

namespace sp::runtime {

// Beside the running executable: <prefix>/lib/selective_precision/plugins for an installed
// tool (bin/sp-train), else <build>/plugins for one in a build tree (build/bin/sp-train).
// "build/plugins" when the executable's path cannot be read.
std::filesystem::path default_plugin_dir();

}  // namespace sp::runtime
