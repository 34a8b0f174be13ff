#include "transfer_backend.h"

#include "sp/adapters/host_backend.h"
#ifdef SP_TRAIN_HAVE_CUDA
#include "sp/adapters/cuda_backend.h"
#endif

namespace sp::train {

std::unique_ptr<sp::adapters::TransferBackend> make_transfer_backend(const TrainConfig& config) {
  if (config.train.device == ComputeDevice::cpu) {
    sp::adapters::HostBackendOptions options;
    options.bandwidth_cap_bytes_per_second = config.streaming.bandwidth_cap_gbps * 1e9;
    return std::make_unique<sp::adapters::HostBackend>(options);
  }
#ifdef SP_TRAIN_HAVE_CUDA
  if (!sp::adapters::CudaBackend::device_available()) {
    throw ConfigError(config.source_name +
                      ": train.device: cuda, but no CUDA device is visible; use train.device: cpu");
  }
  sp::adapters::CudaBackendOptions options;
  options.compute_stream = cudaStreamLegacy;
  return std::make_unique<sp::adapters::CudaBackend>(options);
#else
  throw ConfigError(config.source_name +
                    ": train.device: cuda, but this sp-train was built without CUDA (no nvcc at configure time); "
                    "use train.device: cpu");
#endif
}

}  // namespace sp::train
