#include "sp/torch_layer/collectives.h"

#include <cstdlib>
#include <limits>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace sp::torch_layer {

namespace detail {
std::string collective_failure(int rank, int size, const std::string& what, const std::string& why) {
  // c10d's messages carry a C++ backtrace after the first line; the first line says it.
  const std::string first_line = why.substr(0, why.find('\n'));
  return fmt::format(
      "rank {} of {}: the collective '{}' failed (another rank died, stalled or left, or the timeout passed): {}", rank,
      size, what, first_line);
}
}  // namespace detail

namespace {

std::int64_t integer_variable(const char* name, std::int64_t min, std::int64_t max, std::int64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (*end != '\0' || value < min || value > max) {
    throw std::invalid_argument(
        fmt::format("environment variable {}='{}': expected an integer in [{}, {}]", name, text, min, max));
  }
  return value;
}

}  // namespace

std::shared_ptr<Collectives> gloo_from_environment(std::chrono::milliseconds timeout) {
  const std::int64_t size = integer_variable("WORLD_SIZE", 1, 1 << 16, 1);
  if (size == 1) return nullptr;
  if (std::getenv("RANK") == nullptr) {
    throw std::invalid_argument(fmt::format("environment variable WORLD_SIZE={} is set but RANK is not", size));
  }
  const std::int64_t rank = integer_variable("RANK", 0, size - 1, 0);
  const char* address = std::getenv("MASTER_ADDR");
  const std::string host = address != nullptr && *address != '\0' ? address : "127.0.0.1";
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(integer_variable("MASTER_PORT", 1, 65535, 29500));
  // Under torchrun the agent already serves the store at MASTER_PORT (it says so in
  // TORCHELASTIC_USE_AGENT_STORE): every rank joins it as a client.
  const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  store_options.isServer = rank == 0 && !(agent_store != nullptr && std::string(agent_store) == "True");
  store_options.numWorkers = static_cast<std::size_t>(size);
  store_options.waitWorkers = true;
  store_options.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    // Under a prefix of its own, apart from the agent's rendezvous keys.
    // Per torchrun attempt: a restarted run must not meet the previous attempt's addresses.
    const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
    store =
        c10::make_intrusive<c10d::PrefixStore>(fmt::format("selective_precision/attempt_{}", attempt ? attempt : "0"),
                                               c10::make_intrusive<c10d::TCPStore>(host, store_options));
  } catch (const std::exception& e) {
    throw CollectiveError(detail::collective_failure(
        static_cast<int>(rank), static_cast<int>(size),
        fmt::format("rendezvous at {}:{} (MASTER_ADDR, MASTER_PORT)", host, store_options.port), e.what()));
  }
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  const char* interface = std::getenv("GLOO_SOCKET_IFNAME");
  options->devices.push_back(interface != nullptr && *interface != '\0'
                                 ? c10d::ProcessGroupGloo::createDeviceForInterface(interface)
                                 : c10d::ProcessGroupGloo::createDefaultDevice());
  try {
    return over_process_group(
        c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank), static_cast<int>(size), options));
  } catch (const std::exception& e) {
    throw CollectiveError(
        detail::collective_failure(static_cast<int>(rank), static_cast<int>(size), "Gloo group setup", e.what()));
  }
}

}  // namespace sp::torch_layer
