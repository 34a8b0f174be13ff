// The Python binding of the LibTorch layer (sp/torch_layer/streamed_model.h): the layer itself,
// unchanged, with Python modules as its blocks. selective_precision/__init__.py is the thin
// Python part on top.
//
// The GIL: a block's parameters and forward are Python calls, made with the GIL held; autograd
// runs a block's backward (which recomputes its forward when asked to) with the GIL released, on its own
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

#include "sp/adapters/policy_bridge.h"
#include "sp/adapters/route_encoding.h"
#include "sp/host/plugin_library.h"
#include "sp/kernels/adamw.h"
#include "sp/kernels/nf4.h"
#include "sp/kernels/quantize.h"
#include "sp/torch_layer/collectives.h"
#include "sp/torch_layer/intra_op_pool.h"
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
  throw std::invalid_argument(fmt::format("precision '{}': expected 'bf16', 'int8' or 'nf4'", name));
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

py::dict interval_dict(const tl::PairedInterval& i) {
  py::dict d;
  d["n"] = i.n;
  d["mean"] = i.mean;
  d["std_error"] = i.std_error;
  d["low"] = i.low;
  d["high"] = i.high;
  return d;
}

py::dict errors_dict(const tl::CalibrationErrors& errors) {
  py::dict d;
  for (const sp::Precision precision : sp::kPrecisions) {
    if (sp::is_quantized(precision)) d[sp::precision_name(precision)] = errors[precision];
  }
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
      blocks.push_back(python_block(modules[b], streamed[b], moments_from[b],
                                    names.empty() ? fmt::format("block{}", b) : names[b]));
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

// ---- the transfer formats, as the layer's kernels make them (python/selective_precision: the
// public functions and what each array holds) ----------------------------------------------

namespace kn = sp::kernels;

torch::Tensor weight_matrix(const torch::Tensor& x, const char* call) {
  if (x.dim() != 2)
    throw std::invalid_argument(fmt::format("{}: a 2-D tensor expected, got {} dimensions", call, x.dim()));
  if (!x.device().is_cpu()) {
    throw std::invalid_argument(fmt::format("{}: a CPU tensor expected, got one on {}", call, x.device().str()));
  }
  if (x.scalar_type() != torch::kFloat32 && x.scalar_type() != torch::kBFloat16) {
    throw std::invalid_argument(
        fmt::format("{}: float32 or bfloat16 expected, got {}", call, c10::toString(x.scalar_type())));
  }
  return x.contiguous();
}

kn::DType kernel_dtype(const torch::Tensor& x) {
  return x.scalar_type() == torch::kBFloat16 ? kn::DType::kBFloat16 : kn::DType::kFloat32;
}

torch::ScalarType output_dtype(const py::object& dtype, const char* call) {
  const torch::ScalarType type = torch::python::detail::py_object_to_dtype(dtype);
  if (type != torch::kFloat32 && type != torch::kBFloat16) {
    throw std::invalid_argument(
        fmt::format("{}: dtype torch.float32 or torch.bfloat16 expected, got {}", call, c10::toString(type)));
  }
  return type;
}

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

// The caller's `out`, checked, or a new tensor: rows x cols of `type` on the CPU, contiguous.
torch::Tensor output_matrix(const std::optional<torch::Tensor>& out, std::int64_t rows, std::int64_t cols,
                            torch::ScalarType type, const char* call) {
  if (!out) return torch::empty({rows, cols}, type);
  require(out->device().is_cpu() && out->scalar_type() == type && out->is_contiguous() && out->dim() == 2 &&
              out->size(0) == rows && out->size(1) == cols,
          fmt::format("{}: out: a contiguous {} CPU tensor of shape ({}, {}) expected", call, c10::toString(type), rows,
                      cols));
  return *out;
}

// `threads` 0: torch's own intra-op threads (torch.get_num_threads()), as torch's ops use them;
// else that many threads of the kernels' own.
kn::CpuExec cpu_exec(unsigned threads) {
  if (threads == 0) return tl::intra_op_exec();
  return kn::CpuExec{kn::CpuImpl::kVectorized, threads};
}

py::tuple quantize_nf4(const torch::Tensor& x, std::uint32_t group_size, const py::object& scale_dtype,
                       unsigned threads) {
  const torch::Tensor src = weight_matrix(x, "quantize_nf4");
  const torch::ScalarType scale_type = torch::python::detail::py_object_to_dtype(scale_dtype);
  require(scale_type == torch::kFloat32 || scale_type == torch::kBFloat16,
          fmt::format("quantize_nf4: scale_dtype torch.float32 or torch.bfloat16 expected, got {}",
                      c10::toString(scale_type)));
  require(kn::is_supported_nf4_group_size(group_size),
          fmt::format("quantize_nf4: group_size {}: expected 32, 64, 128 or 256", group_size));
  const std::int64_t rows = src.size(0), cols = src.size(1);
  require(cols % 2 == 0,
          fmt::format("quantize_nf4: {} columns: an even number expected (a row's codes fill whole bytes)", cols));
  const std::int64_t groups = (cols + group_size - 1) / group_size;
  torch::Tensor codes = torch::empty({rows, cols / 2}, torch::kUInt8);
  torch::Tensor scales = torch::empty({rows, groups}, scale_type);
  {
    py::gil_scoped_release no_gil;
    const kn::CpuExec exec = cpu_exec(threads);
    if (scale_type == torch::kFloat32) {
      kn::quantize_nf4(src.data_ptr(), kernel_dtype(src), rows, cols, group_size, codes.data_ptr<std::uint8_t>(),
                       scales.data_ptr<float>(), exec);
    } else {
      kn::quantize_nf4(src.data_ptr(), kernel_dtype(src), rows, cols, group_size, codes.data_ptr<std::uint8_t>(),
                       reinterpret_cast<std::uint16_t*>(scales.data_ptr()), exec);
    }
  }
  return py::make_tuple(codes, scales);
}

torch::Tensor dequantize_nf4(const torch::Tensor& codes, const torch::Tensor& scales, std::uint32_t group_size,
                             const py::object& dtype, unsigned threads, const std::optional<torch::Tensor>& into) {
  const torch::ScalarType out_type = output_dtype(dtype, "dequantize_nf4");
  require(kn::is_supported_nf4_group_size(group_size),
          fmt::format("dequantize_nf4: group_size {}: expected 32, 64, 128 or 256", group_size));
  require(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8 && codes.device().is_cpu(),
          "dequantize_nf4: codes: a 2-D uint8 CPU tensor expected (rows, cols / 2)");
  const std::int64_t rows = codes.size(0), cols = codes.size(1) * 2;
  const std::int64_t groups = (cols + group_size - 1) / group_size;
  require(scales.dim() == 2 && (scales.scalar_type() == torch::kFloat32 || scales.scalar_type() == torch::kBFloat16) &&
              scales.device().is_cpu() && scales.size(0) == rows && scales.size(1) == groups,
          fmt::format("dequantize_nf4: scales: a float32 or bfloat16 CPU tensor of shape ({}, {}) expected for codes "
                      "of shape "
                      "({}, {}) in groups of {}",
                      rows, groups, rows, cols / 2, group_size));
  const torch::Tensor c = codes.contiguous(), s = scales.contiguous();
  torch::Tensor out = output_matrix(into, rows, cols, out_type, "dequantize_nf4");
  {
    py::gil_scoped_release no_gil;
    const kn::CpuExec exec = cpu_exec(threads);
    const auto dequantize = [&](const auto* scale_values) {
      if (out_type == torch::kBFloat16) {
        kn::dequantize_nf4_to_bf16(c.data_ptr<std::uint8_t>(), scale_values, rows, cols, group_size,
                                   reinterpret_cast<std::uint16_t*>(out.data_ptr()), exec);
      } else {
        kn::dequantize_nf4_to_fp32(c.data_ptr<std::uint8_t>(), scale_values, rows, cols, group_size,
                                   out.data_ptr<float>(), exec);
      }
    };
    if (s.scalar_type() == torch::kFloat32) {
      dequantize(s.data_ptr<float>());
    } else {
      dequantize(reinterpret_cast<const std::uint16_t*>(s.data_ptr()));
    }
  }
  return out;
}

py::tuple quantize_int8(const torch::Tensor& x, std::uint32_t group_size, unsigned threads) {
  const torch::Tensor src = weight_matrix(x, "quantize_int8");
  require(kn::is_supported_group_size(group_size),
          fmt::format("quantize_int8: group_size {}: expected 0 (per row), 32, 64, 128 or 256", group_size));
  const std::int64_t rows = src.size(0), cols = src.size(1);
  const std::int64_t groups = group_size == 0 ? 1 : (cols + group_size - 1) / group_size;
  torch::Tensor codes = torch::empty({rows, cols}, torch::kInt8);
  torch::Tensor scales = torch::empty({rows, groups}, torch::kFloat32);
  {
    py::gil_scoped_release no_gil;
    kn::QuantizeOptions options;
    options.group_size = group_size;
    kn::quantize_int8(src.data_ptr(), kernel_dtype(src), rows, cols, options, codes.data_ptr<std::int8_t>(),
                      scales.data_ptr<float>(), cpu_exec(threads));
  }
  return py::make_tuple(codes, scales);
}

torch::Tensor dequantize_int8(const torch::Tensor& codes, const torch::Tensor& scales, std::uint32_t group_size,
                              const py::object& dtype, unsigned threads, const std::optional<torch::Tensor>& into) {
  const torch::ScalarType out_type = output_dtype(dtype, "dequantize_int8");
  require(kn::is_supported_group_size(group_size),
          fmt::format("dequantize_int8: group_size {}: expected 0 (per row), 32, 64, 128 or 256", group_size));
  require(codes.dim() == 2 && codes.scalar_type() == torch::kInt8 && codes.device().is_cpu(),
          "dequantize_int8: codes: a 2-D int8 CPU tensor expected");
  const std::int64_t rows = codes.size(0), cols = codes.size(1);
  const std::int64_t groups = group_size == 0 ? 1 : (cols + group_size - 1) / group_size;
  require(scales.dim() == 2 && scales.scalar_type() == torch::kFloat32 && scales.device().is_cpu() &&
              scales.size(0) == rows && scales.size(1) == groups,
          fmt::format("dequantize_int8: scales: a float32 CPU tensor of shape ({}, {}) expected for codes of shape "
                      "({}, {})",
                      rows, groups, rows, cols));
  const torch::Tensor c = codes.contiguous(), s = scales.contiguous();
  torch::Tensor out = output_matrix(into, rows, cols, out_type, "dequantize_int8");
  {
    py::gil_scoped_release no_gil;
    const kn::CpuExec exec = cpu_exec(threads);
    if (out_type == torch::kBFloat16) {
      kn::dequantize_int8_to_bf16(c.data_ptr<std::int8_t>(), s.data_ptr<float>(), rows, cols, group_size,
                                  reinterpret_cast<std::uint16_t*>(out.data_ptr()), exec);
    } else {
      kn::dequantize_int8_to_fp32(c.data_ptr<std::int8_t>(), s.data_ptr<float>(), rows, cols, group_size,
                                  out.data_ptr<float>(), exec);
    }
  }
  return out;
}

// ---- the host optimizer, as the layer runs it (sp/kernels/adamw.h) ----------------------------

kn::TensorShape shape_of(const torch::Tensor& t) {
  return t.dim() == 1 ? kn::TensorShape{1, static_cast<std::uint64_t>(t.size(0))}
                      : kn::TensorShape{static_cast<std::uint64_t>(t.size(0)), static_cast<std::uint64_t>(t.size(1))};
}

void require_like(const torch::Tensor& t, const torch::Tensor& param, const char* what, std::size_t i) {
  require(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.sizes() == param.sizes(),
          fmt::format("adamw_step_: {}[{}]: a contiguous float32 CPU tensor of the shape of params[{}] expected", what,
                      i, i));
}

std::optional<torch::Tensor> adamw_step(const std::vector<torch::Tensor>& params,
                                        const std::vector<torch::Tensor>& grads,
                                        const std::vector<torch::Tensor>& exp_avgs,
                                        const std::vector<torch::Tensor>& exp_avg_sqs, double lr, std::int64_t step,
                                        double beta1, double beta2, double eps, double weight_decay,
                                        const std::optional<std::string>& image, std::uint32_t group_size,
                                        unsigned threads, const std::optional<torch::Tensor>& into) {
  require(grads.size() == params.size() && exp_avgs.size() == params.size() && exp_avg_sqs.size() == params.size(),
          fmt::format("adamw_step_: {} params, {} grads, {} exp_avgs and {} exp_avg_sqs: one of each per parameter "
                      "expected",
                      params.size(), grads.size(), exp_avgs.size(), exp_avg_sqs.size()));
  require(step >= 1, fmt::format("adamw_step_: step {}: the first step is 1", step));
  std::vector<kn::AdamWTensor> tensors(params.size());
  std::vector<kn::TensorShape> shapes(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& p = params[i];
    require(p.dim() == 1 || p.dim() == 2,
            fmt::format("adamw_step_: params[{}]: a 1-D or 2-D tensor expected, got {} dimensions", i, p.dim()));
    require_like(p, p, "params", i);
    require_like(grads[i], p, "grads", i);
    require_like(exp_avgs[i], p, "exp_avgs", i);
    require_like(exp_avg_sqs[i], p, "exp_avg_sqs", i);
    shapes[i] = shape_of(p);
    tensors[i].master = p.data_ptr<float>();
    tensors[i].grad = grads[i].data_ptr<float>();
    tensors[i].exp_avg = exp_avgs[i].data_ptr<float>();
    tensors[i].exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    tensors[i].shape = shapes[i];
  }
  const kn::AdamWStep constants = kn::make_adamw_step({beta1, beta2, eps, weight_decay}, lr, step, 1.0);
  const kn::CpuExec exec = cpu_exec(threads);
  if (!image) {
    py::gil_scoped_release no_gil;
    for (const kn::AdamWTensor& t : tensors) kn::adamw_update(constants, t, exec);
    return std::nullopt;
  }
  const std::optional<sp::Precision> precision = sp::precision_named(*image);
  require(precision.has_value(),
          fmt::format("adamw_step_: image '{}': None, 'bf16', 'int8' or 'nf4' expected", *image));
  // The image the engine would build for that route (every name above is one).
  const kn::SlabEncoding encoding = sp::adapters::slab_encoding(*precision, group_size);
  const std::uint64_t bytes = kn::slab_image_bytes(encoding, shapes.data(), shapes.size());
  // Like the layer's pinned slabs, an image buffer can be allocated once and written each step.
  torch::Tensor out = into ? *into : torch::empty({static_cast<std::int64_t>(bytes)}, torch::kUInt8);
  require(out.device().is_cpu() && out.scalar_type() == torch::kUInt8 && out.is_contiguous() && out.dim() == 1 &&
              out.size(0) == static_cast<std::int64_t>(bytes) &&
              reinterpret_cast<std::uintptr_t>(out.data_ptr()) % 16 == 0,
          fmt::format("adamw_step_: out: a contiguous, 16-byte aligned uint8 CPU tensor of {} bytes expected (the {} "
                      "image of these shapes)",
                      bytes, *image));
  {
    py::gil_scoped_release no_gil;
    kn::adamw_update_slab(encoding, constants, tensors.data(), tensors.size(), out.data_ptr<std::uint8_t>(), bytes,
                          exec);
  }
  return out;
}

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
  m.def(
      "_paired_interval",
      [](const std::vector<double>& values, double confidence) {
        return interval_dict(tl::paired_interval(values, confidence));
      },
      py::arg("values"), py::arg("confidence"));
  m.def("_quantize_nf4", &quantize_nf4, py::arg("x"), py::arg("group_size"), py::arg("scale_dtype"),
        py::arg("threads"));
  m.def("_dequantize_nf4", &dequantize_nf4, py::arg("codes"), py::arg("scales"), py::arg("group_size"),
        py::arg("dtype"), py::arg("threads"), py::arg("out"));
  m.def("_quantize_int8", &quantize_int8, py::arg("x"), py::arg("group_size"), py::arg("threads"));
  m.def("_dequantize_int8", &dequantize_int8, py::arg("codes"), py::arg("scales"), py::arg("group_size"),
        py::arg("dtype"), py::arg("threads"), py::arg("out"));
  m.def("_adamw_step", &adamw_step, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("lr"), py::arg("step"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("image"), py::arg("group_size"), py::arg("threads"), py::arg("out"));
  py::class_<PyStreamedModel>(m, "_StreamedModel")
      .def(py::init([](const py::list& modules, const std::vector<std::vector<std::string>>& streamed,
                       const std::vector<std::vector<std::string>>& moments_from, const std::string& plugin_file,
                       const std::string& config_yaml, const std::string& config_source, const std::string& output_dir,
                       const std::string& device, py::object compute_dtype, double host_bandwidth_cap_gbps,
                       std::uint32_t prefetch_window, std::uint32_t spare_slabs, std::uint32_t int8_group_size,
                       std::uint32_t nf4_group_size, const std::string& metrics_path, std::uint32_t recalibrate_every,
                       const py::object& process_group, bool shard_masters, const py::object& calls,
                       const std::string& transfer_policy, std::optional<bool> recompute,
                       const std::vector<std::string>& names,
                       const std::vector<std::pair<std::string, std::uint32_t>>& units) {
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
             o.transfer_policy = transfer_policy;
             o.recompute = recompute;
             for (const auto& [name, blocks] : units) o.units.push_back(tl::PolicyUnit{name, blocks});
             return std::make_unique<PyStreamedModel>(modules, streamed, moments_from, names, calls, std::move(o),
                                                      collectives_of(process_group));
           }),
           py::arg("modules"), py::arg("streamed"), py::arg("moments_from"), py::arg("plugin_file"),
           py::arg("config_yaml"), py::arg("config_source"), py::arg("output_dir"), py::arg("device"),
           py::arg("compute_dtype"), py::arg("host_bandwidth_cap_gbps"), py::arg("prefetch_window"),
           py::arg("spare_slabs"), py::arg("int8_group_size"), py::arg("nf4_group_size"), py::arg("metrics_path"),
           py::arg("recalibrate_every"), py::arg("process_group"), py::arg("shard_masters"),
           py::arg("calls") = py::none(), py::arg("transfer_policy") = "", py::arg("recompute") = py::none(),
           py::arg("names") = std::vector<std::string>(),
           py::arg("units") = std::vector<std::pair<std::string, std::uint32_t>>())
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
      .def("post_backward",
           [](PyStreamedModel& s, double loss) {
             const std::vector<sp_grad_moments_v1>* moments = nullptr;
             {
               py::gil_scoped_release no_gil_here;
               moments = &s.model().post_backward(loss);
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
           },
           py::arg("loss") = std::numeric_limits<double>::quiet_NaN())
      .def("end_step",
           [](PyStreamedModel& s, double loss) {
             const tl::StepReport r = [&] {
               py::gil_scoped_release no_gil_here;
               return s.model().end_step(loss);
             }();
             py::dict d;
             d["step"] = r.step;
             for (sp::Precision p : sp::kPrecisions)
               d[py::str(std::string("h2d_bytes_") + sp::precision_name(p))] = r.h2d_bytes[p];
             d["h2d_bytes_all_bf16"] = r.h2d_bytes_all_bf16;
             d["eval_h2d_bytes"] = r.eval_h2d_bytes;
             d["training_passes"] = r.training_passes;
             d["prefetch_hits"] = r.prefetch_hits;
             d["prefetch_misses"] = r.prefetch_misses;
             d["prefetch_unused"] = r.prefetch_unused;
             py::list routes;
             for (sp::Precision p : r.routes) routes.append(sp::precision_name(p));
             d["routes"] = routes;
             d["swap"] = r.swap ? py::object(swap_dict(*r.swap)) : py::none();
             d["calibration"] = r.calibration ? py::object(errors_dict(*r.calibration)) : py::none();
             return d;
           })
      .def(
          "refresh_images", [](PyStreamedModel& s) { s.model().refresh_images(); }, no_gil)
      .def(
          "abort_step", [](PyStreamedModel& s) { s.model().abort_step(); }, no_gil)
      .def("trained_in_step", [](PyStreamedModel& s) { return s.model().trained_in_step(); })
      .def("step_phase",
           [](PyStreamedModel& s) {
             switch (s.model().step_phase()) {
               case tl::StreamedModel::StepPhase::open:
                 return "open";
               case tl::StreamedModel::StepPhase::after_backward:
                 return "after_backward";
               case tl::StreamedModel::StepPhase::between_steps:
                 break;
             }
             return "between_steps";
           })
      .def("calibrate",
           [](PyStreamedModel& s, const std::vector<torch::Tensor>& samples) {
             const tl::CalibrationErrors errors = [&] {
               py::gil_scoped_release no_gil_here;
               return s.model().calibrate(samples);
             }();
             return errors_dict(errors);
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
             for (sp::Precision p : s.model().routes()) out.emplace_back(sp::precision_name(p));
             return out;
           })
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
          [](PyStreamedModel& s, const std::vector<torch::Tensor>& parameters) {
            s.model().average_gradients(parameters);
          },
          no_gil)
      .def(
          "average", [](PyStreamedModel& s, double value) { return s.model().average(value); }, no_gil)
      .def("take_collective_failure", &PyStreamedModel::take_collective_failure);
}
