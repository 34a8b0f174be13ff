// The LibTorch layer (sp/torch_layer/streamed_model.h), unchanged, with Python modules as its
// blocks, and its collectives over a torch.distributed group (binding.h; the GIL there).
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/DynamicTypes.h>
#include <torch/extension.h>

#include <pybind11/chrono.h>
#include <pybind11/stl/filesystem.h>

#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "binding.h"
#include "sp/host/plugin_library.h"
#include "sp/torch_layer/collectives.h"
#include "sp/torch_layer/streamed_model.h"

namespace py = pybind11;
namespace tl = sp::torch_layer;

namespace sp::binding {

namespace {

// post_backward()'s moments as Python reads them: a dict per block.
py::list moments_list(const std::vector<sp_grad_moments_v1>& moments) {
  py::list out;
  for (const sp_grad_moments_v1& g : moments) {
    py::dict d;
    d["sum_sq"] = g.sum_sq;
    d["sum"] = g.sum;
    d["max_abs"] = g.max_abs;
    d["count"] = g.count;
    d["nonfinite"] = g.nonfinite;
    out.append(d);
  }
  return out;
}

std::shared_ptr<py::object> hold(py::object object) {
  return std::shared_ptr<py::object>(new py::object(std::move(object)), [](py::object* o) {
    py::gil_scoped_acquire gil;
    delete o;
  });
}

tl::Block python_block(py::object module, std::vector<std::string> streamed, std::vector<std::string> moments_from,
                       std::string name) {
  if (!py::hasattr(module, "named_parameters") || !PyCallable_Check(module.ptr())) {
    throw std::invalid_argument(
        fmt::format("block '{}' is not a torch.nn.Module: it has no named_parameters() or is "
                    "not callable",
                    name));
  }
  const std::shared_ptr<py::object> held = hold(std::move(module));
  return tl::Block{std::move(name),
                   [held] {
                     py::gil_scoped_acquire gil;
                     tl::NamedParameters out;
                     for (py::handle item : held->attr("named_parameters")()) {
                       const py::tuple pair = item.cast<py::tuple>();
                       out.emplace_back(pair[0].cast<std::string>(), pair[1].cast<torch::Tensor>());
                     }
                     return out;
                   },
                   [held](const torch::Tensor& x) {
                     py::gil_scoped_acquire gil;
                     py::object y = (*held)(x);
                     if (!THPVariable_Check(y.ptr())) {
                       throw std::invalid_argument("a streamed block's forward must return one tensor");
                     }
                     return y.cast<torch::Tensor>();
                   },
                   std::move(streamed), std::move(moments_from)};
}

// A Python callable (inputs: list of tensors, weights: dict of name to tensor) -> list of
// tensors, as the layer calls a block (Block::call). Held so that its last release takes the GIL.
tl::BlockCall python_call(py::object callable) {
  const std::shared_ptr<py::object> held = hold(std::move(callable));
  return [held](const std::vector<torch::Tensor>& inputs, const tl::NamedParameters& weights) {
    py::gil_scoped_acquire gil;
    py::dict named;
    for (const auto& [name, weight] : weights) named[py::str(name)] = weight;
    return (*held)(inputs, named).cast<std::vector<torch::Tensor>>();
  };
}

sp::Precision precision_of(const std::string& name) {
  if (const std::optional<sp::Precision> precision = sp::precision_named(name)) return *precision;
  throw std::invalid_argument(fmt::format("precision '{}': expected {}", name, sp::quoted_route_names()));
}

py::dict interval_dict(const tl::PairedInterval& i) {
  py::dict d;
  d["n"] = i.n;
  d["mean"] = i.mean;
  d["std_error"] = i.std_error;
  d["low"] = i.low;
  d["high"] = i.high;
  return d;
}

// The layer's collectives, remembering the first one that failed: autograd hands Python a
// failure inside loss.backward() as a plain RuntimeError, so the binding tells the package
// which errors were a collective's (StreamedBlocks.step() raises them as CollectiveError).
class RecordingCollectives final : public tl::Collectives, public std::enable_shared_from_this<RecordingCollectives> {
 public:
  explicit RecordingCollectives(std::shared_ptr<tl::Collectives> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::unique_ptr<Pending> all_reduce(torch::Tensor tensor, tl::Reduction op, std::string what) override {
    return recorded([&] { return inner_->all_reduce(std::move(tensor), op, std::move(what)); });
  }
  std::unique_ptr<Pending> reduce(torch::Tensor tensor, int root, tl::Reduction op, std::string what) override {
    return recorded([&] { return inner_->reduce(std::move(tensor), root, op, std::move(what)); });
  }
  void broadcast(torch::Tensor tensor, int root, std::string what) override {
    recorded([&] { inner_->broadcast(std::move(tensor), root, std::move(what)); });
  }
  std::vector<std::string> exchange(const std::string& key, const std::string& mine,
                                    std::chrono::milliseconds timeout) override {
    return recorded([&] { return inner_->exchange(key, mine, timeout); });
  }
  bool reduces_on(const torch::Device& device) const override { return inner_->reduces_on(device); }
  // The first failure since the last call, and forgets it; empty: none.
  std::string take_failure() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(failure_, {});
  }

 private:
  class RecordedPending final : public Pending {
   public:
    RecordedPending(std::unique_ptr<Pending> inner, std::shared_ptr<RecordingCollectives> owner)
        : inner_(std::move(inner)), owner_(std::move(owner)) {}
    void wait() override {
      owner_->recorded([&] { inner_->wait(); });
    }

   private:
    std::unique_ptr<Pending> inner_;
    std::shared_ptr<RecordingCollectives> owner_;  // the record outlives what waits on it
  };

  template <typename Call>
  auto recorded(Call&& call) -> decltype(call()) {
    try {
      if constexpr (std::is_same_v<decltype(call()), std::unique_ptr<Pending>>) {
        return std::make_unique<RecordedPending>(call(), shared_from_this());
      } else {
        return call();
      }
    } catch (const tl::CollectiveError& e) {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (failure_.empty()) failure_ = e.what();
      throw;
    }
  }

  std::shared_ptr<tl::Collectives> inner_;
  std::mutex mutex_;
  std::string failure_;
};

// torch.distributed's group object, as the C++ group it wraps: pybind11 shares torch's
// registration of the class (torch/csrc/distributed/c10d/init.cpp) with this module.
std::shared_ptr<RecordingCollectives> collectives_of(const py::object& process_group) {
  if (process_group.is_none()) return nullptr;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    group = process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  } catch (const py::cast_error&) {
    throw py::type_error(fmt::format(
        "process_group: expected a torch.distributed process group (e.g. torch.distributed.group.WORLD after "
        "torch.distributed.init_process_group(\"gloo\")), got {}",
        py::str(py::type::of(process_group)).cast<std::string>()));
  }
  if (!group) throw py::type_error("process_group: the process group is None");
  return std::make_shared<RecordingCollectives>(tl::over_process_group(std::move(group)));
}

// The layer behind a close(): every call after it is refused by name, not made on freed state.
class PyStreamedModel {
 public:
  // Per module: its streamed parameters' and moments' names, and its block's name (empty: none
  // given, "block<i>"). `calls`: None, or per module the callable it computes through
  // (python_call): its streamed parameters are then the masters (Block::call).
  PyStreamedModel(const py::list& modules, const std::vector<std::vector<std::string>>& streamed,
                  const std::vector<std::vector<std::string>>& moments_from, const std::vector<std::string>& names,
                  const py::object& calls, tl::StreamedModelOptions options,
                  std::shared_ptr<RecordingCollectives> collectives)
      : collectives_(collectives) {
    if (modules.empty()) throw std::invalid_argument("StreamedModel: the module list is empty");
    if (streamed.size() != modules.size() || moments_from.size() != modules.size() ||
        (!names.empty() && names.size() != modules.size())) {
      throw std::invalid_argument("StreamedModel: streamed, moments_from and names: one entry per module expected");
    }
    if (!calls.is_none() && py::len(calls) != modules.size()) {
      throw std::invalid_argument("StreamedModel: one call per module expected");
    }
    std::vector<tl::Block> blocks;
    for (std::size_t b = 0; b < modules.size(); ++b) {
      blocks.push_back(
          python_block(modules[b], streamed[b], moments_from[b], names.empty() ? fmt::format("block{}", b) : names[b]));
      if (!calls.is_none()) blocks.back().call = python_call(calls[py::int_(b)]);
    }
    options.collectives = std::move(collectives);
    options.logger = python_logger();
    py::gil_scoped_release no_gil;
    model_ = std::make_unique<tl::StreamedModel>(std::move(blocks), std::move(options));
  }
  ~PyStreamedModel() { close(); }
  PyStreamedModel(const PyStreamedModel&) = delete;
  PyStreamedModel& operator=(const PyStreamedModel&) = delete;

  tl::StreamedModel& model() {
    if (!model_) throw std::runtime_error("StreamedModel is closed");
    return *model_;
  }
  void close() {
    py::gil_scoped_release no_gil;  // the engines' threads may log while they stop
    model_.reset();
  }
  bool closed() const { return !model_; }
  std::optional<std::string> take_collective_failure() {
    std::string failure = collectives_ ? collectives_->take_failure() : std::string();
    return failure.empty() ? std::nullopt : std::optional<std::string>(std::move(failure));
  }

 private:
  std::shared_ptr<RecordingCollectives> collectives_;  // null: one process
  std::unique_ptr<tl::StreamedModel> model_;
};

}  // namespace

void bind_model(py::module_& m) {
  py::register_exception<sp::host::PluginError>(m, "PluginError", PyExc_RuntimeError);
  py::register_exception<tl::StateEntryError>(m, "StateEntryError", PyExc_ValueError);
  py::register_exception<tl::CollectiveError>(m, "CollectiveError", PyExc_RuntimeError);
  py::register_exception<tl::RankMismatchError>(m, "RankMismatchError", PyExc_RuntimeError);

  // The calls that stream, compute or wait on other ranks run without the GIL, so that the
  // script's other threads (a DataLoader's pin-memory thread) go on meanwhile; the blocks'
  // Python forwards take it back (python_block). Their results become Python objects after.
  const py::call_guard<py::gil_scoped_release> no_gil;
  m.def(
      "_paired_interval",
      [](const std::vector<double>& values, double confidence) {
        return interval_dict(tl::paired_interval(values, confidence));
      },
      py::arg("values"), py::arg("confidence"));
  // The layer's options as the C++ API has them, one field each: sp.StreamOptions maps onto them
  // once (_stream.py). The collectives and the logger are the binding's (the process group given
  // to _StreamedModel, and Python's logging).
  // The C++ enum itself, so the phase crosses the binding as the layer's value, not a string.
  py::enum_<tl::StreamedModel::StepPhase>(m, "_StepPhase")
      .value("between_steps", tl::StreamedModel::StepPhase::between_steps)
      .value("open", tl::StreamedModel::StepPhase::open)
      .value("after_backward", tl::StreamedModel::StepPhase::after_backward);

  py::class_<tl::PolicyUnit>(m, "_PolicyUnit")
      .def(py::init([](std::string name, std::uint32_t blocks) {
             return tl::PolicyUnit{std::move(name), blocks};
           }),
           py::arg("name"), py::arg("blocks"))
      .def_readwrite("name", &tl::PolicyUnit::name)
      .def_readwrite("blocks", &tl::PolicyUnit::blocks);
  py::class_<tl::StreamedModelOptions>(m, "_StreamedModelOptions")
      .def(py::init([] {
        tl::StreamedModelOptions o;
        o.host_name = "selective_precision (Python)";
        return o;
      }))
      .def_readwrite("plugin_file", &tl::StreamedModelOptions::plugin_file)
      .def_readwrite("config_yaml", &tl::StreamedModelOptions::config_yaml)
      .def_readwrite("config_source", &tl::StreamedModelOptions::config_source)
      .def_readwrite("output_dir", &tl::StreamedModelOptions::output_dir)
      .def_readwrite("host_name", &tl::StreamedModelOptions::host_name)
      .def_readwrite("plugin_hook_deadline", &tl::StreamedModelOptions::plugin_hook_deadline)
      .def_readwrite("device", &tl::StreamedModelOptions::device)
      .def_property(
          "compute_dtype",
          [](const tl::StreamedModelOptions& o) {
            return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(o.compute_dtype)));
          },
          [](tl::StreamedModelOptions& o, const py::object& dtype) {
            if (!THPDtype_Check(dtype.ptr())) {
              throw py::type_error(fmt::format("compute_dtype: a torch.dtype expected, got {}",
                                               py::str(py::type::of(dtype)).cast<std::string>()));
            }
            o.compute_dtype = torch::python::detail::py_object_to_dtype(dtype);
          })
      .def_readwrite("host_bandwidth_cap_gbps", &tl::StreamedModelOptions::host_bandwidth_cap_gbps)
      .def_readwrite("prefetch_window", &tl::StreamedModelOptions::prefetch_window)
      .def_readwrite("spare_slabs", &tl::StreamedModelOptions::spare_slabs)
      .def_readwrite("int8_group_size", &tl::StreamedModelOptions::int8_group_size)
      .def_readwrite("nf4_group_size", &tl::StreamedModelOptions::nf4_group_size)
      .def_readwrite("metrics_path", &tl::StreamedModelOptions::metrics_path)
      .def_readwrite("transfer_policy", &tl::StreamedModelOptions::transfer_policy)
      .def_readwrite("shard_masters", &tl::StreamedModelOptions::shard_masters)
      .def_readwrite("recompute", &tl::StreamedModelOptions::recompute)
      .def_readwrite("recalibrate_every", &tl::StreamedModelOptions::recalibrate_every)
      .def_readwrite("units", &tl::StreamedModelOptions::units);
  py::class_<PyStreamedModel>(m, "_StreamedModel")
      .def(
          py::init([](const py::list& modules, const std::vector<std::vector<std::string>>& streamed,
                      const std::vector<std::vector<std::string>>& moments_from, tl::StreamedModelOptions options,
                      const py::object& process_group, const py::object& calls, const std::vector<std::string>& names) {
            return std::make_unique<PyStreamedModel>(modules, streamed, moments_from, names, calls, std::move(options),
                                                     collectives_of(process_group));
          }),
          py::arg("modules"), py::arg("streamed"), py::arg("moments_from"), py::arg("options"),
          py::arg("process_group") = py::none(), py::arg("calls") = py::none(),
          py::arg("names") = std::vector<std::string>())
      .def("close", &PyStreamedModel::close)
      .def_property_readonly("closed", &PyStreamedModel::closed)
      .def("num_blocks", [](PyStreamedModel& s) { return s.model().num_blocks(); })
      .def("num_units", [](PyStreamedModel& s) { return s.model().num_units(); })
      .def("unit_of", [](PyStreamedModel& s, std::uint32_t block) { return s.model().unit_of(block); })
      .def(
          "forward", [](PyStreamedModel& s, const torch::Tensor& x) { return s.model().forward(x); }, no_gil)
      .def(
          "forward_block",
          [](PyStreamedModel& s, std::uint32_t block, const std::vector<torch::Tensor>& inputs, py::object call) {
            tl::BlockCall bound = call.is_none() ? tl::BlockCall() : python_call(std::move(call));
            py::gil_scoped_release no_gil_here;
            return s.model().forward_block(block, inputs, std::move(bound));
          },
          py::arg("block"), py::arg("inputs"), py::arg("call") = py::none())
      .def("opens_training_pass",
           [](PyStreamedModel& s, std::uint32_t block) { return s.model().opens_training_pass(block); })
      .def("next_step", [](PyStreamedModel& s) { return s.model().next_step(); })
      .def("master_parameters", [](PyStreamedModel& s) { return s.model().master_parameters(); })
      .def("masters", [](PyStreamedModel& s, std::uint32_t block) { return s.model().masters(block); })
      .def(
          "gather_masters", [](PyStreamedModel& s, std::uint32_t block) { return s.model().gather_masters(block); },
          no_gil)
      .def("resident_parameters", [](PyStreamedModel& s) { return s.model().resident_parameters(); })
      .def(
          "begin_step", [](PyStreamedModel& s, std::int64_t step) { s.model().begin_step(step); }, no_gil)
      .def(
          "post_backward",
          [](PyStreamedModel& s, double loss) {
            const std::vector<sp_grad_moments_v1>* moments = nullptr;
            {
              py::gil_scoped_release no_gil_here;
              moments = &s.model().post_backward(loss);
            }
            return moments_list(*moments);
          },
          py::arg("loss") = std::numeric_limits<double>::quiet_NaN())
      .def(
          "prepare_update",
          [](PyStreamedModel& s, const std::vector<torch::Tensor>& rest_to_average, double loss) {
            double mean = 0.0;
            const std::vector<sp_grad_moments_v1>* moments = nullptr;
            {
              // Collectives: another rank's thread may need the GIL meanwhile.
              py::gil_scoped_release no_gil_here;
              const tl::StreamedModel::UpdateInputs inputs =
                  s.model().prepare_update(rest_to_average, [loss] { return loss; });
              mean = inputs.loss;
              moments = &inputs.moments;
            }
            return py::make_tuple(mean, moments_list(*moments));
          },
          py::arg("rest_to_average"), py::arg("loss"))
      .def(
          "end_step", [](PyStreamedModel& s, double loss) { return s.model().end_step(loss); }, no_gil)
      .def(
          "refresh_images", [](PyStreamedModel& s) { s.model().refresh_images(); }, no_gil)
      .def(
          "abort_step", [](PyStreamedModel& s) { s.model().abort_step(); }, no_gil)
      .def("trained_in_step", [](PyStreamedModel& s) { return s.model().trained_in_step(); })
      .def("step_phase", [](PyStreamedModel& s) { return s.model().step_phase(); })
      .def("calibrate",
           [](PyStreamedModel& s, const std::vector<torch::Tensor>& samples) {
             py::gil_scoped_release no_gil_here;
             return s.model().calibrate(samples);
           })
      .def("compare_routes",
           [](PyStreamedModel& s, py::object closure, std::size_t batches,
              const std::vector<std::vector<std::string>>& candidates, const std::vector<std::string>& reference,
              double confidence) {
             // closure(i) -> (loss tensor, scores tensor or None), as _measure.py normalises it.
             const std::shared_ptr<py::object> held = hold(std::move(closure));
             const tl::StreamedModel::MeasureClosure measure = [held](std::size_t batch) {
               py::gil_scoped_acquire gil;
               const py::tuple result = (*held)(batch).cast<py::tuple>();
               tl::MeasuredBatch out;
               out.loss = result[0].cast<torch::Tensor>();
               if (!result[1].is_none()) out.scores = result[1].cast<torch::Tensor>();
               return out;
             };
             const auto precisions = [](const std::vector<std::string>& names) {
               std::vector<sp::Precision> out;
               for (const std::string& name : names) out.push_back(precision_of(name));
               return out;
             };
             std::vector<std::vector<sp::Precision>> measured;
             for (const std::vector<std::string>& routes : candidates) measured.push_back(precisions(routes));
             const std::vector<tl::RouteComparison> comparisons = [&] {
               py::gil_scoped_release no_gil_here;
               return s.model().compare_routes(measure, batches, measured, precisions(reference), confidence);
             }();
             py::list out;
             for (const tl::RouteComparison& c : comparisons) {
               py::dict d;
               d["confidence"] = c.confidence;
               d["paired_over_examples"] = c.paired_over_examples;
               d["loss_a"] = c.loss_a;
               d["loss_b"] = c.loss_b;
               d["loss_difference"] = interval_dict(c.loss_difference);
               d["batch_loss_differences"] = c.batch_loss_differences;
               d["example_loss_differences"] = c.example_loss_differences;
               d["kl"] = c.kl ? py::object(interval_dict(*c.kl)) : py::none();
               d["batch_kl"] = c.batch_kl;
               d["example_kl"] = c.example_kl;
               d["bytes_a"] = c.bytes_a;
               d["bytes_b"] = c.bytes_b;
               d["bytes_all_bf16"] = c.bytes_all_bf16;
               d["h2d_bytes"] = c.h2d_bytes;
               out.append(d);
             }
             return out;
           })
      .def(
          "poll_plugin", [](PyStreamedModel& s, bool force) { return s.model().poll_plugin(force); }, no_gil)
      .def("export_state",
           [](PyStreamedModel& s) {
             py::gil_scoped_release no_gil_here;
             return s.model().export_state();
           })
      .def(
          "restore_state",
          [](PyStreamedModel& s, const std::map<std::string, torch::Tensor>& state) { s.model().restore_state(state); },
          no_gil)
      .def("image_bytes",
           [](PyStreamedModel& s, std::uint32_t block, const std::string& precision) {
             return s.model().image_bytes(block, precision_of(precision));
           })
      .def("routes", [](PyStreamedModel& s) { return route_names(s.model().routes()); })
      .def("unit_routes", [](PyStreamedModel& s) { return unit_route_texts(s.model().unit_routes()); })
      .def("plugin_version", [](PyStreamedModel& s) { return std::string(s.model().policy().plugin_version()); })
      .def("unit_signals",
           [](PyStreamedModel& s) {
             // {column: [value per block]} (NaN: not measured), with the examples behind it.
             const sp::host::UnitSignalTable& table = s.model().unit_signals();
             py::dict columns;
             const std::size_t n = table.names.size();
             for (std::size_t c = 0; c < n; ++c) {
               std::vector<double> values;
               for (std::size_t i = c; i < table.values.size(); i += n) values.push_back(table.values[i]);
               columns[py::str(table.names[c])] = values;
             }
             py::dict d;
             d["columns"] = columns;
             d["samples"] = table.samples;
             return d;
           })
      .def("propose_allocations",
           [](PyStreamedModel& s) {
             py::list rows;
             for (const std::vector<sp::Precision>& row : s.model().propose_allocations()) {
               py::list routes;
               for (sp::Precision p : row) routes.append(sp::precision_name(p));
               rows.append(routes);
             }
             return rows;
           })
      .def("set_allocation_measurements",
           [](PyStreamedModel& s, const std::vector<std::vector<std::string>>& allocations,
              const std::vector<std::vector<double>>& example_costs, double confidence) {
             std::vector<std::vector<sp::Precision>> routes;
             for (const std::vector<std::string>& row : allocations) {
               std::vector<sp::Precision>& out = routes.emplace_back();
               for (const std::string& name : row) out.push_back(precision_of(name));
             }
             return s.model().set_allocation_measurements(routes, example_costs, confidence);
           })
      .def("set_unit_signals",
           [](PyStreamedModel& s, const std::vector<std::string>& names, const std::vector<double>& values,
              std::uint64_t samples) {
             sp::host::UnitSignalTable table;
             table.names = names;
             table.values = values;
             table.samples = samples;
             return s.model().set_unit_signals(table);
           })
      .def("unit_costs",
           [](PyStreamedModel& s, const std::string& precision) -> py::object {
             const std::optional<std::vector<double>> costs = s.model().unit_costs(precision_of(precision));
             return costs ? py::cast(*costs) : py::none();
           })
      .def("budget_status",
           [](PyStreamedModel& s) -> py::object {
             const std::optional<sp_budget_status_v1> b = s.model().budget_status();
             if (!b || b->kind == SP_BUDGET_NONE) return py::none();
             py::dict d;
             d["kind"] = b->kind == SP_BUDGET_BYTES ? "bytes" : "loss";
             d["limit"] = b->limit;
             d["planned_bytes_fraction"] = b->planned_bytes_fraction;
             d["planned_cost"] = b->planned_cost;
             d["planned_loss_fraction"] = b->planned_loss_fraction;
             d["reference_loss"] = b->reference_loss;
             d["decided_at_step"] = b->decided_at_step;
             d["met"] = b->met != 0;
             d["reads_step_signals"] = b->reads_step_signals != 0;
             return d;
           })
      .def("evaluation_h2d_bytes", [](PyStreamedModel& s) { return s.model().evaluation_h2d_bytes(); })
      .def("calibration_h2d_bytes", [](PyStreamedModel& s) { return s.model().calibration_h2d_bytes(); })
      .def("measurement_h2d_bytes", [](PyStreamedModel& s) { return s.model().measurement_h2d_bytes(); })
      .def("rank", [](PyStreamedModel& s) { return s.model().rank(); })
      .def("world_size", [](PyStreamedModel& s) { return s.model().world_size(); })
      .def("sharded", [](PyStreamedModel& s) { return s.model().sharded(); })
      .def("recomputes", [](PyStreamedModel& s) { return s.model().recomputes(); })
      .def("set_compute_dtype",
           [](PyStreamedModel& s, py::object dtype) {
             s.model().set_compute_dtype(torch::python::detail::py_object_to_dtype(std::move(dtype)));
           })
      .def("gradient_reduction_device", [](PyStreamedModel& s) { return s.model().gradient_reduction_device().str(); })
      .def("owner", [](PyStreamedModel& s, std::uint32_t block) { return s.model().owner(block); })
      .def(
          "average_gradients",
          [](PyStreamedModel& s,
             const std::vector<torch::Tensor>& parameters) { s.model().average_gradients(parameters); },
          no_gil)
      .def(
          "average", [](PyStreamedModel& s, double value) { return s.model().average(value); }, no_gil)
      .def("take_collective_failure", &PyStreamedModel::take_collective_failure);
}

}  // namespace sp::binding
