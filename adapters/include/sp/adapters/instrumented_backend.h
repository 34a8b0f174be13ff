// A TransferBackend decorator that counts what the engine asks of the backend, above all the
// host synchronizations, so tests can prove the steady state has none.
#pragma once

#include <cstdint>

#include "sp/adapters/backend.h"

namespace sp::adapters {

struct BackendCallCounts {
  std::uint64_t host_syncs = 0;  // synchronize() and read_device(): the host blocked
  std::uint64_t queries = 0;     // non-blocking query()
  std::uint64_t copies = 0;
  std::uint64_t copied_bytes = 0;
  std::uint64_t dequants = 0;
  std::uint64_t records = 0;
  std::uint64_t queue_waits = 0;
  std::uint64_t allocations = 0;  // pinned, device and event creations
};

class InstrumentedBackend final : public TransferBackend {
 public:
  explicit InstrumentedBackend(TransferBackend &inner) : inner_(inner) {}

  const BackendCallCounts &counts() const { return counts_; }
  void reset_counts() { counts_ = {}; }

  const char *name() const override { return inner_.name(); }
  Region allocate_pinned_host(std::size_t bytes) override;
  Region allocate_device(std::size_t bytes) override;
  std::unique_ptr<Event> create_event() override;
  void copy_host_to_device_async(std::byte *device_dst, const std::byte *host_src, std::size_t bytes) override;
  void dequantize_async(const DequantJob &job) override;
  void record(Event &event, Queue queue) override;
  void wait(Queue waiter, const Event &event) override;
  bool query(const Event &event) override;
  void synchronize(const Event &event) override;
  double elapsed_seconds(const Event &start, const Event &end) override;
  void read_device(std::byte *host_dst, const std::byte *device_src, std::size_t bytes) override;

 private:
  TransferBackend &inner_;
  BackendCallCounts counts_;
};

}  // namespace sp::adapters
