// The backend the trainer streams its blocks through, chosen by train.device. Kept out of
// the LibTorch translation units so that the CUDA headers and LibTorch never meet in one file.
#pragma once

#include <memory>

#include "sp/adapters/backend.h"
#include "train_config.h"

namespace sp::train {

// cpu: the host backend, paced to streaming.bandwidth_cap_gbps when it is positive.
// cuda: the CUDA backend on device 0. Its compute queue is CUDA's legacy default stream,
// the stream LibTorch launches on unless told otherwise, so the matmuls that read a slot are
// ordered after its copy and dequant, and the slot's reuse after those matmuls, with no host
// synchronization. Throws ConfigError naming train.device when this build has no CUDA backend
// or the machine has no usable GPU.
std::unique_ptr<sp::adapters::TransferBackend> make_transfer_backend(const TrainConfig& config);

}  // namespace sp::train
