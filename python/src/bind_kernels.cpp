// The transfer formats and the host optimizer, as the layer's kernels run them
// (python/selective_precision: the public functions and what each array holds).
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "binding.h"
#include "sp/adapters/route_encoding.h"
#include "sp/kernels/adamw.h"
#include "sp/kernels/nf4.h"
#include "sp/kernels/quantize.h"
#include "sp/precision.h"
#include "sp/torch_layer/intra_op_pool.h"

namespace py = pybind11;
namespace tl = sp::torch_layer;

namespace sp::binding {

namespace {

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
                                        const std::optional<std::string>& image,
                                        std::optional<std::uint32_t> group_size, unsigned threads,
                                        const std::optional<torch::Tensor>& into) {
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
          fmt::format("adamw_step_: image '{}': None, {} expected", *image, sp::quoted_route_names()));
  // The image the engine would build for that route (every name above is one).
  const kn::SlabEncoding encoding =
      sp::adapters::slab_encoding(*precision, group_size.value_or(sp::route_traits(*precision).default_group_size));
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

void bind_kernels(py::module_& m) {
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
}

}  // namespace sp::binding
