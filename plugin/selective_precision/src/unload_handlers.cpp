// The static destructors of the libraries compiled into the plugin (yaml-cpp's iostreams
// initializers and the function-local regular expressions of its scanner) run when the plugin
// is unloaded, instead of being registered with the process.
//
// Why: glibc keeps the process's exit handlers in blocks of 32 and reuses a slot that dlclose()
// freed only while every slot above it is free too. In a hot swap the new plugin registers its
// handlers while the old one is still loaded, so the old one's slots are freed below live ones
// and never reused: the host's heap grew by about 1.3 KB per swap
// (SelectivePrecisionHotSwap.TwoHundredCyclesHoldNoExtraFilesMappingsOrMemory, 259 KB over 200
// swaps). yaml-cpp is compiled with -fno-use-cxa-atexit (cmake/SpDependencies.cmake), so its
// destructors are registered through atexit(); inside the plugin that name binds to the hidden
// definition below, and the plugin's own destructor runs them, last registered first, when it
// is unloaded (or at exit, if it is still loaded then). The plugin's own code registers
// nothing (docs/plugin-abi.md, "Rules that make unloading real").
#include <atomic>
#include <cstddef>
#include <cstdlib>

namespace {

using UnloadHandler = void (*)();

// Constant-initialised, so that nothing here is itself registered for destruction. yaml-cpp
// registers one handler per translation unit that includes <iostream> and one per regular
// expression its scanner has used, fewer than a hundred in all.
constexpr std::size_t kCapacity = 512;
UnloadHandler handlers[kCapacity] = {};
std::atomic<std::size_t> registered{0};

// Last registered first, one at a time, so that a handler a destructor registers (its first use
// of another static) runs too; a slot claimed but not yet written holds null and is skipped.
__attribute__((destructor)) void run_unload_handlers() {
  for (;;) {
    std::size_t count = registered.load();
    if (count > kCapacity) {
      count = kCapacity;
    }
    if (count == 0) {
      return;
    }
    const UnloadHandler handler = handlers[count - 1];
    handlers[count - 1] = nullptr;
    registered.store(count - 1);
    if (handler != nullptr) {
      handler();
    }
  }
}

}  // namespace

// A handler past the capacity is refused, as the C standard allows (at least 32 must be taken):
// its object is then never destroyed, which leaks, but runs no code after the unload.
extern "C" __attribute__((visibility("hidden"))) int atexit(void (*handler)()) noexcept {
  const std::size_t slot = registered.fetch_add(1);
  if (slot >= kCapacity) {
    return -1;
  }
  handlers[slot] = handler;
  return 0;
}
