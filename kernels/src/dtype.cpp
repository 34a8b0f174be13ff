#include "sp/kernels/dtype.h"

#include <stdexcept>
#include <string>

namespace sp::kernels {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
      return 2;
    case DType::kFloat16:
      return 2;
  }
  throw std::invalid_argument("unknown DType value " + std::to_string(static_cast<int>(dtype)));
}

const char *dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "fp16";
  }
  return "unknown";
}

}  // namespace sp::kernels
