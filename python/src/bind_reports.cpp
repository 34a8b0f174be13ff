// The reports of the LibTorch layer as Python reads them (binding.h): StepReport, SwapResult and
// CalibrationErrors bound once, and the routes' Python names.
#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "binding.h"
#include "sp/torch_layer/streamed_model.h"

namespace py = pybind11;
namespace tl = sp::torch_layer;

namespace sp::binding {
namespace {

// One route's name, or several joined by "/" (a policy unit whose blocks the transfer policy
// sent apart).
std::string route_text(const std::vector<sp::Precision>& routes) {
  std::string out;
  for (const sp::Precision p : routes) out += (out.empty() ? "" : "/") + std::string(sp::precision_name(p));
  return out;
}

}  // namespace

std::vector<std::string> route_names(const std::vector<sp::Precision>& routes) {
  std::vector<std::string> out;
  for (const sp::Precision p : routes) out.emplace_back(sp::precision_name(p));
  return out;
}

std::vector<std::string> unit_route_texts(const std::vector<std::vector<sp::Precision>>& units) {
  std::vector<std::string> out;
  for (const std::vector<sp::Precision>& unit : units) out.push_back(route_text(unit));
  return out;
}

void bind_reports(py::module_& m) {
  using Swap = sp::host::SwapResult;
  py::class_<Swap>(m, "PluginSwap",
                   "A hot swap of the policy plugin: `outcome` is \"swapped\", \"pending\" (it happens at the "
                   "next step boundary) or \"failed\" (the old plugin stays, `message` says why).")
      .def_property_readonly(
          "outcome",
          [](const Swap& swap) {
            return swap.outcome == Swap::Outcome::swapped   ? "swapped"
                   : swap.outcome == Swap::Outcome::pending ? "pending"
                                                            : "failed";
          },
          "\"swapped\", \"pending\" or \"failed\".")
      .def_readonly("message", &Swap::message, "Why a swap failed; empty otherwise.")
      .def_readonly("old_version", &Swap::old_version, "The version of the plugin swapped out.")
      .def_readonly("new_version", &Swap::new_version,
                    "The version of the plugin swapped in; empty when its file could not be loaded.")
      .def("__repr__", [](const Swap& swap) {
        return fmt::format("PluginSwap(outcome={}, old_version={}, new_version={}, message={})",
                           py::repr(py::cast(swap).attr("outcome")).cast<std::string>(),
                           py::repr(py::str(swap.old_version)).cast<std::string>(),
                           py::repr(py::str(swap.new_version)).cast<std::string>(),
                           py::repr(py::str(swap.message)).cast<std::string>());
      });

  auto errors = py::class_<tl::CalibrationErrors>(
      m, "CalibrationErrors",
      "Each block's output error (relative L2 against BF16) with its weights on each quantized route, block by "
      "block: `by_route[name]`, one entry per quantized route this build streams, and a property of each route's "
      "name.");
  const auto by_route = [](const tl::CalibrationErrors& e) {
    py::dict out;
    for (const sp::Precision p : sp::kPrecisions) {
      if (sp::is_quantized(p)) out[sp::precision_name(p)] = e[p];
    }
    return out;
  };
  errors.def_property_readonly("by_route", by_route, "{route: [error per block]}, per quantized route.")
      .def("__repr__", [by_route](const tl::CalibrationErrors& e) {
        return "CalibrationErrors(by_route=" + py::repr(by_route(e)).cast<std::string>() + ")";
      });
  for (const sp::Precision p : sp::kPrecisions) {
    if (sp::is_quantized(p)) {
      errors.def_property_readonly(
          sp::precision_name(p), [p](const tl::CalibrationErrors& e) { return e[p]; },
          py::doc(fmt::format("by_route[\"{}\"].", sp::precision_name(p)).c_str()));
    }
  }

  auto report = py::class_<tl::StepReport>(m, "StepReport", "What one training step moved and decided.");
  const auto bytes_by_route = [](const tl::StepReport& r) {
    py::dict out;
    for (const sp::Precision p : sp::kPrecisions) out[sp::precision_name(p)] = r.h2d_bytes[p];
    return out;
  };
  report.def_readonly("step", &tl::StepReport::step, "The step's number.")
      .def_property_readonly("h2d_bytes_by_route", bytes_by_route,
                             "Host-to-device bytes of the training passes per route, one entry per route this build "
                             "streams.")
      .def_property_readonly(
          "h2d_bytes", [](const tl::StepReport& r) { return r.h2d_bytes.total(); },
          "The training passes' host-to-device bytes, all routes together.")
      .def_readonly("h2d_bytes_all_bf16", &tl::StepReport::h2d_bytes_all_bf16,
                    "What the same fetches would have moved as BF16.")
      .def_property_readonly(
          "saved_fraction",
          [](const tl::StepReport& r) {
            return r.h2d_bytes_all_bf16 == 0
                       ? 0.0
                       : 1.0 - static_cast<double>(r.h2d_bytes.total()) / static_cast<double>(r.h2d_bytes_all_bf16);
          },
          "The share of the all-BF16 bytes this step did not move (0 when nothing moved).")
      .def_readonly("eval_h2d_bytes", &tl::StepReport::eval_h2d_bytes,
                    "Of the evaluation passes in the step (no grad, or no backward followed).")
      .def_readonly("training_passes", &tl::StepReport::training_passes, "The grad-mode forwards whose backward ran.")
      .def_readonly("prefetch_hits", &tl::StepReport::prefetch_hits,
                    "The training passes' fetches issued ahead of their block's call.")
      .def_readonly("prefetch_misses", &tl::StepReport::prefetch_misses,
                    "Those issued only at the block's call (prefetch_window=0).")
      .def_readonly("prefetch_unused", &tl::StepReport::prefetch_unused,
                    "Those issued ahead for a block the pass then called elsewhere: once per change of the order "
                    "the blocks are called in, which the prefetch follows.")
      .def_property_readonly(
          "routes", [](const tl::StepReport& r) { return unit_route_texts(r.unit_routes); },
          "Each policy unit's route for the next step (\"bf16\", \"int8\", \"nf4\"; its blocks' routes joined by "
          "\"/\" where they differ). Without units=, one per block.")
      .def_property_readonly(
          "block_routes", [](const tl::StepReport& r) { return route_names(r.routes); },
          "Each streamed module's route for the next step.")
      .def_readonly("swap", &tl::StepReport::swap, "A hot swap that took effect at this step's start, or None.")
      .def_readonly("calibration", &tl::StepReport::calibration,
                    "An online re-calibration's errors after this step (recalibrate_every), or None.")
      .def_readonly("calibration_seconds", &tl::StepReport::calibration_seconds,
                    "What the online re-calibration after this step took (0 without one).")
      .def_readonly("updates_skipped", &tl::StepReport::updates_skipped,
                    "Blocks whose overlapped update was skipped: their gradient held a non-finite element.")
      .def("__repr__", [](const tl::StepReport& r) {
        return fmt::format(
            "StepReport(step={}, h2d_bytes={}, h2d_bytes_all_bf16={}, eval_h2d_bytes={}, "
            "training_passes={}, routes={})",
            r.step, r.h2d_bytes.total(), r.h2d_bytes_all_bf16, r.eval_h2d_bytes, r.training_passes,
            py::repr(py::cast(unit_route_texts(r.unit_routes))).cast<std::string>());
      });
  for (const sp::Precision p : sp::kPrecisions) {
    report.def_property_readonly(("h2d_bytes_" + std::string(sp::precision_name(p))).c_str(),
                                 [p](const tl::StepReport& r) { return r.h2d_bytes[p]; },
                                 py::doc(fmt::format("h2d_bytes_by_route[\"{}\"].", sp::precision_name(p)).c_str()));
  }
}

}  // namespace sp::binding
