// The extension _selective_precision: the binding's parts (binding.h says which).
#include <pybind11/pybind11.h>

#include "binding.h"
#include "sp/precision.h"

namespace py = pybind11;

PYBIND11_MODULE(_selective_precision, m) {
  m.doc() = "Selective Precision: stream the blocks of a PyTorch model through a precision policy plugin.";
  sp::binding::bind_reports(m);
  sp::binding::bind_model(m);
  sp::binding::bind_kernels(m);
  // The route names from the route table, most precise first, so that Python lists none itself.
  py::list routes, quantized;
  for (const sp::Precision precision : sp::kPrecisions) {
    routes.append(sp::precision_name(precision));
    if (sp::is_quantized(precision)) quantized.append(sp::precision_name(precision));
  }
  m.attr("_ROUTES") = py::tuple(routes);
  m.attr("_QUANTIZED_ROUTES") = py::tuple(quantized);
}
