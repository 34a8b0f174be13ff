// What every benchmark program of the project records beside its figures, so a number in
// docs/ can be traced to the machine and the commit it came from.
#pragma once

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

namespace sp::bench {

inline std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      return colon == std::string::npos ? line : line.substr(colon + 2);
    }
  }
  return "unknown";
}

inline nlohmann::json machine_description() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return {{"hostname", host}, {"cpu", cpu_model()}, {"online_cpus", ::sysconf(_SC_NPROCESSORS_ONLN)}};
}

// Median, 10th and 90th percentile of a sample, in the sample's unit.
struct Percentiles {
  double p10 = 0, median = 0, p90 = 0;
  nlohmann::json to_json(const char* unit) const {
    return {
        {std::string("median_") + unit, median}, {std::string("p10_") + unit, p10}, {std::string("p90_") + unit, p90}};
  }
};

inline Percentiles percentiles(std::vector<double> xs) {
  if (xs.empty()) return {};
  std::sort(xs.begin(), xs.end());
  const auto at = [&](double q) { return xs[static_cast<size_t>(q * static_cast<double>(xs.size() - 1))]; };
  return {at(0.10), at(0.50), at(0.90)};
}

}  // namespace sp::bench
