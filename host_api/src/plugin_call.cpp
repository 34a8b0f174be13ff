#include "sp/host/plugin_call.h"

#include <atomic>
#include <cstdint>
#include <cstring>

#include "plugin_call_scope.h"

namespace sp::host {
namespace {

// The label is written only by the scope that took g_held, before the call is published with
// release order; a handler reads the call first, with acquire order.
constexpr std::size_t kLabelCapacity = 192;
char g_label[kLabelCapacity];
std::atomic<bool> g_held{false};
std::atomic<const char*> g_call{nullptr};
std::atomic<std::int64_t> g_step{detail::PluginCallScope::kNoStep};

// Appends `text` to out[*length..capacity - 1), keeping room for the NUL.
void append(char* out, std::size_t capacity, std::size_t* length, const char* text) noexcept {
  while (*text != '\0' && *length + 1 < capacity) out[(*length)++] = *text++;
}

void append_integer(char* out, std::size_t capacity, std::size_t* length, std::int64_t value) noexcept {
  char digits[24];
  std::size_t n = 0;
  // Through the unsigned magnitude, so that INT64_MIN does not overflow.
  std::uint64_t magnitude = value < 0 ? 0 - static_cast<std::uint64_t>(value) : static_cast<std::uint64_t>(value);
  do {
    digits[n++] = static_cast<char>('0' + magnitude % 10);
    magnitude /= 10;
  } while (magnitude != 0);
  if (value < 0) digits[n++] = '-';
  char reversed[24];
  for (std::size_t i = 0; i < n; ++i) reversed[i] = digits[n - 1 - i];
  reversed[n] = '\0';
  append(out, capacity, length, reversed);
}

}  // namespace

std::size_t describe_plugin_call(char* out, std::size_t capacity) noexcept {
  if (out == nullptr || capacity == 0) return 0;
  std::size_t length = 0;
  const char* call = g_call.load(std::memory_order_acquire);
  if (call != nullptr) {
    const std::int64_t step = g_step.load(std::memory_order_relaxed);
    append(out, capacity, &length, g_label);
    append(out, capacity, &length, " in ");
    append(out, capacity, &length, call);
    if (step != detail::PluginCallScope::kNoStep) {
      append(out, capacity, &length, " at step ");
      append_integer(out, capacity, &length, step);
    }
  }
  out[length] = '\0';
  return length;
}

namespace detail {

PluginCallScope::PluginCallScope(std::string_view label, const char* call, std::int64_t step) noexcept
    : holds_record_(!g_held.exchange(true, std::memory_order_acquire)) {
  if (!holds_record_) return;
  const std::size_t n = label.size() < kLabelCapacity - 1 ? label.size() : kLabelCapacity - 1;
  std::memcpy(g_label, label.data(), n);
  g_label[n] = '\0';
  g_step.store(step, std::memory_order_relaxed);
  g_call.store(call, std::memory_order_release);
}

PluginCallScope::~PluginCallScope() {
  if (!holds_record_) return;
  g_call.store(nullptr, std::memory_order_release);
  g_held.store(false, std::memory_order_release);
}

}  // namespace detail
}  // namespace sp::host
