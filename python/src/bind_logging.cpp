// The layer's messages into Python's logging (binding.h).
#include <cstdio>
#include <string>

#include <pybind11/pybind11.h>
#include <spdlog/details/null_mutex.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include "binding.h"

namespace py = pybind11;

namespace sp::binding {

namespace {

bool interpreter_finishing() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

// Each message to logging.getLogger("selective_precision") at its level. No lock of its own:
// the GIL orders the calls, and a lock taken before the GIL would deadlock with a thread that
// holds the GIL and logs. During the interpreter's shutdown a message goes to stderr.
class PythonLoggingSink final : public spdlog::sinks::base_sink<spdlog::details::null_mutex> {
 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    const std::string text(msg.payload.data(), msg.payload.size());
    if (interpreter_finishing()) {
      std::fprintf(stderr, "selective_precision: %s\n", text.c_str());
      return;
    }
    py::gil_scoped_acquire gil;
    try {
      py::module_::import("logging")
          .attr("getLogger")("selective_precision")
          .attr("log")(python_level(msg.level), "%s", text);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("selective_precision's log message");
    }
  }
  void flush_() override {}

 private:
  static int python_level(spdlog::level::level_enum level) {
    switch (level) {
      case spdlog::level::trace:
      case spdlog::level::debug:
        return 10;  // logging.DEBUG
      case spdlog::level::info:
        return 20;
      case spdlog::level::warn:
        return 30;
      case spdlog::level::err:
        return 40;
      default:
        return 50;  // logging.CRITICAL
    }
  }
};

}  // namespace

// Python's logging filters by level; debug messages are few (none per block or per step).
std::shared_ptr<spdlog::logger> python_logger() {
  auto logger = std::make_shared<spdlog::logger>("selective_precision", std::make_shared<PythonLoggingSink>());
  logger->set_level(spdlog::level::debug);
  return logger;
}

}  // namespace sp::binding
