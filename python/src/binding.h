// The Python binding's parts, one job per file, which module.cpp puts together as the extension
// _selective_precision (selective_precision/__init__.py is the thin Python part on top):
// - bind_logging.cpp: the layer's messages into Python's logging;
// - bind_kernels.cpp: the transfer formats and the host optimizer, as the layer's kernels run them;
// - bind_model.cpp: the LibTorch layer (sp/torch_layer/streamed_model.h), unchanged, with Python
//   modules as its blocks, and its collectives over a torch.distributed group;
// - bind_reports.cpp: what the layer reports (StepReport, SwapResult as PluginSwap,
//   CalibrationErrors), bound once, read-only.
//
// The GIL: a block's parameters and forward are Python calls, made with the GIL held; autograd
// runs a block's backward (which recomputes its forward when asked to) with the GIL released, on its own
// thread or the caller's, so each call takes the GIL itself. The Python modules are held by
// pointers whose last release takes the GIL too. The layer's messages (its engines' and the
// plugin's too) go to Python's logging, which takes the GIL on whatever thread logs: so every
// call that can wait on another thread (the constructor, close, the destructor, and all that
// stream, swap or exchange) releases the GIL while it waits.
// Not installed.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <spdlog/logger.h>

#include "sp/precision.h"

namespace sp::binding {

// A logger whose every message goes to logging.getLogger("selective_precision") at its level.
std::shared_ptr<spdlog::logger> python_logger();

// Routes as Python names them: per block, each one's name; per policy unit, the names of its
// blocks' distinct routes joined by "/" ("int8/bf16"), one name where they agree.
std::vector<std::string> route_names(const std::vector<Precision>& routes);
std::vector<std::string> unit_route_texts(const std::vector<std::vector<Precision>>& units);

// The module's functions and classes of each part.
void bind_kernels(pybind11::module_& m);
void bind_model(pybind11::module_& m);
void bind_reports(pybind11::module_& m);

}  // namespace sp::binding
