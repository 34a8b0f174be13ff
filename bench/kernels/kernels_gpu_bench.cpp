// sp-bench-kernels-gpu: INT8 and NF4 dequantization and gradient moments as a fraction of the
// device-to-device copy bandwidth measured in the same run (cudaEvent timing, median of the
// repeats). Writes JSON (atomically).
//
//   copy bandwidth       = 2 * bytes / time of cudaMemcpyAsync D2D (it reads and writes bytes)
//   copy read bandwidth  = bytes / that time
//   dequant ratio        = (codes + scales read + bf16 written) / time / copy bandwidth
//                          (NF4: n / 2 code bytes + 2 bytes per bf16 scale read)
//   moments ratio        = gradient bytes read / time / copy read bandwidth
// Moments run over 48 blocks of 10^7 fp32 elements each: one plan, one chunk launch plus
// one cleanup launch, no host sync inside the timed region except the closing event.
#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_cli.h"
#include "bench_report.h"
#include "sp/kernels/cuda/bf16.h"
#include "sp/kernels/cuda/check.h"
#include "sp/kernels/cuda/moments.h"
#include "sp/kernels/cuda/nf4.h"
#include "sp/kernels/cuda/quantize.h"

namespace {

using sp::kernels::cuda::check;

struct DeviceMemory {
  void *ptr = nullptr;
  explicit DeviceMemory(std::size_t bytes) { check(cudaMalloc(&ptr, bytes), "cudaMalloc"); }
  ~DeviceMemory() { cudaFree(ptr); }
  DeviceMemory(const DeviceMemory &) = delete;
  DeviceMemory &operator=(const DeviceMemory &) = delete;
  template <typename T>
  T *as() const {
    return static_cast<T *>(ptr);
  }
};

struct Options {
  std::string output = "bench/results/kernels-gpu.json";
  std::string commit = "unknown";
  int repeats = 20;
  std::size_t dequant_rows = 16384;
  std::size_t dequant_cols = 16384;
  uint32_t moment_blocks = 48;
  std::size_t moment_elements = 10'000'000;
};

double median_ms(cudaStream_t stream, int repeats, const std::function<void()> &body) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  body();  // warm-up
  check(cudaStreamSynchronize(stream), "warm-up");
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r) {
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    body();
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float elapsed = 0;
    check(cudaEventElapsedTime(&elapsed, start, stop), "cudaEventElapsedTime");
    ms.push_back(elapsed);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return sp::bench::percentiles(ms).median;
}

void run(const Options &options) {
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  nlohmann::json results = nlohmann::json::array();

  // The limit: a 2 GiB device-to-device copy.
  const std::size_t copy_bytes = std::size_t{2} << 30;
  DeviceMemory copy_src(copy_bytes), copy_dst(copy_bytes);
  check(cudaMemsetAsync(copy_src.ptr, 1, copy_bytes, stream), "cudaMemset");
  const double copy_ms = median_ms(stream, options.repeats, [&] {
    check(cudaMemcpyAsync(copy_dst.ptr, copy_src.ptr, copy_bytes, cudaMemcpyDeviceToDevice, stream), "D2D copy");
  });
  const double copy_bw = 2.0 * static_cast<double>(copy_bytes) / (copy_ms * 1e-3);
  const double copy_read_bw = static_cast<double>(copy_bytes) / (copy_ms * 1e-3);
  results.push_back(
      {{"kernel", "cudaMemcpy D2D"}, {"bytes", copy_bytes}, {"median_ms", copy_ms}, {"gb_per_s", copy_bw / 1e9}});
  std::printf("D2D copy: %.1f GB/s (read + write)\n", copy_bw / 1e9);

  const auto record = [&](const std::string &kernel, double read, double written, double ms, bool read_only,
                          double target) {
    const double bw = (read + written) / (ms * 1e-3);
    const double ratio = read_only ? (read / (ms * 1e-3)) / copy_read_bw : bw / copy_bw;
    results.push_back({{"kernel", kernel},
                       {"bytes_read", read},
                       {"bytes_written", written},
                       {"median_ms", ms},
                       {"gb_per_s", bw / 1e9},
                       {read_only ? "ratio_to_copy_read" : "ratio_to_copy", ratio},
                       {"target", {{"at_least", target}, {"met", ratio >= target}}}});
    std::printf("%-44s %8.1f GB/s  x%.3f of copy%s  %s\n", kernel.c_str(), bw / 1e9, ratio, read_only ? " read" : "",
                ratio >= target ? "[target met]" : "[target MISSED]");
  };

  // INT8 -> bf16 dequantization of one large matrix, per row and group 128.
  {
    const std::size_t rows = options.dequant_rows, cols = options.dequant_cols, n = rows * cols;
    DeviceMemory weights(n * 4), codes(n), scales(sp::kernels::scale_count(rows, cols, 32) * 4), out(n * 2);
    check(cudaMemsetAsync(weights.ptr, 0, n * 4, stream), "cudaMemset");
    for (const uint32_t group : {0u, 128u}) {
      sp::kernels::QuantizeOptions qo;
      qo.group_size = group;
      sp::kernels::cuda::quantize_int8(weights.ptr, sp::kernels::DType::kFloat32, rows, cols, qo, codes.as<int8_t>(),
                                       scales.as<float>(), stream);
      const double scale_bytes = 4.0 * static_cast<double>(sp::kernels::scale_count(rows, cols, group));
      const double ms = median_ms(stream, options.repeats, [&] {
        sp::kernels::cuda::dequantize_int8_to_bf16(codes.as<int8_t>(), scales.as<float>(), rows, cols, group,
                                                   out.as<uint16_t>(), stream);
      });
      record("dequantize_int8_to_bf16 " + std::string(group == 0 ? "per-row" : "group-128") + " " +
                 std::to_string(rows) + "x" + std::to_string(cols),
             static_cast<double>(n) + scale_bytes, 2.0 * static_cast<double>(n), ms, false, 0.85);
    }
    const double ms = median_ms(stream, options.repeats, [&] {
      sp::kernels::cuda::fp32_to_bf16(weights.as<float>(), out.as<uint16_t>(), n, {}, stream);
    });
    record("fp32_to_bf16 " + std::to_string(n), 4.0 * static_cast<double>(n), 2.0 * static_cast<double>(n), ms, false,
           0.85);
  }

  // NF4 -> bf16 dequantization of the same matrix, group 32 and the default 64. Random codes and
  // scales from the host, so the level lookups see realistic index patterns.
  {
    const std::size_t rows = options.dequant_rows, cols = options.dequant_cols, n = rows * cols;
    const std::size_t code_bytes = sp::kernels::nf4_code_bytes(rows, cols);
    const std::size_t max_scales = sp::kernels::nf4_scale_count(rows, cols, 32);
    std::vector<uint8_t> host_codes(code_bytes);
    std::vector<uint16_t> host_scales(max_scales);
    std::mt19937 rng(7);
    for (uint8_t &c : host_codes) c = static_cast<uint8_t>(rng());
    for (uint16_t &s : host_scales) s = static_cast<uint16_t>(0x3C00u + rng() % 0x0400u);  // bf16 in [2^-7, 2^1)
    DeviceMemory codes(code_bytes), scales(max_scales * 2), out(n * 2);
    check(cudaMemcpyAsync(codes.ptr, host_codes.data(), code_bytes, cudaMemcpyHostToDevice, stream), "upload");
    check(cudaMemcpyAsync(scales.ptr, host_scales.data(), max_scales * 2, cudaMemcpyHostToDevice, stream), "upload");
    check(cudaStreamSynchronize(stream), "upload");
    for (const uint32_t group : {32u, 64u}) {
      const double scale_bytes = 2.0 * static_cast<double>(sp::kernels::nf4_scale_count(rows, cols, group));
      const double ms = median_ms(stream, options.repeats, [&] {
        sp::kernels::cuda::dequantize_nf4_to_bf16(codes.as<uint8_t>(), scales.as<uint16_t>(), rows, cols, group,
                                                  out.as<uint16_t>(), stream);
      });
      record("dequantize_nf4_to_bf16 group-" + std::to_string(group) + " " + std::to_string(rows) + "x" +
                 std::to_string(cols),
             static_cast<double>(code_bytes) + scale_bytes, 2.0 * static_cast<double>(n), ms, false, 0.85);
    }
  }

  // Gradient moments: 48 blocks x 10^7 fp32 elements, one plan, one launch per step.
  {
    const std::size_t per_block = options.moment_elements;
    DeviceMemory grads(per_block * options.moment_blocks * 4);
    check(cudaMemsetAsync(grads.ptr, 0, per_block * options.moment_blocks * 4, stream), "cudaMemset");
    std::vector<sp::kernels::GradTensor> tensors;
    for (uint32_t b = 0; b < options.moment_blocks; ++b) {
      tensors.push_back({grads.as<float>() + b * per_block, per_block, sp::kernels::DType::kFloat32, b});
    }
    sp::kernels::cuda::GradMomentsPlan plan(tensors.data(), tensors.size(), options.moment_blocks);
    DeviceMemory workspace(plan.workspace_bytes()), out(options.moment_blocks * sizeof(sp_grad_moments_v1));
    plan.upload(workspace.ptr, stream);
    const double ms =
        median_ms(stream, options.repeats, [&] { plan.launch(workspace.ptr, out.as<sp_grad_moments_v1>(), stream); });
    record("grad_moments fp32 " + std::to_string(options.moment_blocks) + " blocks x " + std::to_string(per_block),
           4.0 * static_cast<double>(per_block * options.moment_blocks), 0.0, ms, true, 0.80);
  }

  const nlohmann::json doc = {{"benchmark", "sp-bench-kernels-gpu"},
                              {"commit", options.commit},
                              {"machine", sp::bench::machine_description()},
                              {"gpu",
                               {{"name", prop.name},
                                {"sm", std::to_string(prop.major) + "." + std::to_string(prop.minor)},
                                {"memory_bytes", prop.totalGlobalMem}}},
                              {"repeats", options.repeats},
                              {"results", results}};
  sp::bench::write_report(options.output, doc);
  cudaStreamDestroy(stream);
  std::cout << "wrote " << options.output << "\n";
}

}  // namespace

int main(int argc, char **argv) {
  Options options;
  CLI::App app{"GPU kernel throughput against device-to-device copy bandwidth measured in the same run"};
  sp::bench::add_report_options(app, options.output, options.commit);
  app.add_option("--repeats", options.repeats, "timed repetitions (median reported)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  if (const int exit_code = sp::bench::parse_command_line(app, argc, argv); exit_code >= 0) return exit_code;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::cerr << "sp-bench-kernels-gpu: no CUDA device\n";
    return 2;
  }
  try {
    run(options);
  } catch (const std::exception &error) {
    std::cerr << "sp-bench-kernels-gpu: " << error.what() << "\n";
    return 1;
  }
  return 0;
}
