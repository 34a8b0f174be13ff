// A structural check of a plugin file before the dynamic loader maps it.
#pragma once

#include <filesystem>

namespace sp::host {

// Throws PluginError, naming `shown_as`, unless `file` is an ELF shared object of this
// process's class, byte order and machine whose headers and segments lie inside the file.
// Why: the loader maps segments past the end of a truncated file (a plugin still being copied
// into the plugin directory, say), and the first touch of such a page is a SIGBUS that kills
// the host instead of failing the load.
void check_elf_image(const std::filesystem::path& shown_as, const std::filesystem::path& file);

}  // namespace sp::host
