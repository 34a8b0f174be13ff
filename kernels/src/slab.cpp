// The slab image: layout planning (shared by the size query, the builder and the reader, so
// the three can never disagree), building, validating and decoding.
#include "sp/kernels/slab.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "scalar_math.h"
#include "slab_layout.h"
#include "sp/kernels/bf16.h"
#include "sp/kernels/nf4.h"
#include "sp/kernels/quantize.h"

namespace sp::kernels {
namespace {

uint64_t checked_add(uint64_t a, uint64_t b) {
  uint64_t result;
  if (__builtin_add_overflow(a, b, &result)) throw std::invalid_argument("slab size overflows 64 bits");
  return result;
}

uint64_t checked_mul(uint64_t a, uint64_t b) {
  uint64_t result;
  if (__builtin_mul_overflow(a, b, &result)) throw std::invalid_argument("slab size overflows 64 bits");
  return result;
}

uint64_t align_up(uint64_t value, uint64_t alignment) {
  return checked_add(value, alignment - 1) / alignment * alignment;
}

bool is_known_precision(uint32_t precision) {
  return precision == static_cast<uint32_t>(SlabPrecision::kBf16) ||
         precision == static_cast<uint32_t>(SlabPrecision::kInt8) ||
         precision == static_cast<uint32_t>(SlabPrecision::kNf4);
}

std::string unknown_precision(uint32_t precision) {
  const std::string expected = " (expected 1 = bf16, 2 = int8, 4 = nf4)";
  if (precision == 3) return "precision 3 (fp8_e4m3, which no route streamed) is no longer supported" + expected;
  return "precision " + std::to_string(precision) + " is unknown" + expected;
}

// Payload bytes of a rows x cols tensor: 2 per element for bf16, 1 for int8, two 4-bit
// codes per byte for nf4 (nf4_code_bytes).
uint64_t payload_bytes(SlabPrecision precision, uint64_t rows, uint64_t cols) {
  const uint64_t elements = checked_mul(rows, cols);
  switch (precision) {
    case SlabPrecision::kBf16:
      return checked_mul(elements, 2);
    case SlabPrecision::kNf4:
      return elements / 2 + elements % 2;
    case SlabPrecision::kInt8:
      break;
  }
  return elements;
}

// Bytes of one scale: bf16 for nf4, fp32 otherwise.
uint64_t scale_bytes(SlabPrecision precision) {
  return precision == SlabPrecision::kNf4 ? sizeof(uint16_t) : sizeof(float);
}

// Empty string when the encoding is valid, else what is wrong with it.
std::string encoding_problem(SlabPrecision precision, uint32_t group_size, Rounding rounding) {
  if (!is_known_precision(static_cast<uint32_t>(precision))) {
    return unknown_precision(static_cast<uint32_t>(precision));
  }
  if (precision == SlabPrecision::kNf4) {
    if (!is_supported_nf4_group_size(group_size)) {
      return "group_size " + std::to_string(group_size) +
             " is not supported for an nf4 slab (expected 32, 64, 128 or 256)";
    }
    if (rounding != Rounding::kNearestEven) return "nf4 slabs support round-to-nearest only";
    return {};
  }
  if (precision == SlabPrecision::kBf16 && group_size != 0) {
    return "group_size " + std::to_string(group_size) + " given for a bf16 slab (expected 0)";
  }
  if (!is_supported_group_size(group_size)) {
    return "group_size " + std::to_string(group_size) + " is not supported (expected 0 = per row, 32, 64, 128 or 256)";
  }
  return {};
}

struct PlannedTensor {
  TensorShape shape;
  uint64_t data_offset;
  uint64_t data_bytes;
  uint64_t scales_offset;
  uint64_t scale_count;
};

struct SlabPlan {
  uint64_t payload_offset = 0;
  uint64_t scales_offset = 0;
  uint64_t total_bytes = 0;
  std::vector<PlannedTensor> tensors;
};

// `shape_of(i)` gives tensor i's shape. Throws std::invalid_argument on size overflow.
template <typename ShapeOf>
SlabPlan plan_slab(SlabPrecision precision, uint32_t group_size, std::size_t n_tensors, const ShapeOf &shape_of) {
  SlabPlan plan;
  plan.tensors.resize(n_tensors);
  const uint64_t table_end = checked_add(sizeof(SlabHeader), checked_mul(n_tensors, sizeof(SlabTensorEntry)));
  plan.payload_offset = align_up(table_end, kSlabDataAlignment);
  uint64_t cursor = plan.payload_offset;
  for (std::size_t i = 0; i < n_tensors; ++i) {
    PlannedTensor &tensor = plan.tensors[i];
    tensor.shape = shape_of(i);
    tensor.data_offset = align_up(cursor, kSlabDataAlignment);
    tensor.data_bytes = payload_bytes(precision, tensor.shape.rows, tensor.shape.cols);
    cursor = checked_add(tensor.data_offset, tensor.data_bytes);
  }
  if (precision == SlabPrecision::kBf16) {
    for (PlannedTensor &tensor : plan.tensors) tensor.scales_offset = tensor.scale_count = 0;
    plan.scales_offset = plan.total_bytes = cursor;
    return plan;
  }
  cursor = align_up(cursor, kSlabScaleAlignment);
  plan.scales_offset = cursor;
  for (PlannedTensor &tensor : plan.tensors) {
    const uint64_t groups = group_size == 0 ? 1 : (tensor.shape.cols + group_size - 1) / group_size;
    tensor.scale_count = checked_mul(tensor.shape.rows, groups);
    tensor.scales_offset = cursor;
    cursor = checked_add(cursor, checked_mul(tensor.scale_count, scale_bytes(precision)));
  }
  plan.total_bytes = cursor;
  return plan;
}

void require_valid_encoding(const SlabEncoding &encoding, const char *function) {
  const std::string problem = encoding_problem(encoding.precision, encoding.group_size, encoding.rounding);
  if (!problem.empty()) throw std::invalid_argument(std::string(function) + ": " + problem);
}

void require_aligned_image(const uint8_t *image, const char *function) {
  if (reinterpret_cast<uintptr_t>(image) % kSlabScaleAlignment != 0) {
    throw std::invalid_argument(std::string(function) + ": image address is not " +
                                std::to_string(kSlabScaleAlignment) + "-byte aligned");
  }
}

// Bitwise CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320): a few hundred bytes per
// image, so no table is needed. Detects every single-bit and every burst error up to 32 bits.
uint32_t crc32_update(uint32_t crc, const uint8_t *bytes, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    crc ^= bytes[i];
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return crc;
}

uint32_t table_crc32(SlabHeader header, const uint8_t *entries, std::size_t n_entries) {
  header.table_crc32 = 0;
  uint32_t crc = crc32_update(0xFFFFFFFFu, reinterpret_cast<const uint8_t *>(&header), sizeof header);
  crc = crc32_update(crc, entries, n_entries * sizeof(SlabTensorEntry));
  return ~crc;
}

template <typename T>
T read_pod(const uint8_t *bytes) {
  T value;
  std::memcpy(&value, bytes, sizeof value);
  return value;
}

}  // namespace

const char *slab_precision_name(SlabPrecision precision) {
  switch (precision) {
    case SlabPrecision::kBf16:
      return "bf16";
    case SlabPrecision::kInt8:
      return "int8";
    case SlabPrecision::kNf4:
      return "nf4";
  }
  return "unknown";
}

uint64_t slab_image_bytes(const SlabEncoding &encoding, const TensorShape *shapes, std::size_t n_tensors) {
  require_valid_encoding(encoding, "slab_image_bytes");
  if (n_tensors != 0 && shapes == nullptr) {
    throw std::invalid_argument("slab_image_bytes: null shapes with n_tensors = " + std::to_string(n_tensors));
  }
  return plan_slab(encoding.precision, encoding.group_size, n_tensors, [&](std::size_t i) { return shapes[i]; })
      .total_bytes;
}

detail::SlabLayout detail::lay_out_slab(const SlabEncoding &encoding, const TensorShape *shapes,
                                       std::size_t n_tensors, uint8_t *image, uint64_t capacity,
                                       const char *function) {
  require_valid_encoding(encoding, function);
  if (n_tensors != 0 && shapes == nullptr) {
    throw std::invalid_argument(std::string(function) + ": null tensor list with n_tensors = " +
                                std::to_string(n_tensors));
  }
  if (n_tensors > UINT32_MAX) throw std::invalid_argument(std::string(function) + ": more than 2^32-1 tensors");
  const SlabPlan plan =
      plan_slab(encoding.precision, encoding.group_size, n_tensors, [&](std::size_t i) { return shapes[i]; });
  if (image == nullptr || capacity < plan.total_bytes) {
    throw std::invalid_argument(std::string(function) + ": the image needs " + std::to_string(plan.total_bytes) +
                                " bytes, the buffer has " + std::to_string(image == nullptr ? 0 : capacity));
  }
  require_aligned_image(image, function);

  SlabHeader header{};
  header.magic = kSlabMagic;
  header.version = kSlabVersion;
  header.header_bytes = sizeof(SlabHeader);
  header.precision = static_cast<uint32_t>(encoding.precision);
  header.group_size = encoding.group_size;
  header.tensor_count = static_cast<uint32_t>(n_tensors);
  header.entry_bytes = sizeof(SlabTensorEntry);
  header.total_bytes = plan.total_bytes;
  header.payload_offset = plan.payload_offset;
  header.scales_offset = plan.scales_offset;

  // Only the gaps are zeroed; the caller writes payload and scales in full.
  SlabLayout layout;
  layout.total_bytes = plan.total_bytes;
  std::vector<SlabTensorTarget> &targets = layout.tensors;
  targets.resize(n_tensors);
  uint64_t written_end = sizeof(SlabHeader) + n_tensors * sizeof(SlabTensorEntry);
  for (std::size_t i = 0; i < n_tensors; ++i) {
    const PlannedTensor &planned = plan.tensors[i];
    SlabTensorEntry entry{};
    entry.rows = planned.shape.rows;
    entry.cols = planned.shape.cols;
    entry.data_offset = planned.data_offset;
    entry.data_bytes = planned.data_bytes;
    entry.scales_offset = planned.scales_offset;
    entry.scale_count = planned.scale_count;
    std::memcpy(image + sizeof(SlabHeader) + i * sizeof(SlabTensorEntry), &entry, sizeof entry);
    std::memset(image + written_end, 0, planned.data_offset - written_end);
    written_end = planned.data_offset + planned.data_bytes;
    targets[i] = SlabTensorTarget{planned.shape, image + planned.data_offset, image + planned.scales_offset,
                                  detail::derive_seed(encoding.seed, i)};
  }
  std::memset(image + written_end, 0, plan.scales_offset - written_end);
  header.table_crc32 = table_crc32(header, image + sizeof(SlabHeader), n_tensors);
  std::memcpy(image, &header, sizeof header);
  return layout;
}

uint64_t build_slab(const SlabEncoding &encoding, const SlabTensorSource *tensors, std::size_t n_tensors,
                    uint8_t *image, uint64_t capacity, const CpuExec &exec) {
  if (n_tensors != 0 && tensors == nullptr) {
    throw std::invalid_argument("build_slab: null tensor list with n_tensors = " + std::to_string(n_tensors));
  }
  std::vector<TensorShape> shapes(n_tensors);
  for (std::size_t i = 0; i < n_tensors; ++i) {
    shapes[i] = tensors[i].shape;
    if (tensors[i].master == nullptr && shapes[i].rows != 0 && shapes[i].cols != 0) {
      throw std::invalid_argument("build_slab: tensor " + std::to_string(i) + " has a null master pointer");
    }
  }
  const detail::SlabLayout layout =
      detail::lay_out_slab(encoding, shapes.data(), n_tensors, image, capacity, "build_slab");
  for (std::size_t i = 0; i < n_tensors; ++i) {
    const detail::SlabTensorTarget &target = layout.tensors[i];
    const TensorShape &shape = target.shape;
    switch (encoding.precision) {
      case SlabPrecision::kBf16:
        fp32_to_bf16(tensors[i].master, reinterpret_cast<uint16_t *>(target.data), shape.rows * shape.cols,
                     Bf16Options{encoding.rounding, target.seed}, exec);
        break;
      case SlabPrecision::kInt8:
        quantize_int8(tensors[i].master, DType::kFloat32, shape.rows, shape.cols,
                      QuantizeOptions{encoding.group_size, encoding.rounding, target.seed},
                      reinterpret_cast<int8_t *>(target.data), reinterpret_cast<float *>(target.scales), exec);
        break;
      case SlabPrecision::kNf4:
        quantize_nf4(tensors[i].master, DType::kFloat32, shape.rows, shape.cols, encoding.group_size, target.data,
                     reinterpret_cast<uint16_t *>(target.scales), exec);
        break;
    }
  }
  return layout.total_bytes;
}

SlabReadResult read_slab(const uint8_t *image, uint64_t size) {
  SlabReadResult result;
  const auto fail = [&result](std::string message) {
    result.ok = false;
    result.error = "slab image: " + std::move(message);
    result.view = SlabView{};
    return result;
  };
  if (image == nullptr) return fail("null image pointer");
  if (size < sizeof(SlabHeader)) {
    return fail(std::to_string(size) + " bytes, shorter than the " + std::to_string(sizeof(SlabHeader)) +
                "-byte header");
  }
  const auto header = read_pod<SlabHeader>(image);
  if (header.magic != kSlabMagic) return fail("bad magic (not a slab image)");
  if (header.version < kSlabOldestReadableVersion || header.version > kSlabVersion) {
    return fail("version " + std::to_string(header.version) + " is not supported (expected " +
                std::to_string(kSlabOldestReadableVersion) + " to " + std::to_string(kSlabVersion) + ")");
  }
  if (header.header_bytes != sizeof(SlabHeader) || header.entry_bytes != sizeof(SlabTensorEntry)) {
    return fail("header_bytes/entry_bytes are " + std::to_string(header.header_bytes) + "/" +
                std::to_string(header.entry_bytes) + " (expected 64/64)");
  }
  if (header.reserved0 != 0 || header.reserved1 != 0) return fail("header reserved fields are not zero");
  if (!is_known_precision(header.precision)) {
    return fail(unknown_precision(header.precision));
  }
  if (header.version < 2 && header.precision == static_cast<uint32_t>(SlabPrecision::kNf4)) {
    return fail("precision 4 = nf4 needs version 2 or later, the image is version " + std::to_string(header.version));
  }
  const auto precision = static_cast<SlabPrecision>(header.precision);
  const std::string problem = encoding_problem(precision, header.group_size, Rounding::kNearestEven);
  if (!problem.empty()) return fail(problem);
  if (header.total_bytes != size) {
    return fail("total_bytes is " + std::to_string(header.total_bytes) + ", the image has " + std::to_string(size) +
                " bytes");
  }
  if (header.tensor_count > (size - sizeof(SlabHeader)) / sizeof(SlabTensorEntry)) {
    return fail("tensor_count " + std::to_string(header.tensor_count) + " does not fit in " + std::to_string(size) +
                " bytes");
  }
  const uint32_t crc = table_crc32(header, image + sizeof(SlabHeader), header.tensor_count);
  if (crc != header.table_crc32) {
    return fail("table_crc32 mismatch (header or tensor table corrupted)");
  }
  std::vector<SlabTensorEntry> entries(header.tensor_count);
  for (std::size_t i = 0; i < entries.size(); ++i) {
    entries[i] = read_pod<SlabTensorEntry>(image + sizeof(SlabHeader) + i * sizeof(SlabTensorEntry));
    if (entries[i].reserved[0] != 0 || entries[i].reserved[1] != 0) {
      return fail("tensor " + std::to_string(i) + ": reserved fields are not zero");
    }
  }
  // The format is canonical: every offset follows from the shapes, so the image must match
  // the plan that the builder would make, field by field.
  SlabPlan plan;
  try {
    plan = plan_slab(precision, header.group_size, entries.size(), [&](std::size_t i) {
      return TensorShape{entries[i].rows, entries[i].cols};
    });
  } catch (const std::invalid_argument &) {
    return fail("tensor shapes overflow a 64-bit size");
  }
  const auto mismatch = [&](const std::string &where, const char *field, uint64_t found, uint64_t expected) {
    return fail(where + field + " is " + std::to_string(found) + ", expected " + std::to_string(expected));
  };
  if (plan.total_bytes != size) return mismatch("", "image size from the shapes", plan.total_bytes, size);
  if (header.payload_offset != plan.payload_offset) {
    return mismatch("", "payload_offset", header.payload_offset, plan.payload_offset);
  }
  if (header.scales_offset != plan.scales_offset) {
    return mismatch("", "scales_offset", header.scales_offset, plan.scales_offset);
  }
  result.view.precision = precision;
  result.view.version = header.version;
  result.view.group_size = header.group_size;
  result.view.total_bytes = size;
  result.view.tensors.resize(entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const std::string where = "tensor " + std::to_string(i) + ": ";
    const PlannedTensor &expected = plan.tensors[i];
    const SlabTensorEntry &entry = entries[i];
    if (entry.data_offset != expected.data_offset) {
      return mismatch(where, "data_offset", entry.data_offset, expected.data_offset);
    }
    if (entry.data_bytes != expected.data_bytes) {
      return mismatch(where, "data_bytes", entry.data_bytes, expected.data_bytes);
    }
    if (entry.scales_offset != expected.scales_offset) {
      return mismatch(where, "scales_offset", entry.scales_offset, expected.scales_offset);
    }
    if (entry.scale_count != expected.scale_count) {
      return mismatch(where, "scale_count", entry.scale_count, expected.scale_count);
    }
    result.view.tensors[i] = SlabTensorView{expected.shape, expected.data_offset, expected.data_bytes,
                                            expected.scales_offset, expected.scale_count};
  }
  result.ok = true;
  return result;
}

namespace {

template <typename Out>
void decode_tensor(const uint8_t *image, const SlabView &view, std::size_t index, Out *dst, const CpuExec &exec,
                   const char *function) {
  if (index >= view.tensors.size()) {
    throw std::out_of_range(std::string(function) + ": tensor index " + std::to_string(index) +
                            " is not below the slab's " + std::to_string(view.tensors.size()) + " tensors");
  }
  require_aligned_image(image, function);
  const SlabTensorView &tensor = view.tensors[index];
  const uint8_t *data = image + tensor.data_offset;
  const auto *scales = reinterpret_cast<const float *>(image + tensor.scales_offset);
  const uint64_t n = tensor.shape.rows * tensor.shape.cols;
  if (n == 0) return;
  if (dst == nullptr) {
    throw std::invalid_argument(std::string(function) + ": null destination for tensor " + std::to_string(index) +
                                " (" + std::to_string(n) + " elements)");
  }
  switch (view.precision) {
    case SlabPrecision::kBf16:
      if constexpr (std::is_same_v<Out, uint16_t>) {
        std::memcpy(dst, data, tensor.data_bytes);
      } else {
        bf16_to_fp32(reinterpret_cast<const uint16_t *>(data), dst, n, exec);
      }
      return;
    case SlabPrecision::kInt8:
      if constexpr (std::is_same_v<Out, uint16_t>) {
        dequantize_int8_to_bf16(reinterpret_cast<const int8_t *>(data), scales, tensor.shape.rows, tensor.shape.cols,
                                view.group_size, dst, exec);
      } else {
        dequantize_int8_to_fp32(reinterpret_cast<const int8_t *>(data), scales, tensor.shape.rows, tensor.shape.cols,
                                view.group_size, dst, exec);
      }
      return;
    case SlabPrecision::kNf4: {
      const auto *bf16_scales = reinterpret_cast<const uint16_t *>(image + tensor.scales_offset);
      std::vector<uint8_t> high_first;
      if (!nf4_codes_high_nibble_first(view)) {
        // A version-2 image: the same levels and scales, the nibbles of each byte the other way.
        high_first.resize(tensor.data_bytes);
        for (std::size_t b = 0; b < high_first.size(); ++b) {
          high_first[b] = static_cast<uint8_t>((data[b] << 4) | (data[b] >> 4));
        }
        data = high_first.data();
      }
      if constexpr (std::is_same_v<Out, uint16_t>) {
        dequantize_nf4_to_bf16(data, bf16_scales, tensor.shape.rows, tensor.shape.cols, view.group_size, dst, exec);
      } else {
        dequantize_nf4_to_fp32(data, bf16_scales, tensor.shape.rows, tensor.shape.cols, view.group_size, dst, exec);
      }
      return;
    }
  }
}

}  // namespace

void decode_slab_tensor_to_bf16(const uint8_t *image, const SlabView &view, std::size_t index, uint16_t *dst,
                                const CpuExec &exec) {
  decode_tensor(image, view, index, dst, exec, "decode_slab_tensor_to_bf16");
}

void decode_slab_tensor_to_fp32(const uint8_t *image, const SlabView &view, std::size_t index, float *dst,
                                const CpuExec &exec) {
  decode_tensor(image, view, index, dst, exec, "decode_slab_tensor_to_fp32");
}

}  // namespace sp::kernels
