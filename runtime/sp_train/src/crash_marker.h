// The crash marker: what a run that died of a fatal signal was doing, left in its run directory
// for the next start to report. Policy plugins run in-process, so a plugin that writes through
// NULL or aborts kills sp-train; the marker names the plugin and the call it died in
// (sp/host/plugin_call.h), or says that it died outside any plugin call.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

namespace sp::train {

// The marker's file name in a run directory.
inline constexpr const char* kCrashMarkerFile = ".sp-train.crash";

// Installs handlers for SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT (on an alternate stack, so a
// stack overflow is caught too) that write `marker` and then let the signal end the process as
// it would have: the exit status is still the signal's. The handler only formats into fixed
// buffers and calls open, write and close. Call once per process; a second call moves the
// marker to the new path. Throws std::runtime_error naming the system call that failed.
void install_crash_marker(const std::filesystem::path& marker);

// The text of the marker a previous run left at `marker`, which is removed; nullopt when there
// is none. Throws std::runtime_error when it exists but cannot be read or removed.
std::optional<std::string> take_crash_marker(const std::filesystem::path& marker);

}  // namespace sp::train
