// sp-bench-optimizer: the host optimizer of full mode, per step and per block, against the
// memory bandwidth measured in the same run (a STREAM triad, a[i] = b[i] + s * c[i]).
//
// One "block" is a GPT block's four weight matrices at width d (12 d^2 fp32 masters), each
// with its gradient and two AdamW moments. Per precision of the block's next transfer image
// (BF16, INT8 with groups of 64, NF4 with groups of 64) it times:
//   fused    sp::kernels::adamw_update_slab: the update and the image in one sweep
//   unfused  sp::kernels::adamw_update on each matrix, then build_slab from the masters (what
//            the trainer did before; the fused pass's reference)
//   torch    torch::optim::AdamW::step() over the same masters (its gradients written scaled by
//            the clipping factor, which the kernels apply on the fly), then build_slab
// Bandwidth is counted the STREAM way, bytes the algorithm must move whatever the path:
//   triad: 12 bytes per element; optimizer: 16 read (master, grad, two moments) + 12 written
//   (master, moments) per element + the image's bytes.
// Every path's figure uses the same byte count, so the ratios between paths are time ratios.
// A second limit, "same traffic", runs the optimizer's loads and stores without its arithmetic:
// a triad writes a fresh array (the write-allocate reads it too, uncounted), the optimizer
// updates in place, so the triad understates what the optimizer's traffic can reach.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_cli.h"
#include "bench_report.h"
#include "sp/kernels/adamw.h"
#include "sp/kernels/slab.h"

namespace {

namespace kn = sp::kernels;

struct Options {
  std::string output = "bench/results/optimizer-cpu.json";
  std::string commit = "unknown";
  std::uint64_t d_model = 1024;
  int repeats = 7;
  unsigned threads = 0;
};

// Times every body once per round, in turn, for `repeats` rounds after one untimed round, and
// returns each body's median. This VM's memory bandwidth drifts by 2x over tens of seconds;
// interleaving puts every path in the same slow and fast periods, so their ratios hold.
std::vector<double> interleaved_medians(int repeats, const std::vector<std::function<void()>> &bodies) {
  std::vector<std::vector<double>> seconds(bodies.size());
  for (int round = -1; round < repeats; ++round) {
    for (std::size_t b = 0; b < bodies.size(); ++b) {
      const auto start = std::chrono::steady_clock::now();
      bodies[b]();
      if (round >= 0) {
        seconds[b].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
    }
  }
  std::vector<double> medians;
  for (std::vector<double> &s : seconds) medians.push_back(sp::bench::percentiles(s).median);
  return medians;
}

// Splits [0, n) over `threads` threads, as the kernels do (contiguous ranges).
void parallel(std::size_t n, unsigned threads, const std::function<void(std::size_t, std::size_t)> &body) {
  std::vector<std::thread> workers;
  const std::size_t per = (n + threads - 1) / threads;
  for (unsigned t = 1; t < threads; ++t) {
    const std::size_t begin = std::min(n, t * per), end = std::min(n, begin + per);
    workers.emplace_back([&body, begin, end] { body(begin, end); });
  }
  body(0, std::min(n, per));
  for (std::thread &w : workers) w.join();
}

// The memory limits, compiled like the kernels (-O3, AVX-512/AVX2/baseline clones), so that the
// ratios compare memory traffic rather than code generation.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SP_BENCH_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SP_BENCH_CLONES
#endif

SP_BENCH_CLONES void triad_range(float *__restrict a, const float *__restrict b, const float *__restrict c, float s,
                                 std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

// The optimizer's own traffic without its arithmetic: three arrays updated in place from a
// fourth (16 bytes read, 12 written per element), plus a bf16 write-out.
SP_BENCH_CLONES void same_traffic_range(float *__restrict w, float *__restrict m, float *__restrict v,
                                        const float *__restrict g, std::uint16_t *__restrict out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    m[i] += g[i];
    v[i] += g[i];
    w[i] += g[i];
    out[i] = static_cast<std::uint16_t>(i);
  }
}

// The limits' own buffers: a triad's three arrays and the same-traffic loop's five.
struct LimitBuffers {
  std::vector<float> a, b, c, w, m, v, g;
  std::vector<std::uint16_t> out;
  explicit LimitBuffers(std::size_t n)
      : a(n), b(n, 1.0f), c(n, 2.0f), w(n, 1.0f), m(n, 0.0f), v(n, 0.0f), g(n, 1e-3f), out(n) {}
  void triad(unsigned threads) {
    parallel(a.size(), threads, [&](std::size_t begin, std::size_t end) {
      triad_range(a.data() + begin, b.data() + begin, c.data() + begin, 3.0f, end - begin);
    });
  }
  void same_traffic(unsigned threads) {
    parallel(w.size(), threads, [&](std::size_t begin, std::size_t end) {
      same_traffic_range(w.data() + begin, m.data() + begin, v.data() + begin, g.data() + begin, out.data() + begin,
                         end - begin);
    });
  }
};

struct AlignedFree {
  void operator()(std::uint8_t *p) const { std::free(p); }
};

// The block's parameters as torch tensors (so torch's AdamW steps the very same memory), with
// moments of our own for the kernels' paths.
struct Block {
  std::vector<kn::TensorShape> shapes;
  std::vector<torch::Tensor> masters, grads, exp_avg, exp_avg_sq;

  explicit Block(std::uint64_t d) : shapes{{3 * d, d}, {d, d}, {4 * d, d}, {d, 4 * d}} {
    torch::manual_seed(1);
    for (const kn::TensorShape &s : shapes) {
      const std::vector<std::int64_t> size = {static_cast<std::int64_t>(s.rows), static_cast<std::int64_t>(s.cols)};
      masters.push_back(torch::randn(size) * 0.02);
      grads.push_back(torch::randn(size) * 1e-3);
      exp_avg.push_back(torch::zeros(size));
      exp_avg_sq.push_back(torch::zeros(size));
    }
  }
  std::size_t elements() const {
    std::size_t n = 0;
    for (const kn::TensorShape &s : shapes) n += s.rows * s.cols;
    return n;
  }
  std::vector<kn::AdamWTensor> tensors() {
    std::vector<kn::AdamWTensor> out;
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      out.push_back(kn::AdamWTensor{masters[i].data_ptr<float>(), grads[i].data_ptr<float>(),
                                    exp_avg[i].data_ptr<float>(), exp_avg_sq[i].data_ptr<float>(), shapes[i], true});
    }
    return out;
  }
  std::vector<kn::SlabTensorSource> sources() {
    std::vector<kn::SlabTensorSource> out;
    for (std::size_t i = 0; i < shapes.size(); ++i) out.push_back({masters[i].data_ptr<float>(), shapes[i]});
    return out;
  }
};

void run(const Options &options) {
  const unsigned all = options.threads != 0 ? options.threads : std::max(1u, std::thread::hardware_concurrency());
  std::vector<unsigned> thread_counts = {1u};
  if (all > 1) thread_counts.push_back(all);

  Block block(options.d_model);
  const std::size_t n = block.elements();
  const kn::AdamWHyperparameters hyper{0.9, 0.95, 1e-8, 0.1};
  const double lr = 3e-3, grad_scale = 0.5;
  std::int64_t t = 0;  // the step count goes on across repetitions, as in training
  const auto next_step = [&] { return kn::make_adamw_step(hyper, lr, ++t, grad_scale); };

  const std::vector<std::pair<std::string, kn::SlabEncoding>> encodings = {
      {"bf16", {kn::SlabPrecision::kBf16, 0, kn::Rounding::kNearestEven, 0}},
      {"int8_g64", {kn::SlabPrecision::kInt8, 64, kn::Rounding::kNearestEven, 0}},
      {"nf4_g64", {kn::SlabPrecision::kNf4, 64, kn::Rounding::kNearestEven, 0}}};
  std::uint64_t capacity = 0;
  for (const auto &[name, encoding] : encodings) {
    capacity = std::max(capacity, kn::slab_image_bytes(encoding, block.shapes.data(), block.shapes.size()));
  }
  std::unique_ptr<std::uint8_t[], AlignedFree> image(
      static_cast<std::uint8_t *>(std::aligned_alloc(256, (capacity + 255) / 256 * 256)));
  std::memset(image.get(), 0, (capacity + 255) / 256 * 256);

  LimitBuffers limits(n);
  nlohmann::json results = nlohmann::json::array();
  nlohmann::json targets = nlohmann::json::array();
  for (const unsigned threads : thread_counts) {
    torch::set_num_threads(static_cast<int>(threads));
    const kn::CpuExec exec{kn::CpuImpl::kVectorized, threads};
    // Torch steps the same masters; its .grad is a buffer of its own, refilled each time with
    // the scaled gradient (the pass clipping costs it), so the gradients the kernels read stay
    // as they are instead of shrinking into subnormals round after round.
    std::vector<torch::Tensor> params;
    for (std::size_t i = 0; i < block.masters.size(); ++i) {
      torch::Tensor p = block.masters[i];
      p.mutable_grad() = torch::empty_like(block.grads[i]);
      params.push_back(p);
    }
    torch::optim::AdamW torch_adamw(params, torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));

    // Round by round: the two limits, then per image the fused, unfused and torch paths.
    std::vector<std::function<void()>> bodies = {[&] { limits.triad(threads); },
                                                 [&] { limits.same_traffic(threads); }};
    for (const auto &[name, encoding] : encodings) {
      const kn::SlabEncoding e = encoding;
      bodies.push_back([&, e] {
        const std::vector<kn::AdamWTensor> tensors = block.tensors();
        kn::adamw_update_slab(e, next_step(), tensors.data(), tensors.size(), image.get(), capacity, exec);
      });
      bodies.push_back([&, e] {
        const kn::AdamWStep step = next_step();
        for (const kn::AdamWTensor &tensor : block.tensors()) kn::adamw_update(step, tensor, exec);
        const std::vector<kn::SlabTensorSource> sources = block.sources();
        kn::build_slab(e, sources.data(), sources.size(), image.get(), capacity, exec);
      });
      bodies.push_back([&, e] {
        torch::NoGradGuard no_grad;
        for (std::size_t i = 0; i < params.size(); ++i) {
          torch::Tensor grad = params[i].mutable_grad();
          torch::mul_out(grad, block.grads[i], grad_scale);  // the clipping factor
        }
        torch_adamw.step();
        const std::vector<kn::SlabTensorSource> sources = block.sources();
        kn::build_slab(e, sources.data(), sources.size(), image.get(), capacity, exec);
      });
    }
    const std::vector<double> medians = interleaved_medians(options.repeats, bodies);
    const double triad = 12.0 * static_cast<double>(n) / medians[0];
    const double same_traffic = 30.0 * static_cast<double>(n) / medians[1];
    results.push_back({{"path", "triad"}, {"threads", threads}, {"gb_per_s", triad / 1e9}});
    results.push_back({{"path", "same_traffic"}, {"threads", threads}, {"gb_per_s", same_traffic / 1e9}});
    std::printf("triad                   %u thr  %7.2f GB/s   same traffic without the arithmetic %7.2f GB/s\n", threads,
                triad / 1e9, same_traffic / 1e9);

    for (std::size_t k = 0; k < encodings.size(); ++k) {
      const std::string &name = encodings[k].first;
      const kn::SlabEncoding &encoding = encodings[k].second;
      const double fused = medians[2 + 3 * k], unfused = medians[3 + 3 * k], torch_path = medians[4 + 3 * k];
      const std::uint64_t image_bytes = kn::slab_image_bytes(encoding, block.shapes.data(), block.shapes.size());
      const double bytes = 28.0 * static_cast<double>(n) + static_cast<double>(image_bytes);
      const double fused_gbs = bytes / fused / 1e9;
      const nlohmann::json row = {{"image", name},
                                  {"threads", threads},
                                  {"elements", n},
                                  {"bytes_per_step", bytes},
                                  {"image_bytes", image_bytes},
                                  {"fused_seconds", fused},
                                  {"unfused_seconds", unfused},
                                  {"torch_adamw_then_quantize_seconds", torch_path},
                                  {"fused_gb_per_s", fused_gbs},
                                  {"unfused_gb_per_s", bytes / unfused / 1e9},
                                  {"torch_gb_per_s", bytes / torch_path / 1e9},
                                  {"fused_ratio_to_triad", fused_gbs * 1e9 / triad},
                                  {"fused_ratio_to_same_traffic", fused_gbs * 1e9 / same_traffic},
                                  {"fused_speedup_over_unfused", unfused / fused},
                                  {"fused_speedup_over_torch", torch_path / fused}};
      results.push_back(row);
      std::printf(
          "%-9s %u thr  fused %6.2f GB/s (triad x%.2f, same traffic x%.2f)  unfused x%.2f slower  torch+quantize "
          "x%.2f slower\n",
          name.c_str(), threads, fused_gbs, fused_gbs * 1e9 / triad, fused_gbs * 1e9 / same_traffic, unfused / fused,
          torch_path / fused);
      if (threads == all) {
        targets.push_back({{"image", name},
                           {"threads", threads},
                           {"fused_ratio_to_triad", fused_gbs * 1e9 / triad},
                           {"target_ratio_to_triad", 0.60},
                           {"meets_triad_target", fused_gbs * 1e9 / triad >= 0.60},
                           {"fused_speedup_over_torch", torch_path / fused},
                           {"target_speedup_over_torch", 3.0},
                           {"meets_torch_target", torch_path / fused >= 3.0}});
      }
    }
  }
  const nlohmann::json report = {{"benchmark", "sp-bench-optimizer"},
                                 {"commit", options.commit},
                                 {"machine", sp::bench::machine_description()},
                                 {"d_model", options.d_model},
                                 {"repeats", options.repeats},
                                 {"block_shapes", "qkv 3d x d, proj d x d, fc 4d x d, fc2 d x 4d"},
                                 {"torch_version", TORCH_VERSION},
                                 {"bytes_model",
                                  "triad 12 B/element; optimizer 16 B read + 12 B written per element + image bytes, the "
                                  "same count for every path"},
                                 {"results", results},
                                 {"targets", targets}};
  sp::bench::write_report(options.output, report);
  std::cout << "wrote " << options.output << "\n";
}

}  // namespace

int main(int argc, char **argv) {
  Options options;
  CLI::App app{"The host optimizer (AdamW + transfer image) against a STREAM triad measured in the same run"};
  sp::bench::add_report_options(app, options.output, options.commit);
  app.add_option("--d-model", options.d_model, "block width d: the block holds 12 d^2 parameters")
      ->check(CLI::Range(64, 16384))
      ->capture_default_str();
  app.add_option("--repeats", options.repeats, "timed repetitions per path (median reported)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--threads", options.threads, "threads for the multi-threaded runs (0: all cores)")
      ->check(CLI::Range(0u, 1024u))
      ->capture_default_str();
  if (const int exit_code = sp::bench::parse_command_line(app, argc, argv); exit_code >= 0) return exit_code;
  try {
    run(options);
  } catch (const std::bad_alloc &) {
    std::cerr << "sp-bench-optimizer: not enough memory for --d-model " << options.d_model << "; lower it\n";
    return 2;
  } catch (const std::exception &error) {
    std::cerr << "sp-bench-optimizer: " << error.what() << "\n";
    return 1;
  }
  return 0;
}
