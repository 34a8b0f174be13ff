// Which policy plugin call the process is in, readable from a fatal-signal handler.
//
// Plugins run in-process (docs/plugin-abi.md): one that writes through NULL or aborts takes its
// host down with it, and the host's own stack trace ends in code the host does not own. A host
// that records, in its handler for SIGSEGV, SIGABRT and the like, what this function reports
// lets its next start name the plugin and the hook that crashed it (sp-train's crash marker,
// docs/training.md). PolicyHost keeps the record for every call it makes into a plugin.
#pragma once

#include <cstddef>

namespace sp::host {

// Writes "<plugin label> in <call> at step <step>" ("<plugin label> in <call>" outside a step),
// NUL-terminated and cut to `capacity` bytes, when a PolicyHost of this process is inside a
// plugin call; writes "" otherwise. Returns the length written, without the NUL.
// Async-signal-safe: it reads atomics and a fixed buffer and formats by hand, so a handler may
// call it on any thread; a call being entered or left at that very moment may show either way.
std::size_t describe_plugin_call(char* out, std::size_t capacity) noexcept;

}  // namespace sp::host
