#include "sp/adapters/host_backend.h"

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <new>
#include <stdexcept>
#include <thread>

#include "sp/kernels/nf4.h"
#include "sp/kernels/quantize.h"
#include "sp/kernels/slab.h"

namespace sp::adapters {
namespace {

using Clock = std::chrono::steady_clock;

// Generation counting gives CUDA event semantics: a wait captures the generation of the
// latest record() at the time of the call, so a later re-record does not move its target.
class EventTimeline {
 public:
  std::uint64_t record() {
    std::lock_guard lock(mutex_);
    return ++recorded_;
  }
  void complete(std::uint64_t generation) {
    {
      std::lock_guard lock(mutex_);
      if (generation > completed_) {
        completed_ = generation;
        completed_at_ = Clock::now();
      }
    }
    changed_.notify_all();
  }
  std::uint64_t latest() const {
    std::lock_guard lock(mutex_);
    return recorded_;
  }
  bool reached(std::uint64_t generation) const {
    std::lock_guard lock(mutex_);
    return completed_ >= generation;
  }
  void wait_for(std::uint64_t generation) const {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return completed_ >= generation; });
  }
  Clock::time_point completed_at() const {
    std::lock_guard lock(mutex_);
    return completed_at_;
  }

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable changed_;
  std::uint64_t recorded_ = 0;
  std::uint64_t completed_ = 0;
  Clock::time_point completed_at_{};
};

// As with cudaEventDestroy, an event may be destroyed while a queue still has to record or wait
// on it: the queued task shares the timeline, so it outlives the Event object when it must.
class HostEvent final : public Event {
 public:
  const std::shared_ptr<EventTimeline> timeline = std::make_shared<EventTimeline>();
};

const std::shared_ptr<EventTimeline> &host_timeline(const Event &event) {
  const auto *host = dynamic_cast<const HostEvent *>(&event);
  if (host == nullptr) {
    throw std::invalid_argument("HostBackend: the event was not created by a HostBackend");
  }
  return host->timeline;
}

Region allocate_zeroed(std::size_t bytes) {
  constexpr std::size_t kAlignment = 256;  // as cudaMalloc: every slab and slot offset stays aligned
  const std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void *memory = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
  if (memory == nullptr) {
    throw std::bad_alloc();
  }
  std::memset(memory, 0, rounded);
  return Region(static_cast<std::byte *>(memory), bytes, [](std::byte *p) { std::free(p); });
}

// One thread, as a device's dequantize stream is one engine: the queue's worker is that
// thread. Fanning out would only contend with the caller's compute threads for the cores it
// shares with them (2 torch threads, 2 cores: the INT8 step took 223 ms so, 201 ms thus).
constexpr sp::kernels::CpuExec kOneThread{sp::kernels::CpuImpl::kVectorized, 1, nullptr};

void host_int8(const DequantTensor &t, std::uint32_t group_size, void *) {
  sp::kernels::dequantize_int8_to_bf16(static_cast<const std::int8_t *>(t.codes), static_cast<const float *>(t.scales),
                                       t.rows, t.cols, group_size, t.bf16_out, kOneThread);
}
void host_nf4(const DequantTensor &t, std::uint32_t group_size, void *) {
  sp::kernels::dequantize_nf4_to_bf16(static_cast<const std::uint8_t *>(t.codes),
                                      static_cast<const std::uint16_t *>(t.scales), t.rows, t.cols, group_size,
                                      t.bf16_out, kOneThread);
}

// The host's codec per slab format.
constexpr DequantCodecs kHostCodecs = [] {
  DequantCodecs codecs{};
  codecs[static_cast<std::uint32_t>(sp::kernels::SlabPrecision::kInt8)] = &host_int8;
  codecs[static_cast<std::uint32_t>(sp::kernels::SlabPrecision::kNf4)] = &host_nf4;
  return codecs;
}();

}  // namespace

// One in-order queue served by its own thread, like a stream.
class HostBackend::WorkerQueue {
 public:
  WorkerQueue() : thread_([this] { run(); }) {}
  ~WorkerQueue() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }

  void push(std::function<void()> task) {
    {
      std::lock_guard lock(mutex_);
      tasks_.push_back(std::move(task));
    }
    changed_.notify_all();
  }

  std::exception_ptr failure() {
    std::lock_guard lock(mutex_);
    return failure_;
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) {
          return;
        }
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      // Event completions queued behind a failed task must still run, or waiters would hang;
      // the failure surfaces at the next call the host makes.
      try {
        task();
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!failure_) {
          failure_ = std::current_exception();
        }
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::exception_ptr failure_;
  std::thread thread_;
};

HostBackend::HostBackend(HostBackendOptions options)
    : options_(options), copy_queue_(std::make_unique<WorkerQueue>()), dequant_queue_(std::make_unique<WorkerQueue>()) {
  if (options_.bandwidth_cap_bytes_per_second < 0.0) {
    throw std::invalid_argument("HostBackendOptions.bandwidth_cap_bytes_per_second must be >= 0 (0 = uncapped)");
  }
  if (options_.pacing_chunk_bytes == 0) {
    throw std::invalid_argument("HostBackendOptions.pacing_chunk_bytes must be > 0");
  }
}

HostBackend::~HostBackend() = default;

HostBackend::WorkerQueue &HostBackend::worker(Queue queue) {
  return queue == Queue::copy ? *copy_queue_ : *dequant_queue_;
}

void HostBackend::rethrow_worker_failure() {
  for (WorkerQueue *queue : {copy_queue_.get(), dequant_queue_.get()}) {
    if (std::exception_ptr failure = queue->failure()) {
      std::rethrow_exception(failure);
    }
  }
}

Region HostBackend::allocate_pinned_host(std::size_t bytes) { return allocate_zeroed(bytes); }

Region HostBackend::allocate_device(std::size_t bytes) { return allocate_zeroed(bytes); }

std::unique_ptr<Event> HostBackend::create_event() { return std::make_unique<HostEvent>(); }

void HostBackend::copy_host_to_device_async(std::byte *device_dst, const std::byte *host_src, std::size_t bytes) {
  rethrow_worker_failure();
  const double cap = options_.bandwidth_cap_bytes_per_second;
  const std::size_t chunk = options_.pacing_chunk_bytes;
  copy_queue_->push([device_dst, host_src, bytes, cap, chunk] {
    if (cap <= 0.0) {
      std::memcpy(device_dst, host_src, bytes);
      return;
    }
    const Clock::time_point start = Clock::now();
    for (std::size_t done = 0; done < bytes;) {
      const std::size_t n = std::min(chunk, bytes - done);
      std::memcpy(device_dst + done, host_src + done, n);
      done += n;
      std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                                std::chrono::duration<double>(static_cast<double>(done) / cap)));
    }
  });
}

void HostBackend::dequantize_async(const DequantJob &job) {
  rethrow_worker_failure();
  dequant_queue_->push([job] { dequantize_job(job, kHostCodecs, nullptr); });
}

void HostBackend::record(Event &event, Queue queue) {
  rethrow_worker_failure();
  const std::shared_ptr<EventTimeline> &timeline = host_timeline(event);
  const std::uint64_t generation = timeline->record();
  if (queue == Queue::compute) {
    timeline->complete(generation);  // the compute queue is the caller: everything before is done
    return;
  }
  worker(queue).push([timeline, generation] { timeline->complete(generation); });
}

void HostBackend::wait(Queue waiter, const Event &event) {
  rethrow_worker_failure();
  const std::shared_ptr<EventTimeline> &timeline = host_timeline(event);
  const std::uint64_t generation = timeline->latest();
  if (waiter == Queue::compute) {
    timeline->wait_for(generation);
    return;
  }
  worker(waiter).push([timeline, generation] { timeline->wait_for(generation); });
}

bool HostBackend::query(const Event &event) {
  rethrow_worker_failure();
  const EventTimeline &timeline = *host_timeline(event);
  return timeline.reached(timeline.latest());
}

void HostBackend::synchronize(const Event &event) {
  const EventTimeline &timeline = *host_timeline(event);
  timeline.wait_for(timeline.latest());
  rethrow_worker_failure();
}

double HostBackend::elapsed_seconds(const Event &start, const Event &end) {
  const EventTimeline &first = *host_timeline(start);
  const EventTimeline &last = *host_timeline(end);
  if (!first.reached(first.latest()) || !last.reached(last.latest())) {
    throw std::logic_error("HostBackend::elapsed_seconds: an event has not completed");
  }
  return std::chrono::duration<double>(last.completed_at() - first.completed_at()).count();
}

void HostBackend::read_device(std::byte *host_dst, const std::byte *device_src, std::size_t bytes) {
  rethrow_worker_failure();
  std::memcpy(host_dst, device_src, bytes);
}

}  // namespace sp::adapters
