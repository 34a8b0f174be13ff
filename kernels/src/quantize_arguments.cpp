#include "quantize_arguments.h"

#include <stdexcept>
#include <string>

#include "sp/kernels/nf4.h"

namespace sp::kernels::detail {
namespace {

void check_group_size(uint32_t group_size, const char *function) {
  if (!is_supported_group_size(group_size)) {
    throw std::invalid_argument(std::string(function) + ": group_size " + std::to_string(group_size) +
                                " is not supported (expected 0 = per row, 32, 64, 128 or 256)");
  }
}

void check_buffers(std::size_t rows, std::size_t cols, std::initializer_list<const void *> pointers,
                   const char *function) {
  if (rows != 0 && cols != 0 && (rows * cols) / cols != rows) {
    throw std::invalid_argument(std::string(function) + ": rows * cols overflows");
  }
  if (rows == 0 || cols == 0) return;
  for (const void *pointer : pointers) {
    if (pointer == nullptr) {
      throw std::invalid_argument(std::string(function) + ": null pointer for a " + std::to_string(rows) + " x " +
                                  std::to_string(cols) + " tensor");
    }
  }
}

}  // namespace

void check_quantize_arguments(const void *src, DType src_dtype, std::size_t rows, std::size_t cols,
                              const QuantizeOptions &options, const void *codes, const void *scales,
                              const char *function) {
  check_group_size(options.group_size, function);
  if (src_dtype != DType::kFloat32 && src_dtype != DType::kBFloat16) {
    throw std::invalid_argument(std::string(function) + ": source dtype " + dtype_name(src_dtype) +
                                " is not supported (expected fp32 or bf16)");
  }
  check_buffers(rows, cols, {src, codes, scales}, function);
  if (has_empty_rows(rows, cols, options.group_size) && scales == nullptr) {
    throw std::invalid_argument(std::string(function) + ": null scales for " + std::to_string(rows) + " empty rows");
  }
}

void check_dequantize_arguments(const void *codes, const float *scales, std::size_t rows, std::size_t cols,
                                uint32_t group_size, const void *dst, const char *function) {
  check_group_size(group_size, function);
  check_buffers(rows, cols, {codes, scales, dst}, function);
}

static void check_nf4_group_size(uint32_t group_size, const char *function) {
  if (!is_supported_nf4_group_size(group_size)) {
    throw std::invalid_argument(std::string(function) + ": group_size " + std::to_string(group_size) +
                                " is not supported for NF4 (expected 32, 64, 128 or 256)");
  }
}

void check_nf4_quantize_arguments(const void *src, DType src_dtype, std::size_t rows, std::size_t cols,
                                  uint32_t group_size, const void *codes, const void *scales, const char *function) {
  check_nf4_group_size(group_size, function);
  if (src_dtype != DType::kFloat32 && src_dtype != DType::kBFloat16) {
    throw std::invalid_argument(std::string(function) + ": source dtype " + dtype_name(src_dtype) +
                                " is not supported (expected fp32 or bf16)");
  }
  check_buffers(rows, cols, {src, codes, scales}, function);
}

void check_nf4_dequantize_arguments(const void *codes, const void *scales, std::size_t rows, std::size_t cols,
                                    uint32_t group_size, const void *dst, const char *function) {
  check_nf4_group_size(group_size, function);
  check_buffers(rows, cols, {codes, scales, dst}, function);
}

}  // namespace sp::kernels::detail
