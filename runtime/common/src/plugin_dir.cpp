#include "sp/runtime/plugin_dir.h"

#include <system_error>

namespace sp::runtime {
namespace fs = std::filesystem;

fs::path default_plugin_dir() {
  std::error_code error;
  const fs::path exe = fs::read_symlink("/proc/self/exe", error);
  if (error) return "build/plugins";
  const fs::path prefix = exe.parent_path().parent_path();
  const fs::path installed = prefix / "lib" / "selective_precision" / "plugins";
  return fs::is_directory(installed, error) ? installed : prefix / "plugins";
}

}  // namespace sp::runtime
