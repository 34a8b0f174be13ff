#include "crash_marker.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <system_error>

#include "sp/host/plugin_call.h"

namespace sp::train {
namespace {

constexpr int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};

// Set before the handlers are installed; the handler reads them only.
char g_marker_path[4096];
alignas(16) char g_alternate_stack[64 * 1024];

const char* signal_name(int signal) {
  switch (signal) {
    case SIGSEGV:
      return "SIGSEGV";
    case SIGBUS:
      return "SIGBUS";
    case SIGILL:
      return "SIGILL";
    case SIGFPE:
      return "SIGFPE";
    case SIGABRT:
      return "SIGABRT";
    default:
      return "a fatal signal";
  }
}

void append(char* out, std::size_t capacity, std::size_t* length, const char* text) {
  while (*text != '\0' && *length + 1 < capacity) out[(*length)++] = *text++;
}

// Async-signal-safe: fixed buffers, open/write/close, then the default action.
void on_fatal_signal(int signal) {
  const int saved_errno = errno;
  char text[1024];
  std::size_t length = 0;
  append(text, sizeof text, &length, "sp-train died of ");
  append(text, sizeof text, &length, signal_name(signal));
  char call[512];
  if (sp::host::describe_plugin_call(call, sizeof call) != 0) {
    append(text, sizeof text, &length, " inside policy plugin ");
    append(text, sizeof text, &length, call);
    append(text, sizeof text, &length, " (plugins run in-process: the crash is the plugin's)");
  } else {
    append(text, sizeof text, &length, " outside any policy plugin call");
  }
  append(text, sizeof text, &length, "\n");
  const int fd = ::open(g_marker_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd >= 0) {
    const char* cursor = text;
    std::size_t left = length;
    while (left > 0) {
      const ssize_t written = ::write(fd, cursor, left);
      if (written <= 0) break;
      cursor += written;
      left -= static_cast<std::size_t>(written);
    }
    ::close(fd);
  }
  errno = saved_errno;
  // SA_RESETHAND restored the default action: raised again, the signal ends the process as it
  // would have without the marker (a core dump where those are enabled).
  ::raise(signal);
}

}  // namespace

void install_crash_marker(const std::filesystem::path& marker) {
  const std::string path = marker.string();
  if (path.size() >= sizeof g_marker_path) {
    throw std::runtime_error("crash marker: path longer than " + std::to_string(sizeof g_marker_path - 1) +
                             " bytes: " + path);
  }
  std::memcpy(g_marker_path, path.c_str(), path.size() + 1);
  stack_t stack{};
  stack.ss_sp = g_alternate_stack;
  stack.ss_size = sizeof g_alternate_stack;
  if (::sigaltstack(&stack, nullptr) != 0) {
    throw std::system_error(errno, std::generic_category(), "crash marker: sigaltstack");
  }
  struct sigaction action {};
  action.sa_handler = on_fatal_signal;
  action.sa_flags = SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  for (int signal : kFatalSignals) {
    if (::sigaction(signal, &action, nullptr) != 0) {
      throw std::system_error(errno, std::generic_category(), std::string("crash marker: sigaction ") +
                                                                  signal_name(signal));
    }
  }
}

std::optional<std::string> take_crash_marker(const std::filesystem::path& marker) {
  std::error_code error;
  if (!std::filesystem::exists(marker, error)) {
    if (error) throw std::runtime_error("crash marker: cannot look at " + marker.string() + ": " + error.message());
    return std::nullopt;
  }
  std::ifstream in(marker, std::ios::binary);
  if (!in) throw std::runtime_error("crash marker: cannot read " + marker.string());
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  if (!std::filesystem::remove(marker, error) && error) {
    throw std::runtime_error("crash marker: cannot remove " + marker.string() + ": " + error.message());
  }
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  return text;
}

}  // namespace sp::train
