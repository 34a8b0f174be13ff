#include "sp/adapters/cuda_backend.h"

#include <stdexcept>
#include <string>

#include "sp/kernels/cuda/check.h"
#include "sp/kernels/cuda/nf4.h"
#include "sp/kernels/cuda/quantize.h"
#include "sp/kernels/slab.h"

namespace sp::adapters {
namespace {

using sp::kernels::cuda::check;

class CudaEvent final : public Event {
 public:
  CudaEvent() { check(cudaEventCreate(&event_), "cudaEventCreate"); }
  ~CudaEvent() override { cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent &) = delete;
  CudaEvent &operator=(const CudaEvent &) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

cudaEvent_t cuda_event(const Event &event) {
  const auto *cuda = dynamic_cast<const CudaEvent *>(&event);
  if (cuda == nullptr) {
    throw std::invalid_argument("CudaBackend: the event was not created by a CudaBackend");
  }
  return cuda->get();
}

void cuda_int8(const DequantTensor &t, std::uint32_t group_size, void *stream) {
  sp::kernels::cuda::dequantize_int8_to_bf16(static_cast<const std::int8_t *>(t.codes),
                                             static_cast<const float *>(t.scales), t.rows, t.cols, group_size,
                                             t.bf16_out, static_cast<cudaStream_t>(stream));
}
void cuda_nf4(const DequantTensor &t, std::uint32_t group_size, void *stream) {
  sp::kernels::cuda::dequantize_nf4_to_bf16(static_cast<const std::uint8_t *>(t.codes),
                                            static_cast<const std::uint16_t *>(t.scales), t.rows, t.cols, group_size,
                                            t.bf16_out, static_cast<cudaStream_t>(stream));
}

// The CUDA backend's codec per slab format.
constexpr DequantCodecs kCudaCodecs = [] {
  DequantCodecs codecs{};
  codecs[static_cast<std::uint32_t>(sp::kernels::SlabPrecision::kInt8)] = &cuda_int8;
  codecs[static_cast<std::uint32_t>(sp::kernels::SlabPrecision::kNf4)] = &cuda_nf4;
  return codecs;
}();

}  // namespace

bool CudaBackend::device_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    // Without a driver the query fails; clear it so the next kernel launch check does not
    // report this as its own failure.
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

std::string CudaBackend::device_name() const {
  cudaDeviceProp properties{};
  check(cudaGetDeviceProperties(&properties, device_), "cudaGetDeviceProperties");
  return properties.name;
}

CudaBackend::CudaBackend(CudaBackendOptions options) : device_(options.device) {
  check(cudaSetDevice(device_), "cudaSetDevice");
  check(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking), "cudaStreamCreate(copy)");
  check(cudaStreamCreateWithFlags(&dequant_stream_, cudaStreamNonBlocking), "cudaStreamCreate(dequant)");
  if (options.compute_stream != nullptr) {
    compute_stream_ = options.compute_stream;
  } else {
    check(cudaStreamCreateWithFlags(&compute_stream_, cudaStreamNonBlocking), "cudaStreamCreate(compute)");
    owns_compute_stream_ = true;
  }
}

CudaBackend::~CudaBackend() {
  for (cudaStream_t stream : {copy_stream_, dequant_stream_}) {
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  }
  if (owns_compute_stream_) {
    cudaStreamSynchronize(compute_stream_);
    cudaStreamDestroy(compute_stream_);
  }
}

void CudaBackend::set_compute_stream(cudaStream_t stream) {
  if (owns_compute_stream_) {
    throw std::logic_error("CudaBackend::set_compute_stream: this backend computes on a stream of its own");
  }
  compute_stream_ = stream;
}

cudaStream_t CudaBackend::stream(Queue queue) const {
  switch (queue) {
    case Queue::copy:
      return copy_stream_;
    case Queue::dequant:
      return dequant_stream_;
    case Queue::compute:
      return compute_stream_;
  }
  throw std::invalid_argument("CudaBackend: unknown queue");
}

Region CudaBackend::allocate_pinned_host(std::size_t bytes) {
  void *memory = nullptr;
  check(cudaHostAlloc(&memory, bytes, cudaHostAllocDefault), "cudaHostAlloc");
  return Region(static_cast<std::byte *>(memory), bytes, [](std::byte *p) { cudaFreeHost(p); });
}

Region CudaBackend::allocate_device(std::size_t bytes) {
  void *memory = nullptr;
  check(cudaMalloc(&memory, bytes), "cudaMalloc");
  Region region(static_cast<std::byte *>(memory), bytes, [](std::byte *p) { cudaFree(p); });
  // On the copy stream and waited for: the slot's first reader may be any of the three
  // non-blocking streams, none of which is ordered after the legacy stream cudaMemset uses.
  check(cudaMemsetAsync(memory, 0, bytes, copy_stream_), "cudaMemsetAsync");
  check(cudaStreamSynchronize(copy_stream_), "cudaStreamSynchronize(copy)");
  return region;
}

std::unique_ptr<Event> CudaBackend::create_event() { return std::make_unique<CudaEvent>(); }

void CudaBackend::copy_host_to_device_async(std::byte *device_dst, const std::byte *host_src, std::size_t bytes) {
  check(cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice, copy_stream_),
        "cudaMemcpyAsync(host to device)");
}

void CudaBackend::dequantize_async(const DequantJob &job) { dequantize_job(job, kCudaCodecs, dequant_stream_); }

void CudaBackend::record(Event &event, Queue queue) {
  check(cudaEventRecord(cuda_event(event), stream(queue)), "cudaEventRecord");
}

void CudaBackend::wait(Queue waiter, const Event &event) {
  check(cudaStreamWaitEvent(stream(waiter), cuda_event(event), 0), "cudaStreamWaitEvent");
}

bool CudaBackend::query(const Event &event) {
  const cudaError_t status = cudaEventQuery(cuda_event(event));
  if (status == cudaErrorNotReady) {
    // Not an error, but the runtime records it as the last error: clear it, or the next
    // kernel launch check would throw it.
    (void)cudaGetLastError();
    return false;
  }
  check(status, "cudaEventQuery");
  return true;
}

void CudaBackend::synchronize(const Event &event) {
  check(cudaEventSynchronize(cuda_event(event)), "cudaEventSynchronize");
}

double CudaBackend::elapsed_seconds(const Event &start, const Event &end) {
  float milliseconds = 0.0f;
  check(cudaEventElapsedTime(&milliseconds, cuda_event(start), cuda_event(end)), "cudaEventElapsedTime");
  return static_cast<double>(milliseconds) / 1000.0;
}

void CudaBackend::read_device(std::byte *host_dst, const std::byte *device_src, std::size_t bytes) {
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check(cudaMemcpy(host_dst, device_src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy(device to host)");
}

}  // namespace sp::adapters
