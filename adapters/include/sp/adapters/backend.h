// The device-facing half of the data path: memory, three ordered queues, events.
//
// The streaming engine is written once against this interface. CudaBackend maps it onto
// cudaHostAlloc / cudaMalloc / cudaMemcpyAsync / cudaEvent_t; HostBackend maps it onto plain
// memory and worker threads so that the same engine runs (and is tested) without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "sp/adapters/transfer_image.h"

namespace sp::adapters {

// The three queues of the data path. On CUDA each is a stream. The copy queue carries only
// host-to-device copies so they never wait behind compute; the dequant queue runs INT8 / NF4
// dequantization after a copy lands; the compute queue is where the trainer runs the block.
enum class Queue : std::uint8_t { copy, dequant, compute };

const char *queue_name(Queue queue);

// A completion marker with CUDA event semantics: wait(), query() and synchronize() refer to
// the most recent record() made before the call, so one event can be recorded again and again.
// As with cudaEventDestroy, an event may be destroyed while a queue has still to record it or
// wait on it: the queues keep what they need.
class Event {
 public:
  virtual ~Event() = default;
};

// Memory owned by a backend and returned to it on destruction.
class Region {
 public:
  using Deleter = std::function<void(std::byte *)>;

  Region() = default;
  Region(std::byte *data, std::size_t bytes, Deleter deleter);
  Region(Region &&other) noexcept;
  Region &operator=(Region &&other) noexcept;
  Region(const Region &) = delete;
  Region &operator=(const Region &) = delete;
  ~Region();

  std::byte *data() const { return data_; }
  std::size_t size() const { return bytes_; }

 private:
  void free_now() noexcept;

  std::byte *data_ = nullptr;
  std::size_t bytes_ = 0;
  Deleter deleter_;
};

class TransferBackend {
 public:
  virtual ~TransferBackend() = default;

  virtual const char *name() const = 0;

  // Page-locked host memory (the transfer images live here) and device memory (the slots).
  // Called only at startup; the data path never allocates afterwards.
  virtual Region allocate_pinned_host(std::size_t bytes) = 0;
  virtual Region allocate_device(std::size_t bytes) = 0;
  virtual std::unique_ptr<Event> create_event() = 0;

  // Enqueued on Queue::copy. `host_src` must stay unchanged until the copy completes.
  virtual void copy_host_to_device_async(std::byte *device_dst, const std::byte *host_src, std::size_t bytes) = 0;
  // Enqueued on Queue::dequant: the staged INT8 or NF4 image (device memory) becomes bf16
  // tensors (DequantJob says which; dequantize_job runs the backend's codec for its route).
  virtual void dequantize_async(const DequantJob &job) = 0;

  virtual void record(Event &event, Queue queue) = 0;
  // Queue-ordered wait: work enqueued on `waiter` afterwards runs after `event` completes.
  // The host does not block.
  virtual void wait(Queue waiter, const Event &event) = 0;
  // Non-blocking completion test.
  virtual bool query(const Event &event) = 0;
  // Blocks the host until `event` completes: a host synchronization.
  virtual void synchronize(const Event &event) = 0;
  // Seconds between two completed events.
  virtual double elapsed_seconds(const Event &start, const Event &end) = 0;
  // Blocking device-to-host read for checks and tests: a host synchronization.
  virtual void read_device(std::byte *host_dst, const std::byte *device_src, std::size_t bytes) = 0;
};

}  // namespace sp::adapters
