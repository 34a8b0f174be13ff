#include "sp/torch_layer/collectives.h"

#include "build_config.h"

#include <cstdlib>
#include <cstring>
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

std::vector<std::string> Collectives::exchange(const std::string& key, const std::string& mine,
                                               std::chrono::milliseconds timeout) {
  (void)timeout;  // a broadcast waits as long as the group's own timeout
  std::vector<std::string> all(static_cast<std::size_t>(size()));
  for (int root = 0; root < size(); ++root) {
    torch::Tensor length = torch::tensor({static_cast<std::int64_t>(root == rank() ? mine.size() : 0)}, torch::kInt64);
    broadcast(length, root, fmt::format("{}: the length of rank {}'s part", key, root));
    torch::Tensor bytes = torch::zeros({length.item<std::int64_t>()}, torch::kUInt8);
    if (root == rank() && !mine.empty()) std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
    if (bytes.numel() > 0) broadcast(bytes, root, fmt::format("{}: rank {}'s part", key, root));
    all[static_cast<std::size_t>(root)].assign(reinterpret_cast<const char*>(bytes.data_ptr()),
                                               static_cast<std::size_t>(bytes.numel()));
  }
  return all;
}

namespace detail {

std::vector<std::string> exchange_through_store(c10d::Store& store, int rank, int size, const std::string& key,
                                                const std::string& mine, std::chrono::milliseconds timeout) {
  const auto key_of = [&](int r) { return fmt::format("sp_exchange/{}/{}", key, r); };
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key_of(r));
  try {
    store.set(key_of(rank), std::vector<std::uint8_t>(mine.begin(), mine.end()));
    store.wait(keys, timeout);
    std::vector<std::string> all;
    for (const std::string& k : keys) {
      const std::vector<std::uint8_t> value = store.get(k);
      all.emplace_back(value.begin(), value.end());
    }
    return all;
  } catch (const std::exception& e) {
    throw CollectiveError(collective_failure(
        rank, size, fmt::format("exchange '{}' (waiting up to {} s)", key, timeout.count() / 1000), e.what()));
  }
}

}  // namespace detail

namespace {

class ByDevice final : public Collectives {
 public:
  ByDevice(std::shared_ptr<Collectives> host, std::shared_ptr<Collectives> device)
      : host_(std::move(host)), device_(std::move(device)) {}
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::unique_ptr<Pending> all_reduce(torch::Tensor tensor, Reduction op, std::string what) override {
    return of(tensor).all_reduce(std::move(tensor), op, std::move(what));
  }
  std::unique_ptr<Pending> reduce(torch::Tensor tensor, int root, Reduction op, std::string what) override {
    return of(tensor).reduce(std::move(tensor), root, op, std::move(what));
  }
  void broadcast(torch::Tensor tensor, int root, std::string what) override {
    of(tensor).broadcast(std::move(tensor), root, std::move(what));
  }
  std::vector<std::string> exchange(const std::string& key, const std::string& mine,
                                    std::chrono::milliseconds timeout) override {
    return host_->exchange(key, mine, timeout);
  }
  bool reduces_on(const torch::Device& device) const override {
    return !device.is_cpu() && device_->reduces_on(device);
  }

 private:
  Collectives& of(const torch::Tensor& tensor) const { return tensor.device().is_cpu() ? *host_ : *device_; }
  std::shared_ptr<Collectives> host_, device_;
};

}  // namespace

std::shared_ptr<Collectives> by_device(std::shared_ptr<Collectives> host, std::shared_ptr<Collectives> device) {
  if (!host || !device) throw std::invalid_argument("by_device: both groups are needed");
  if (host->rank() != device->rank() || host->size() != device->size()) {
    throw std::invalid_argument(fmt::format(
        "by_device: the host group is rank {} of {}, the device group rank {} of {}: they must span the same ranks",
        host->rank(), host->size(), device->rank(), device->size()));
  }
  return std::make_shared<ByDevice>(std::move(host), std::move(device));
}

bool nccl_available() {
#if SP_HAVE_C10D_NCCL
  return true;
#else
  return false;
#endif
}

#if !SP_HAVE_C10D_NCCL
std::shared_ptr<Collectives> nccl_group(c10::intrusive_ptr<c10d::Store>, int, int, std::chrono::milliseconds) {
  throw std::logic_error(
      "nccl_group: this build has no c10d NCCL group (LibTorch without CUDA or NCCL, or no nccl.h found when it was "
      "configured: see nccl_available())");
}
#endif

std::shared_ptr<Collectives> from_environment(std::chrono::milliseconds timeout, const torch::Device& compute_device) {
  const std::int64_t size = integer_variable("WORLD_SIZE", 1, 1 << 16, 1);
  if (size == 1) return nullptr;
  if (std::getenv("RANK") == nullptr) {
    throw std::invalid_argument(fmt::format("environment variable WORLD_SIZE={} is set but RANK is not", size));
  }
  const int rank = static_cast<int>(integer_variable("RANK", 0, size - 1, 0));
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
        rank, static_cast<int>(size),
        fmt::format("rendezvous at {}:{} (MASTER_ADDR, MASTER_PORT)", host, store_options.port), e.what()));
  }
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  const char* interface = std::getenv("GLOO_SOCKET_IFNAME");
  options->devices.push_back(interface != nullptr && *interface != '\0'
                                 ? c10d::ProcessGroupGloo::createDeviceForInterface(interface)
                                 : c10d::ProcessGroupGloo::createDefaultDevice());
  std::shared_ptr<Collectives> gloo;
  try {
    gloo = over_process_group(c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, static_cast<int>(size), options),
                              store);
  } catch (const std::exception& e) {
    throw CollectiveError(detail::collective_failure(rank, static_cast<int>(size), "Gloo group setup", e.what()));
  }
  if (!compute_device.is_cuda() || !nccl_available()) return gloo;
  try {
    return by_device(std::move(gloo), nccl_group(c10::make_intrusive<c10d::PrefixStore>("nccl", store), rank,
                                                 static_cast<int>(size), timeout));
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const std::exception& e) {
    throw CollectiveError(detail::collective_failure(rank, static_cast<int>(size), "NCCL group setup", e.what()));
  }
}

}  // namespace sp::torch_layer
