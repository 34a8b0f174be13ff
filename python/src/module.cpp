// The extension _selective_precision: the binding's parts (binding.h says which).
#include <pybind11/pybind11.h>

#include "binding.h"

PYBIND11_MODULE(_selective_precision, m) {
  m.doc() = "Selective Precision: stream the blocks of a PyTorch model through a precision policy plugin.";
  sp::binding::bind_model(m);
  sp::binding::bind_kernels(m);
}
