// StreamedModel::compare_routes: what an allocation of routes costs, measured forward only on
// the host's batches through its own closure, with a confidence interval.

#include <cmath>
#include <mutex>

#include <ATen/Context.h>
#include <fmt/ranges.h>

#include "streamed_model_impl.h"

namespace sp::torch_layer {

namespace {

std::string describe(const torch::Tensor& t) {
  if (!t.defined()) return "undefined";
  return fmt::format("a {} tensor of shape [{}]", c10::toString(t.scalar_type()), fmt::join(t.sizes(), ", "));
}

// The random streams a closure may draw from (dropout left on): the CPU's and the model's
// device's. Each allocation of a batch starts from the same state, and the host's streams are
// left as they were, as torch.utils.checkpoint leaves them.
class RandomStreams {
 public:
  explicit RandomStreams(const torch::Device& device) {
    generators_.push_back(at::globalContext().defaultGenerator(torch::kCPU));
    if (!device.is_cpu()) generators_.push_back(at::globalContext().defaultGenerator(device));
    saved_ = capture();
  }
  std::vector<torch::Tensor> capture() {
    std::vector<torch::Tensor> states;
    for (at::Generator& g : generators_) {
      const std::lock_guard<std::mutex> lock(g.mutex());
      states.push_back(g.get_state());
    }
    return states;
  }
  void put(const std::vector<torch::Tensor>& states) {
    for (std::size_t i = 0; i < generators_.size(); ++i) {
      const std::lock_guard<std::mutex> lock(generators_[i].mutex());
      generators_[i].set_state(states[i]);
    }
  }
  void restore() { put(saved_); }

 private:
  std::vector<at::Generator> generators_;
  std::vector<torch::Tensor> saved_;
};

// One batch's loss as float64 values on the host: one per example (1-D) or one (0-D).
torch::Tensor loss_values(const torch::Tensor& loss, std::size_t batch, const char* routes) {
  if (!loss.defined() || !loss.is_floating_point() || loss.dim() > 1) {
    throw std::invalid_argument(fmt::format(
        "StreamedModel::compare_routes: batch {}: the closure's loss under {} is {}; expected a floating tensor of "
        "shape [] (the batch's loss) or [examples] (one per example)",
        batch, routes, describe(loss)));
  }
  torch::Tensor values = loss.detach().to(torch::kCPU, torch::kFloat64).reshape({-1});
  if (values.numel() == 0) {
    throw std::invalid_argument(
        fmt::format("StreamedModel::compare_routes: batch {}: the closure's loss under {} holds no values", batch, routes));
  }
  if (!torch::isfinite(values).all().item<bool>()) {
    throw std::invalid_argument(
        fmt::format("StreamedModel::compare_routes: batch {}: the closure's loss under {} is not finite", batch, routes));
  }
  return values;
}

// The reference's scores of a batch as the KL needs them, computed once for every allocation
// measured against it: the softmax's log over their last dimension, as float64 rows on the host,
// and its exp.
struct ReferenceScores {
  torch::Tensor scores, log_p, p;
  explicit ReferenceScores(const torch::Tensor& s) : scores(s) {
    if (!s.defined() || s.dim() == 0) return;  // refused by kl_per_example, by name
    log_p = log_probabilities(s);
    p = log_p.exp();
  }
  static torch::Tensor log_probabilities(const torch::Tensor& s) {
    return torch::log_softmax(s.detach().to(torch::kCPU, torch::kFloat64).reshape({-1, s.size(-1)}), -1);
  }
};

// KL(b || a) of the scores' softmax over their last dimension, one value per leading index.
torch::Tensor kl_per_example(const torch::Tensor& scores_a, const ReferenceScores& reference, std::size_t batch,
                             const std::string& name_a, const char* name_b) {
  const torch::Tensor& scores_b = reference.scores;
  if (scores_a.defined() != scores_b.defined()) {
    throw std::invalid_argument(fmt::format(
        "StreamedModel::compare_routes: batch {}: the closure gave scores under one allocation and not the other",
        batch));
  }
  if (!scores_a.is_floating_point() || scores_a.dim() == 0 || scores_a.sizes() != scores_b.sizes()) {
    throw std::invalid_argument(fmt::format(
        "StreamedModel::compare_routes: batch {}: the scores are {} under {} and {} under {}; expected floating "
        "tensors of one shape, logits over their last dimension",
        batch, describe(scores_a), name_a, describe(scores_b), name_b));
  }
  const torch::Tensor a = ReferenceScores::log_probabilities(scores_a);
  const torch::Tensor& b = reference.log_p;
  const torch::Tensor& p = reference.p;
  // Where b gives no mass the term is 0 (p log p -> 0), also where both are -inf (masked logits).
  const torch::Tensor kl = torch::where(p > 0, p * (b - a), torch::zeros_like(p)).sum(-1);
  if (!torch::isfinite(kl).all().item<bool>()) {
    throw std::invalid_argument(fmt::format(
        "StreamedModel::compare_routes: batch {}: the KL of the scores is not finite: a score is NaN or +inf, or "
        "{} gives no probability (a logit of -inf) where {} gives some",
        batch, name_a, name_b));
  }
  return kl;
}

std::vector<double> values_of(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

double mean_of(const std::vector<double>& v) {
  double sum = 0.0;
  for (const double x : v) sum += x;
  return sum / static_cast<double>(v.size());
}

}  // namespace

RouteComparison StreamedModel::compare_routes(const MeasureClosure& closure, std::size_t batches,
                                              const std::vector<Precision>& routes_a,
                                              const std::vector<Precision>& routes_b, double confidence) {
  return std::move(impl_->compare_routes(closure, batches, {routes_a}, routes_b, confidence, "routes_a", "routes_b")
                       .front());
}

std::vector<RouteComparison> StreamedModel::compare_routes(const MeasureClosure& closure, std::size_t batches,
                                                           const std::vector<std::vector<Precision>>& candidates,
                                                           const std::vector<Precision>& reference,
                                                           double confidence) {
  if (candidates.empty()) throw std::invalid_argument("StreamedModel::compare_routes: no candidates to measure");
  return impl_->compare_routes(closure, batches, candidates, reference, confidence, "candidates", "reference");
}

std::vector<RouteComparison> StreamedModel::Impl::compare_routes(
    const StreamedModel::MeasureClosure& closure, std::size_t batches,
    const std::vector<std::vector<Precision>>& candidates, const std::vector<Precision>& reference, double confidence,
    const char* candidate_name, const char* reference_name) {
  Impl& m = *this;
  // One candidate is named as the caller named it; several, by their index.
  const auto name_of = [&](std::size_t k) {
    return candidates.size() == 1 ? std::string(candidate_name) : fmt::format("{}[{}]", candidate_name, k);
  };
  if (!closure) throw std::invalid_argument("StreamedModel::compare_routes: no closure");
  const auto check_length = [&](const std::vector<Precision>& routes, const std::string& name) {
    if (routes.size() != m.blocks.size()) {
      throw std::invalid_argument(fmt::format("StreamedModel::compare_routes: {} holds {} routes; expected one per "
                                              "block ({})",
                                              name, routes.size(), m.blocks.size()));
    }
  };
  for (std::size_t k = 0; k < candidates.size(); ++k) check_length(candidates[k], name_of(k));
  check_length(reference, reference_name);
  if (batches == 0) throw std::invalid_argument("StreamedModel::compare_routes: no batches to measure on");
  if (!(confidence > 0.0 && 0.5 + confidence / 2.0 < 1.0)) {
    throw std::invalid_argument(
        fmt::format("StreamedModel::compare_routes: confidence {} is outside (0, 1)", confidence));
  }
  if (m.step_state.in_step())
    throw std::logic_error("StreamedModel::compare_routes: measure between steps, not inside one");
  if (m.evaluation.measuring())
    throw std::logic_error("StreamedModel::compare_routes: called from inside a measurement's closure");

  std::vector<RouteComparison> out(candidates.size());
  std::uint64_t reference_bytes = 0, all_bf16_bytes = 0;
  for (std::uint32_t b = 0; b < m.blocks.size(); ++b) {
    reference_bytes += m.engines.train->image_bytes(b, reference[b]);
    all_bf16_bytes += m.engines.train->image_bytes(b, Precision::bf16);
  }
  for (std::size_t k = 0; k < candidates.size(); ++k) {
    out[k].routes_a = candidates[k];
    out[k].routes_b = reference;
    out[k].confidence = confidence;
    for (std::uint32_t b = 0; b < m.blocks.size(); ++b)
      out[k].bytes_a += m.engines.train->image_bytes(b, candidates[k][b]);
    out[k].bytes_b = reference_bytes;
    out[k].bytes_all_bf16 = all_bf16_bytes;
  }

  torch::NoGradGuard no_grad;
  RandomStreams random(m.options.device);
  // Whatever the closure leaves (an open evaluation pass, pins, images shared for a pinned
  // route, the random state) is put back, also when it throws. Each step that fails is logged
  // and the next still runs: the caller gets the measurement's own error, and a layer that
  // trains again.
  const auto end_measurement = [&] {
    const auto attempt = [&](const char* what, const auto& step) {
      try {
        step();
      } catch (const std::exception& e) {
        m.log->warn("StreamedModel::compare_routes: {}: {}", what, e.what());
      }
    };
    attempt("closing the open evaluation pass", [&] { m.evaluation.close_open_pass(m.step_state); });
    m.evaluation.unpin();
    // The pins of the last pass stand until the next evaluation: dropped now, so that an image
    // rebuilt in between is built for the route the block takes next.
    attempt("dropping the pins", [&] { m.engines.eval->policy_bridge().begin_step(); });
    if (m.shards.sharded()) {
      for (BlockGroup& block : m.blocks) block.mark_evaluation_image_stale();
    }
    attempt("restoring the random state", [&] { random.restore(); });
  };
  // One pass of the closure pinned to `routes`, and the bytes it moved.
  const auto measure = [&](const std::vector<Precision>& routes, std::size_t batch) {
    ad::RuntimeLimitHints pins;
    for (std::uint32_t b = 0; b < m.blocks.size(); ++b) pins.block_precision_map[b] = routes[b];
    m.wait_for_updates();
    m.share_eval_images(routes);
    const std::int64_t passes_before = m.evaluation.engine_steps();
    const std::uint64_t bytes_before = m.evaluation.measurement_bytes();
    m.evaluation.pin(std::move(pins));
    MeasuredBatch result = closure(batch);
    m.evaluation.close_open_pass(m.step_state);
    m.evaluation.unpin();
    if (m.evaluation.engine_steps() == passes_before) {
      throw std::invalid_argument(fmt::format(
          "StreamedModel::compare_routes: closure({}) called no streamed block: it must compute its loss through the "
          "model",
          batch));
    }
    return std::pair{std::move(result), m.evaluation.measurement_bytes() - bytes_before};
  };

  // Per candidate: the sum and the batch means of its loss; the reference's, once.
  std::vector<double> sums_a(candidates.size(), 0.0);
  std::vector<std::vector<double>> batch_means_a(candidates.size());
  std::vector<double> batch_means_b;
  double sum_b = 0.0;
  std::size_t examples = 0;
  bool per_example = true, with_scores = false;
  try {
    for (std::size_t i = 0; i < batches; ++i) {
      const std::vector<torch::Tensor> state = random.capture();
      const auto [b, reference_batch_bytes] = measure(reference, i);
      const torch::Tensor loss_b = loss_values(b.loss, i, reference_name);
      sum_b += loss_b.sum().item<double>();
      batch_means_b.push_back(loss_b.mean().item<double>());
      const ReferenceScores reference_scores(b.scores);
      for (std::size_t k = 0; k < candidates.size(); ++k) {
        const std::string name = name_of(k);
        RouteComparison& c = out[k];
        random.put(state);
        const auto [a, candidate_bytes] = measure(candidates[k], i);
        c.h2d_bytes += candidate_bytes + reference_batch_bytes;
        const torch::Tensor loss_a = loss_values(a.loss, i, name.c_str());
        if (a.loss.dim() == 1 && b.loss.dim() == 1 && loss_a.numel() == loss_b.numel()) {
          const std::vector<double> d = values_of(loss_a - loss_b);
          c.example_loss_differences.insert(c.example_loss_differences.end(), d.begin(), d.end());
        } else if (a.loss.dim() != b.loss.dim() || a.loss.dim() == 1) {
          throw std::invalid_argument(
              fmt::format("StreamedModel::compare_routes: batch {}: the loss is {} under {} and {} under {}; the "
                          "allocations must be measured on the same examples",
                          i, describe(a.loss), name, describe(b.loss), reference_name));
        } else {
          per_example = false;
        }
        sums_a[k] += loss_a.sum().item<double>();
        batch_means_a[k].push_back(loss_a.mean().item<double>());
        c.batch_loss_differences.push_back(batch_means_a[k].back() - batch_means_b.back());
        if (i == 0 && k == 0) with_scores = a.scores.defined() || b.scores.defined();
        if (with_scores != (a.scores.defined() || b.scores.defined())) {
          throw std::invalid_argument(fmt::format(
              "StreamedModel::compare_routes: batch {}: the closure gave scores for some batches and not others", i));
        }
        if (with_scores) {
          const std::vector<double> kl = values_of(kl_per_example(a.scores, reference_scores, i, name, reference_name));
          c.batch_kl.push_back(mean_of(kl));
          c.example_kl.insert(c.example_kl.end(), kl.begin(), kl.end());
        }
      }
      examples += static_cast<std::size_t>(loss_b.numel());
    }
  } catch (...) {
    end_measurement();
    throw;
  }
  end_measurement();

  for (std::size_t k = 0; k < candidates.size(); ++k) {
    RouteComparison& c = out[k];
    c.paired_over_examples = per_example;
    if (!per_example) c.example_loss_differences.clear();
    c.loss_a = per_example ? sums_a[k] / static_cast<double>(examples) : mean_of(batch_means_a[k]);
    c.loss_b = per_example ? sum_b / static_cast<double>(examples) : mean_of(batch_means_b);
    c.loss_difference =
        paired_interval(per_example ? c.example_loss_differences : c.batch_loss_differences, confidence);
    if (with_scores) c.kl = paired_interval(c.example_kl, confidence);
  }
  return out;
}

std::uint64_t StreamedModel::measurement_h2d_bytes() const { return impl_->evaluation.measurement_bytes(); }

}  // namespace sp::torch_layer
