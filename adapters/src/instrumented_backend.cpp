#include "sp/adapters/instrumented_backend.h"

namespace sp::adapters {

Region InstrumentedBackend::allocate_pinned_host(std::size_t bytes) {
  ++counts_.allocations;
  return inner_.allocate_pinned_host(bytes);
}

Region InstrumentedBackend::allocate_device(std::size_t bytes) {
  ++counts_.allocations;
  return inner_.allocate_device(bytes);
}

std::unique_ptr<Event> InstrumentedBackend::create_event() {
  ++counts_.allocations;
  return inner_.create_event();
}

void InstrumentedBackend::copy_host_to_device_async(std::byte *device_dst, const std::byte *host_src,
                                                    std::size_t bytes) {
  ++counts_.copies;
  counts_.copied_bytes += bytes;
  inner_.copy_host_to_device_async(device_dst, host_src, bytes);
}

void InstrumentedBackend::dequantize_async(const DequantJob &job) {
  ++counts_.dequants;
  inner_.dequantize_async(job);
}

void InstrumentedBackend::record(Event &event, Queue queue) {
  ++counts_.records;
  inner_.record(event, queue);
}

void InstrumentedBackend::wait(Queue waiter, const Event &event) {
  ++counts_.queue_waits;
  inner_.wait(waiter, event);
}

bool InstrumentedBackend::query(const Event &event) {
  ++counts_.queries;
  return inner_.query(event);
}

void InstrumentedBackend::synchronize(const Event &event) {
  ++counts_.host_syncs;
  inner_.synchronize(event);
}

double InstrumentedBackend::elapsed_seconds(const Event &start, const Event &end) {
  return inner_.elapsed_seconds(start, end);
}

void InstrumentedBackend::read_device(std::byte *host_dst, const std::byte *device_src, std::size_t bytes) {
  ++counts_.host_syncs;
  inner_.read_device(host_dst, device_src, bytes);
}

}  // namespace sp::adapters
