#include "sp/torch_layer/paired_interval.h"

#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace sp::torch_layer {

namespace {

// P(0 <= T <= x) for x >= 0: the density is smooth and bounded, so composite Simpson on
// 2048 panels over [0, x] is exact to well below the quantile's tolerance for the x that
// bisection visits (|x| < 1e4, where heavy tails put the 1-dof quantiles).
double t_probability_from_zero(double x, double dof) {
  const double log_norm = std::lgamma((dof + 1.0) / 2.0) - std::lgamma(dof / 2.0) - 0.5 * std::log(dof * M_PI);
  const auto density = [&](double t) { return std::exp(log_norm - (dof + 1.0) / 2.0 * std::log1p(t * t / dof)); };
  // Substituting t = tan(u) flattens the 1-dof tail, so one panel count serves every dof.
  const double end = std::atan(x);
  constexpr int kPanels = 2048;
  const double h = end / kPanels;
  double sum = 0.0;
  for (int i = 0; i <= kPanels; ++i) {
    const double u = i * h;
    const double c = std::cos(u);
    const double value = density(std::tan(u)) / (c * c);
    sum += value * (i == 0 || i == kPanels ? 1.0 : (i % 2 == 1 ? 4.0 : 2.0));
  }
  return sum * h / 3.0;
}

}  // namespace

double student_t_quantile(double p, double dof) {
  if (!(p > 0.0 && p < 1.0)) throw std::invalid_argument("student_t_quantile: p must lie in (0, 1)");
  if (!(dof >= 1.0) || !std::isfinite(dof)) {
    throw std::invalid_argument("student_t_quantile: the degrees of freedom must be finite and at least 1");
  }
  if (p == 0.5) return 0.0;
  const double target = std::fabs(p - 0.5);
  double low = 0.0, high = 1.0;
  while (t_probability_from_zero(high, dof) < target) {
    high *= 2.0;
    if (high > 1e12) throw std::invalid_argument("student_t_quantile: p is too close to 0 or 1 to resolve");
  }
  for (int i = 0; i < 200 && high - low > 1e-12 * high; ++i) {
    const double mid = 0.5 * (low + high);
    (t_probability_from_zero(mid, dof) < target ? low : high) = mid;
  }
  const double x = 0.5 * (low + high);
  return p < 0.5 ? -x : x;
}

PairedInterval paired_interval(const std::vector<double>& differences, double confidence) {
  if (differences.empty()) throw std::invalid_argument("paired_interval: no differences");
  if (!(confidence > 0.0 && 0.5 + confidence / 2.0 < 1.0)) {
    throw std::invalid_argument("paired_interval: the confidence must lie in (0, 1), got " + std::to_string(confidence));
  }
  for (std::size_t i = 0; i < differences.size(); ++i) {
    if (!std::isfinite(differences[i])) {
      throw std::invalid_argument("paired_interval: difference " + std::to_string(i) + " is not finite");
    }
  }
  PairedInterval out;
  out.n = differences.size();
  out.mean = std::accumulate(differences.begin(), differences.end(), 0.0) / static_cast<double>(out.n);
  if (out.n < 2) {
    out.std_error = std::numeric_limits<double>::infinity();
    out.low = -std::numeric_limits<double>::infinity();
    out.high = std::numeric_limits<double>::infinity();
    return out;
  }
  double squares = 0.0;
  for (const double d : differences) squares += (d - out.mean) * (d - out.mean);
  out.std_error = std::sqrt(squares / static_cast<double>(out.n - 1) / static_cast<double>(out.n));
  const double t = student_t_quantile(0.5 + confidence / 2.0, static_cast<double>(out.n - 1));
  out.low = out.mean - t * out.std_error;
  out.high = out.mean + t * out.std_error;
  return out;
}

}  // namespace sp::torch_layer
