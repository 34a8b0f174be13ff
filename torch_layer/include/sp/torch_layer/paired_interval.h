#pragma once
// The confidence interval of a paired mean, the statistics of StreamedModel::compare_routes(),
// free of LibTorch so that they are checked against published tables alone.

#include <cstddef>
#include <vector>

namespace sp::torch_layer {

// The mean of n paired differences, its standard error and a two-sided interval from Student's t
// with n - 1 degrees of freedom. With n < 2 the interval is unbounded (infinite bounds): one
// draw says nothing of its spread.
struct PairedInterval {
  std::size_t n = 0;
  double mean = 0.0;
  double std_error = 0.0;
  double low = 0.0;
  double high = 0.0;
};

// Throws std::invalid_argument for an empty `differences`, a non-finite one, or a confidence
// outside (0, 1).
PairedInterval paired_interval(const std::vector<double>& differences, double confidence);

// The p-quantile of Student's t with `dof` degrees of freedom (dof >= 1, 0 < p < 1), to about
// 1e-9: the t density integrated by Simpson's rule, inverted by bisection.
double student_t_quantile(double p, double dof);

}  // namespace sp::torch_layer
