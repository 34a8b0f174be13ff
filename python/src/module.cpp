// The Python binding of the LibTorch layer (sp/torch_layer/streamed_model.h): the layer itself,
// unchanged, with Python modules as its blocks. selective_precision/__init__.py is the thin
// Python part on top.
//
// The GIL: a block's parameters and forward are Python calls, made with the GIL held; autograd
// runs a block's backward (which recomputes its forward) with the GIL released, on its own
// thread or the caller's, so each call takes the GIL itself. The Python modules are held by
// pointers whose last release takes the GIL too. The layer's messages (its engines' and the
// plugin's too) go to Python's logging, which takes the GIL on whatever thread logs: so every
// call that can wait on another thread (the constructor, close, the destructor, and all that
// stream, swap or exchange) releases the GIL while it waits.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/extension.h>

#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <spdlog/details/null_mutex.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include "sp/host/plugin_library.h"
#include "sp/torch_layer/collectives.h"
#include "sp/torch_layer/streamed_model.h"

namespace py = pybind11;
namespace tl = sp::torch_layer;

namespace {

std::shared_ptr<py::object> hold(py::object object) {
  return std::shared_ptr<py::object>(new py::object(std::move(object)), [](py::object* o) {
    py::gil_scoped_acquire gil;
    delete o;
  });
}

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

// Python's logging filters by level; debug messages are few (none per block or per step).
std::shared_ptr<spdlog::logger> python_logger() {
  auto logger = std::make_shared<spdlog::logger>("selective_precision", std::make_shared<PythonLoggingSink>());
  logger->set_level(spdlog::level::debug);
  return logger;
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

sp_precision precision_of(const std::string& name) {
  if (name == "bf16") return SP_PRECISION_BF16;
  if (name == "int8") return SP_PRECISION_INT8;
  if (name == "nf4") return SP_PRECISION_NF4;
  throw std::invalid_argument(fmt::format("precision '{}': expected 'bf16', 'int8' or 'nf4'", name));
}

const char* precision_name(sp_precision precision) {
  return precision == SP_PRECISION_NF4 ? "nf4" : precision == SP_PRECISION_INT8 ? "int8" : "bf16";
}

py::dict swap_dict(const sp::host::SwapResult& swap) {
  py::dict d;
  d["outcome"] = swap.outcome == sp::host::SwapResult::Outcome::swapped   ? "swapped"
                 : swap.outcome == sp::host::SwapResult::Outcome::pending ? "pending"
                                                                          : "failed";
  d["message"] = swap.message;
  d["old_version"] = swap.old_version;
  d["new_version"] = swap.new_version;
  return d;
}

py::dict errors_dict(const tl::CalibrationErrors& errors) {
  py::dict d;
  d["int8"] = errors.int8;
  d["nf4"] = errors.nf4;
  return d;
}

// The layer's collectives, remembering the first one that failed: autograd hands Python a
// failure inside loss.backward() as a plain RuntimeError, so the binding tells the package
// which errors were a collective's (StreamedBlocks.step() raises them as CollectiveError).
class RecordingCollectives final : public tl::Collectives,
                                   public std::enable_shared_from_this<RecordingCollectives> {
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
  PyStreamedModel(const py::list& modules, const std::vector<std::string>& streamed,
                  const std::vector<std::string>& moments_from, tl::StreamedModelOptions options,
                  std::shared_ptr<RecordingCollectives> collectives)
      : collectives_(collectives) {
    if (modules.empty()) throw std::invalid_argument("StreamedModel: the module list is empty");
    std::vector<tl::Block> blocks;
    for (std::size_t b = 0; b < modules.size(); ++b) {
      blocks.push_back(python_block(modules[b], streamed, moments_from, fmt::format("block{}", b)));
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

PYBIND11_MODULE(_selective_precision, m) {
  m.doc() = "Selective Precision: stream the blocks of a PyTorch model through a precision policy plugin.";

  py::register_exception<sp::host::PluginError>(m, "PluginError", PyExc_RuntimeError);
  py::register_exception<tl::StateEntryError>(m, "StateEntryError", PyExc_ValueError);
  py::register_exception<tl::CollectiveError>(m, "CollectiveError", PyExc_RuntimeError);
  py::register_exception<tl::RankMismatchError>(m, "RankMismatchError", PyExc_RuntimeError);

  // The calls that stream, compute or wait on other ranks run without the GIL, so that the
  // script's other threads (a DataLoader's pin-memory thread) go on meanwhile; the blocks'
  // Python forwards take it back (python_block). Their results become Python objects after.
  const py::call_guard<py::gil_scoped_release> no_gil;
  py::class_<PyStreamedModel>(m, "_StreamedModel")
      .def(py::init([](const py::list& modules, const std::vector<std::string>& streamed,
                       const std::vector<std::string>& moments_from, const std::string& plugin_file,
                       const std::string& config_yaml, const std::string& config_source, const std::string& output_dir,
                       const std::string& device, py::object compute_dtype, double host_bandwidth_cap_gbps,
                       std::uint32_t prefetch_window, std::uint32_t spare_slabs, std::uint32_t int8_group_size,
                       std::uint32_t nf4_group_size, const std::string& metrics_path, std::uint32_t recalibrate_every,
                       const py::object& process_group, bool shard_masters) {
             tl::StreamedModelOptions o;
             o.plugin_file = plugin_file;
             o.config_yaml = config_yaml;
             o.config_source = config_source;
             o.output_dir = output_dir;
             o.host_name = "selective_precision (Python)";
             o.device = torch::Device(device);
             o.compute_dtype = torch::python::detail::py_object_to_dtype(compute_dtype);
             o.host_bandwidth_cap_gbps = host_bandwidth_cap_gbps;
             o.prefetch_window = prefetch_window;
             o.spare_slabs = spare_slabs;
             o.int8_group_size = int8_group_size;
             o.nf4_group_size = nf4_group_size;
             o.metrics_path = metrics_path;
             o.recalibrate_every = recalibrate_every;
             o.shard_masters = shard_masters;
             return std::make_unique<PyStreamedModel>(modules, streamed, moments_from, std::move(o),
                                                      collectives_of(process_group));
           }),
           py::arg("modules"), py::arg("streamed"), py::arg("moments_from"), py::arg("plugin_file"),
           py::arg("config_yaml"), py::arg("config_source"), py::arg("output_dir"), py::arg("device"),
           py::arg("compute_dtype"), py::arg("host_bandwidth_cap_gbps"), py::arg("prefetch_window"),
           py::arg("spare_slabs"), py::arg("int8_group_size"), py::arg("nf4_group_size"), py::arg("metrics_path"),
           py::arg("recalibrate_every"), py::arg("process_group"), py::arg("shard_masters"))
      .def("close", &PyStreamedModel::close)
      .def_property_readonly("closed", &PyStreamedModel::closed)
      .def("num_blocks", [](PyStreamedModel& s) { return s.model().num_blocks(); })
      .def("forward", [](PyStreamedModel& s, const torch::Tensor& x) { return s.model().forward(x); }, no_gil)
      .def("master_parameters", [](PyStreamedModel& s) { return s.model().master_parameters(); })
      .def("masters", [](PyStreamedModel& s, std::uint32_t block) { return s.model().masters(block); })
      .def("resident_parameters", [](PyStreamedModel& s) { return s.model().resident_parameters(); })
      .def("begin_step", [](PyStreamedModel& s, std::int64_t step) { s.model().begin_step(step); }, no_gil)
      .def("post_backward",
           [](PyStreamedModel& s) {
             const std::vector<sp_grad_moments_v1>* moments = nullptr;
             {
               py::gil_scoped_release no_gil_here;
               moments = &s.model().post_backward();
             }
             py::list out;
             for (const sp_grad_moments_v1& g : *moments) {
               py::dict d;
               d["sum_sq"] = g.sum_sq;
               d["sum"] = g.sum;
               d["max_abs"] = g.max_abs;
               d["count"] = g.count;
               d["nonfinite"] = g.nonfinite;
               out.append(d);
             }
             return out;
           })
      .def("end_step",
           [](PyStreamedModel& s, double loss) {
             const tl::StepReport r = [&] {
               py::gil_scoped_release no_gil_here;
               return s.model().end_step(loss);
             }();
             py::dict d;
             d["step"] = r.step;
             d["h2d_bytes_bf16"] = r.h2d_bytes_bf16;
             d["h2d_bytes_int8"] = r.h2d_bytes_int8;
             d["h2d_bytes_nf4"] = r.h2d_bytes_nf4;
             d["h2d_bytes_all_bf16"] = r.h2d_bytes_all_bf16;
             d["eval_h2d_bytes"] = r.eval_h2d_bytes;
             d["training_passes"] = r.training_passes;
             py::list routes;
             for (sp_precision p : r.routes) routes.append(precision_name(p));
             d["routes"] = routes;
             d["swap"] = r.swap ? py::object(swap_dict(*r.swap)) : py::none();
             d["calibration"] = r.calibration ? py::object(errors_dict(*r.calibration)) : py::none();
             return d;
           })
      .def("refresh_images", [](PyStreamedModel& s) { s.model().refresh_images(); }, no_gil)
      .def("abort_step", [](PyStreamedModel& s) { s.model().abort_step(); }, no_gil)
      .def("calibrate",
           [](PyStreamedModel& s, const std::vector<torch::Tensor>& samples) {
             const tl::CalibrationErrors errors = [&] {
               py::gil_scoped_release no_gil_here;
               return s.model().calibrate(samples);
             }();
             return errors_dict(errors);
           })
      .def("poll_plugin",
           [](PyStreamedModel& s, bool force) -> py::object {
             const std::optional<sp::host::SwapResult> r = [&] {
               py::gil_scoped_release no_gil_here;
               return s.model().poll_plugin(force);
             }();
             return r ? py::object(swap_dict(*r)) : py::none();
           })
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
      .def("routes",
           [](PyStreamedModel& s) {
             std::vector<std::string> out;
             for (sp_precision p : s.model().routes()) out.emplace_back(precision_name(p));
             return out;
           })
      .def("plugin_version", [](PyStreamedModel& s) { return std::string(s.model().policy().plugin_version()); })
      .def("evaluation_h2d_bytes", [](PyStreamedModel& s) { return s.model().evaluation_h2d_bytes(); })
      .def("rank", [](PyStreamedModel& s) { return s.model().rank(); })
      .def("world_size", [](PyStreamedModel& s) { return s.model().world_size(); })
      .def("sharded", [](PyStreamedModel& s) { return s.model().sharded(); })
      .def("gradient_reduction_device",
           [](PyStreamedModel& s) { return s.model().gradient_reduction_device().str(); })
      .def("owner", [](PyStreamedModel& s, std::uint32_t block) { return s.model().owner(block); })
      .def("average_gradients",
           [](PyStreamedModel& s, const std::vector<torch::Tensor>& parameters) {
             s.model().average_gradients(parameters);
           },
           no_gil)
      .def("average", [](PyStreamedModel& s, double value) { return s.model().average(value); }, no_gil)
      .def("take_collective_failure", &PyStreamedModel::take_collective_failure);
}
