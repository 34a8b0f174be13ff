// TransferBackend over plain memory, for machines without a GPU and for tests.
//
// The copy and dequant queues are worker threads that run their work in order; events are
// completion flags with a timestamp. The compute queue is the calling thread: a CPU trainer
// computes on its own thread, so "the compute queue waits for an event" blocks the caller,
// exactly where a GPU compute stream would wait.
//
// Which bytes land where is deterministic; only timing varies. An optional bandwidth cap paces
// each copy so that a CPU run shows the effect of a PCIe-sized link on the schedule.
#pragma once

#include <memory>

#include "sp/adapters/backend.h"

namespace sp::adapters {

// The slowest emulated link that tools accept (1 MB/s): below it one block's copy sleeps for
// minutes and a run looks hung rather than slow.
constexpr double kMinBandwidthCapGbps = 0.001;

struct HostBackendOptions {
  // Bytes per second a copy may move; 0 leaves copies at memcpy speed.
  double bandwidth_cap_bytes_per_second = 0.0;
  // Pacing granularity: the copy sleeps after each chunk until the cap allows the next.
  std::size_t pacing_chunk_bytes = std::size_t{1} << 20;
};

class HostBackend final : public TransferBackend {
 public:
  explicit HostBackend(HostBackendOptions options = {});
  ~HostBackend() override;

  const char *name() const override { return "host"; }
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
  class WorkerQueue;
  WorkerQueue &worker(Queue queue);
  void rethrow_worker_failure();

  HostBackendOptions options_;
  std::unique_ptr<WorkerQueue> copy_queue_;
  std::unique_ptr<WorkerQueue> dequant_queue_;
};

}  // namespace sp::adapters
