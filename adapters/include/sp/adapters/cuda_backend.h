// TransferBackend on a CUDA device: cudaHostAlloc'd pinned slabs, cudaMalloc'd slots,
// cudaMemcpyAsync on a dedicated copy stream, INT8 / NF4 dequantization (sp_kernels_cuda) on its
// own stream, and events that order the three streams without blocking the host.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "sp/adapters/backend.h"

namespace sp::adapters {

struct CudaBackendOptions {
  int device = 0;
  // The stream the trainer computes on; nullptr: the backend creates a non-blocking stream
  // and the trainer launches on compute_stream(). LibTorch's default stream is the legacy
  // default stream, whose handle is also nullptr: pass cudaStreamLegacy to mean it.
  cudaStream_t compute_stream = nullptr;
};

class CudaBackend final : public TransferBackend {
 public:
  // True when a CUDA device can be used; false on machines without a GPU or driver.
  static bool device_available();

  // Throws std::runtime_error naming the CUDA call that failed.
  explicit CudaBackend(CudaBackendOptions options = {});
  ~CudaBackend() override;
  CudaBackend(const CudaBackend &) = delete;
  CudaBackend &operator=(const CudaBackend &) = delete;

  cudaStream_t stream(Queue queue) const;
  // The compute queue is `stream` from now on: for a host that computes on whatever stream its
  // caller made current (LibTorch's current stream), set before each block's use, so that the
  // block's weights are ordered before, and its slot's reuse after, the kernels that read them.
  // Throws std::logic_error for a backend that created its own compute stream.
  void set_compute_stream(cudaStream_t stream);
  // The device's name, e.g. "NVIDIA H200", for reports.
  std::string device_name() const;

  const char *name() const override { return "cuda"; }
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
  // Waits for the whole device, then copies: for checks, never on the data path.
  void read_device(std::byte *host_dst, const std::byte *device_src, std::size_t bytes) override;

 private:
  int device_;
  cudaStream_t copy_stream_ = nullptr;
  cudaStream_t dequant_stream_ = nullptr;
  cudaStream_t compute_stream_ = nullptr;
  bool owns_compute_stream_ = false;
};

}  // namespace sp::adapters
