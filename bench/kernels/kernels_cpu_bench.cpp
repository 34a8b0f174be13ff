// sp-bench-kernels-cpu: throughput of every CPU kernel as a ratio to memcpy bandwidth measured
// in the same run, on one thread and on all threads. Writes JSON (atomically).
//
// Bandwidth of a kernel = (bytes it reads + bytes it writes) / median time. Two ratios:
//   ratio_to_memcpy       kernel bandwidth / memcpy bandwidth (memcpy reads n and writes n bytes)
//   ratio_to_memcpy_read  (bytes read / time) / (memcpy bytes read / time): for read-only
//                         kernels (gradient moments, relative error), the issue's "memcpy
//                         read bandwidth" comparison.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <new>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_cli.h"
#include "bench_report.h"
#include "sp/kernels/bf16.h"
#include "sp/kernels/moments.h"
#include "sp/kernels/nf4.h"
#include "sp/kernels/quantize.h"
#include "sp/kernels/relative_error.h"
#include "sp/kernels/slab.h"

namespace {

using sp::kernels::CpuExec;
using sp::kernels::CpuImpl;
using sp::kernels::DType;

struct Options {
  std::string output = "bench/results/kernels-cpu.json";
  std::string commit = "unknown";
  std::size_t rows = 4096;
  std::size_t cols = 4096;
  int repeats = 9;
  unsigned threads = 0;
};

double median_seconds(int repeats, const std::function<void()> &body) {
  body();  // warm-up: page faults and caches
  std::vector<double> seconds;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    body();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return sp::bench::percentiles(seconds).median;
}

struct Limit {
  double bytes_per_s = 0;       // memcpy: (read + written) / time
  double read_bytes_per_s = 0;  // memcpy: read / time
};

class Report {
 public:
  Report(const Options &options, int repeats) : options_(options), repeats_(repeats) {}

  Limit measure_memcpy(std::size_t bytes, unsigned threads) {
    std::vector<uint8_t> src(bytes, 1), dst(bytes, 0);
    const double s = median_seconds(repeats_, [&] {
      const std::size_t per = (bytes + threads - 1) / threads;
      std::vector<std::thread> workers;
      for (unsigned t = 1; t < threads; ++t) {
        const std::size_t begin = std::min(bytes, t * per);
        const std::size_t end = std::min(bytes, begin + per);
        workers.emplace_back([&, begin, end] { std::memcpy(dst.data() + begin, src.data() + begin, end - begin); });
      }
      std::memcpy(dst.data(), src.data(), std::min(bytes, per));
      for (auto &w : workers) w.join();
    });
    Limit limit{2.0 * static_cast<double>(bytes) / s, static_cast<double>(bytes) / s};
    memcpy_[threads] = limit;
    results_.push_back({{"kernel", "memcpy"},
                        {"threads", threads},
                        {"bytes", bytes},
                        {"median_s", s},
                        {"gb_per_s", limit.bytes_per_s / 1e9}});
    return limit;
  }

  void add(const std::string &kernel, const std::string &impl, unsigned threads, std::size_t elements,
           double bytes_read, double bytes_written, const std::function<void()> &body,
           const char *target_kind = nullptr, double target = 0) {
    const double s = median_seconds(repeats_, body);
    const Limit &limit = memcpy_.at(threads);
    const double bw = (bytes_read + bytes_written) / s;
    const double ratio = bw / limit.bytes_per_s;
    const double read_ratio = (bytes_read / s) / limit.read_bytes_per_s;
    nlohmann::json entry = {{"kernel", kernel},
                            {"impl", impl},
                            {"threads", threads},
                            {"elements", elements},
                            {"bytes_read", bytes_read},
                            {"bytes_written", bytes_written},
                            {"median_s", s},
                            {"gb_per_s", bw / 1e9},
                            {"ratio_to_memcpy", ratio},
                            {"ratio_to_memcpy_read", read_ratio}};
    if (target_kind != nullptr) {
      const double measured = std::string(target_kind) == "ratio_to_memcpy_read" ? read_ratio : ratio;
      entry["target"] = {{"metric", target_kind}, {"at_least", target}, {"met", measured >= target}};
    }
    std::printf(
        "%-34s %-10s %2u thr  %7.2f GB/s  memcpy x%.2f  read x%.2f%s\n", kernel.c_str(), impl.c_str(), threads,
        bw / 1e9, ratio, read_ratio,
        target_kind == nullptr ? "" : (entry["target"]["met"].get<bool>() ? "  [target met]" : "  [target MISSED]"));
    results_.push_back(entry);
  }

  void write() const {
    const nlohmann::json doc = {{"benchmark", "sp-bench-kernels-cpu"},
                                {"commit", options_.commit},
                                {"machine", sp::bench::machine_description()},
                                {"repeats", repeats_},
                                {"shape", {{"rows", options_.rows}, {"cols", options_.cols}}},
                                {"results", results_}};
    sp::bench::write_report(options_.output, doc);
  }

 private:
  const Options &options_;
  int repeats_;
  std::map<unsigned, Limit> memcpy_;
  nlohmann::json results_ = nlohmann::json::array();
};

void run(const Options &options) {
  const std::size_t rows = options.rows, cols = options.cols, n = rows * cols;
  std::mt19937 rng(1);
  std::normal_distribution<float> gauss(0.0f, 0.02f);
  std::vector<float> weights(n);
  for (float &w : weights) w = gauss(rng);
  std::vector<uint16_t> bf16(n);
  sp::kernels::fp32_to_bf16(weights.data(), bf16.data(), n);
  std::vector<int8_t> codes(n);
  std::vector<float> scales(sp::kernels::scale_count(rows, cols, 32));
  std::vector<float> fp32_out(n);
  std::vector<uint8_t> nf4_codes(sp::kernels::nf4_code_bytes(rows, cols));
  std::vector<uint16_t> nf4_scales(sp::kernels::nf4_scale_count(rows, cols, 32));
  std::vector<uint16_t> bf16_out(n);

  Report report(options, options.repeats);
  const unsigned all = options.threads != 0 ? options.threads : std::max(1u, std::thread::hardware_concurrency());
  std::vector<unsigned> thread_counts = {1u};
  if (all > 1) thread_counts.push_back(all);
  const double f32 = 4.0 * static_cast<double>(n), b16 = 2.0 * static_cast<double>(n), i8 = static_cast<double>(n);
  const double row_scales = 4.0 * static_cast<double>(rows);
  const double g128_scales = 4.0 * static_cast<double>(sp::kernels::scale_count(rows, cols, 128));
  const uint32_t nf4_group = sp::kernels::kNf4DefaultGroupSize;
  const double nf4_bytes = static_cast<double>(sp::kernels::nf4_code_bytes(rows, cols)) +
                           2.0 * static_cast<double>(sp::kernels::nf4_scale_count(rows, cols, nf4_group));

  for (const unsigned threads : thread_counts) {
    report.measure_memcpy(static_cast<std::size_t>(f32), threads);
    const CpuExec fast{CpuImpl::kVectorized, threads};
    const bool one = threads == 1;
    using sp::kernels::QuantizeOptions;
    using sp::kernels::Rounding;
    report.add(
        "quantize_int8 per-row fp32", "vectorized", threads, n, f32, i8 + row_scales,
        [&] {
          sp::kernels::quantize_int8(weights.data(), DType::kFloat32, rows, cols, QuantizeOptions{}, codes.data(),
                                     scales.data(), fast);
        },
        one ? "ratio_to_memcpy" : nullptr, 0.40);
    report.add(
        "quantize_int8 group-128 fp32", "vectorized", threads, n, f32, i8 + g128_scales,
        [&] {
          sp::kernels::quantize_int8(weights.data(), DType::kFloat32, rows, cols, QuantizeOptions{128}, codes.data(),
                                     scales.data(), fast);
        },
        one ? "ratio_to_memcpy" : nullptr, 0.40);
    report.add("quantize_int8 per-row bf16", "vectorized", threads, n, b16, i8 + row_scales, [&] {
      sp::kernels::quantize_int8(bf16.data(), DType::kBFloat16, rows, cols, QuantizeOptions{}, codes.data(),
                                 scales.data(), fast);
    });
    report.add("quantize_int8 per-row fp32 stochastic", "vectorized", threads, n, f32, i8 + row_scales, [&] {
      sp::kernels::quantize_int8(weights.data(), DType::kFloat32, rows, cols,
                                 QuantizeOptions{0, Rounding::kStochastic, 1}, codes.data(), scales.data(), fast);
    });
    sp::kernels::quantize_int8(weights.data(), DType::kFloat32, rows, cols, QuantizeOptions{}, codes.data(),
                               scales.data());
    report.add("dequantize_int8_to_bf16 per-row", "vectorized", threads, n, i8 + row_scales, b16, [&] {
      sp::kernels::dequantize_int8_to_bf16(codes.data(), scales.data(), rows, cols, 0, bf16_out.data(), fast);
    });
    report.add("dequantize_int8_to_fp32 per-row", "vectorized", threads, n, i8 + row_scales, f32, [&] {
      sp::kernels::dequantize_int8_to_fp32(codes.data(), scales.data(), rows, cols, 0, fp32_out.data(), fast);
    });
    // NF4, the default group of 64: codes (n / 2 bytes) + bf16 scales.
    report.add("quantize_nf4 group-64 fp32", "vectorized", threads, n, f32, nf4_bytes, [&] {
      sp::kernels::quantize_nf4(weights.data(), DType::kFloat32, rows, cols, nf4_group, nf4_codes.data(),
                                nf4_scales.data(), fast);
    });
    report.add("quantize_nf4 group-64 bf16", "vectorized", threads, n, b16, nf4_bytes, [&] {
      sp::kernels::quantize_nf4(bf16.data(), DType::kBFloat16, rows, cols, nf4_group, nf4_codes.data(),
                                nf4_scales.data(), fast);
    });
    sp::kernels::quantize_nf4(weights.data(), DType::kFloat32, rows, cols, nf4_group, nf4_codes.data(),
                              nf4_scales.data());
    report.add("dequantize_nf4_to_bf16 group-64", "vectorized", threads, n, nf4_bytes, b16, [&] {
      sp::kernels::dequantize_nf4_to_bf16(nf4_codes.data(), nf4_scales.data(), rows, cols, nf4_group, bf16_out.data(),
                                          fast);
    });
    report.add("dequantize_nf4_to_fp32 group-64", "vectorized", threads, n, nf4_bytes, f32, [&] {
      sp::kernels::dequantize_nf4_to_fp32(nf4_codes.data(), nf4_scales.data(), rows, cols, nf4_group, fp32_out.data(),
                                          fast);
    });
    report.add("fp32_to_bf16 nearest-even", "vectorized", threads, n, f32, b16,
               [&] { sp::kernels::fp32_to_bf16(weights.data(), bf16_out.data(), n, {}, fast); });
    report.add("fp32_to_bf16 stochastic", "vectorized", threads, n, f32, b16, [&] {
      sp::kernels::fp32_to_bf16(weights.data(), bf16_out.data(), n, {Rounding::kStochastic, 1}, fast);
    });
    // Gradient moments: the tensors of 4 blocks, 4 tensors each, in one call.
    std::vector<sp::kernels::GradTensor> grads;
    for (uint32_t t = 0; t < 16; ++t) grads.push_back({weights.data() + t * (n / 16), n / 16, DType::kFloat32, t / 4});
    std::vector<sp_grad_moments_v1> moments(4);
    report.add(
        "grad_moments fp32 (16 tensors, 4 blocks)", "vectorized", threads, n, f32, 0,
        [&] { sp::kernels::grad_moments(grads.data(), grads.size(), 4, moments.data(), fast); }, "ratio_to_memcpy_read",
        0.60);
    std::vector<sp::kernels::GradTensor> bf16_grads = grads;
    for (uint32_t t = 0; t < 16; ++t)
      bf16_grads[t].data = bf16.data() + t * (n / 16), bf16_grads[t].dtype = DType::kBFloat16;
    report.add(
        "grad_moments bf16 (16 tensors, 4 blocks)", "vectorized", threads, n, b16, 0,
        [&] { sp::kernels::grad_moments(bf16_grads.data(), bf16_grads.size(), 4, moments.data(), fast); },
        "ratio_to_memcpy_read", 0.60);
    report.add("relative_error fp32 vs bf16", "vectorized", threads, n, f32 + b16, 0, [&] {
      volatile double e =
          sp::kernels::relative_error(weights.data(), DType::kFloat32, bf16.data(), DType::kBFloat16, n, fast);
      (void)e;
    });
  }
  // The reference implementations, one thread, for scale.
  const CpuExec reference{CpuImpl::kReference, 1};
  report.add("quantize_int8 per-row fp32", "reference", 1, n, f32, i8 + row_scales, [&] {
    sp::kernels::quantize_int8(weights.data(), DType::kFloat32, rows, cols, {}, codes.data(), scales.data(), reference);
  });
  report.add("quantize_nf4 group-64 fp32", "reference", 1, n, f32, nf4_bytes, [&] {
    sp::kernels::quantize_nf4(weights.data(), DType::kFloat32, rows, cols, nf4_group, nf4_codes.data(),
                              nf4_scales.data(), reference);
  });
  report.add("dequantize_nf4_to_bf16 group-64", "reference", 1, n, nf4_bytes, b16, [&] {
    sp::kernels::dequantize_nf4_to_bf16(nf4_codes.data(), nf4_scales.data(), rows, cols, nf4_group, bf16_out.data(),
                                        reference);
  });
  std::vector<sp::kernels::GradTensor> grads = {{weights.data(), n, DType::kFloat32, 0}};
  sp_grad_moments_v1 moment{};
  report.add("grad_moments fp32", "reference", 1, n, f32, 0,
             [&] { sp::kernels::grad_moments(grads.data(), 1, 1, &moment, reference); });
  // A whole GPT block (d = 1024) packed into a per-row INT8 slab, as the host does per transfer.
  const uint64_t d = 1024;
  const std::vector<sp::kernels::TensorShape> shapes = {{3 * d, d}, {d, d}, {4 * d, d}, {d, 4 * d}, {1, d}, {1, d}};
  std::vector<sp::kernels::SlabTensorSource> sources;
  uint64_t elements = 0, offset = 0;
  for (const auto &s : shapes) {
    sources.push_back({weights.data() + offset, s});
    offset += s.rows * s.cols;
    elements += s.rows * s.cols;
  }
  const sp::kernels::SlabEncoding int8{sp::kernels::SlabPrecision::kInt8};
  const uint64_t image_bytes = sp::kernels::slab_image_bytes(int8, shapes.data(), shapes.size());
  std::vector<uint64_t> image((image_bytes + 7) / 8 + 64);
  auto *aligned = reinterpret_cast<uint8_t *>(image.data());
  for (const unsigned threads : thread_counts) {
    report.add("build_slab int8 per-row (GPT block d=1024)", "vectorized", threads, elements,
               4.0 * static_cast<double>(elements), static_cast<double>(image_bytes), [&] {
                 sp::kernels::build_slab(int8, sources.data(), sources.size(), aligned, image_bytes,
                                         CpuExec{CpuImpl::kVectorized, threads});
               });
  }
  const sp::kernels::SlabEncoding nf4{sp::kernels::SlabPrecision::kNf4, nf4_group};
  const uint64_t nf4_image_bytes = sp::kernels::slab_image_bytes(nf4, shapes.data(), shapes.size());
  for (const unsigned threads : thread_counts) {
    report.add("build_slab nf4 group-64 (GPT block d=1024)", "vectorized", threads, elements,
               4.0 * static_cast<double>(elements), static_cast<double>(nf4_image_bytes), [&] {
                 sp::kernels::build_slab(nf4, sources.data(), sources.size(), aligned, nf4_image_bytes,
                                         CpuExec{CpuImpl::kVectorized, threads});
               });
  }
  report.write();
  std::cout << "wrote " << options.output << "\n";
}

}  // namespace

int main(int argc, char **argv) {
  Options options;
  CLI::App app{"CPU kernel throughput against memcpy bandwidth measured in the same run"};
  sp::bench::add_report_options(app, options.output, options.commit);
  app.add_option("--rows", options.rows, "rows of the weight matrix")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--cols", options.cols, "columns of the weight matrix")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--repeats", options.repeats, "timed repetitions per kernel (median reported)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--threads", options.threads, "threads for the multi-threaded runs (0: all cores)")
      ->check(CLI::Range(0u, 1024u))
      ->capture_default_str();
  if (const int exit_code = sp::bench::parse_command_line(app, argc, argv); exit_code >= 0) return exit_code;
  constexpr std::size_t kGptBlockElements = 12 * 1024 * 1024 + 2 * 1024;  // the slab benchmark's d=1024 block
  if (options.rows * options.cols < kGptBlockElements) {
    std::cerr << "--rows x --cols must be at least " << kGptBlockElements
              << " elements (the slab benchmark packs one d=1024 GPT block from the same weights)\n";
    return 2;
  }
  try {
    run(options);
  } catch (const std::bad_alloc &) {
    std::cerr << "sp-bench-kernels-cpu: not enough memory for --rows " << options.rows << " x --cols " << options.cols
              << " (" << options.rows * options.cols << " elements, held in several formats at once); lower them\n";
    return 2;
  } catch (const std::exception &error) {
    std::cerr << "sp-bench-kernels-cpu: " << error.what() << "\n";
    return 1;
  }
  return 0;
}
