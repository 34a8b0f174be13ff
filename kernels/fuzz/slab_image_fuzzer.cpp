// Fuzzes the slab reader (sp/kernels/slab.h): read_slab() on arbitrary bytes, then, on what it
// accepts, every decoder of every tensor.
//
// Input: one flags byte, then the image. Flags bit 0: re-seal the table checksum before reading
// (so that mutations reach the field checks behind the CRC, not only the CRC itself).
//
// Contract checked: read_slab() never throws and never reads outside the image (ASan); an
// accepted view lies inside the image and is consistent with its shapes; decoding an accepted
// image never throws; the vectorized and reference decoders agree bit for bit (NaN = NaN); a BF16
// image decodes to fp32 as its bit patterns widened, and rebuilding a BF16 image from its decoded
// values gives an image that read_slab() accepts with the same shapes and that decodes to the
// same values. Any violation aborts.
#include "fuzz_support.h"
#include "sp/kernels/slab.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

namespace {

namespace k = sp::kernels;

[[noreturn]] void fail(const std::string &what) { sp::fuzz::contract_violated("slab_image_fuzzer", what); }

void check(bool ok, const char *what) {
  if (!ok) fail(what);
}

std::uint32_t crc32_update(std::uint32_t crc, const std::uint8_t *bytes, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    crc ^= bytes[i];
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return crc;
}

// Recomputes table_crc32 over the header (field zeroed) and the entry table, when both fit.
void reseal(std::uint8_t *image, std::size_t size) {
  if (size < sizeof(k::SlabHeader)) return;
  k::SlabHeader header;
  std::memcpy(&header, image, sizeof header);
  const std::uint64_t table = std::uint64_t{header.tensor_count} * sizeof(k::SlabTensorEntry);
  if (table > size - sizeof header) return;
  header.table_crc32 = 0;
  std::uint32_t crc = crc32_update(0xFFFFFFFFu, reinterpret_cast<const std::uint8_t *>(&header), sizeof header);
  crc = ~crc32_update(crc, image + sizeof header, static_cast<std::size_t>(table));
  header.table_crc32 = crc;
  std::memcpy(image, &header, sizeof header);
}

bool same_bits_or_both_nan(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::memcmp(&a, &b, sizeof a) == 0;
}

bool bf16_is_nan(std::uint16_t bits) { return (bits & 0x7F80u) == 0x7F80u && (bits & 0x007Fu) != 0; }

bool same_bf16_or_both_nan(std::uint16_t a, std::uint16_t b) {
  if (bf16_is_nan(a) || bf16_is_nan(b)) return bf16_is_nan(a) && bf16_is_nan(b);
  return a == b;
}

struct AlignedFree {
  void operator()(std::uint8_t *p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<std::uint8_t, AlignedFree>;

// A zeroed buffer of at least `size` bytes (one more block, so never empty), 256-aligned as slabs are.
AlignedBuffer aligned_buffer(std::size_t size) {
  const std::size_t capacity = (size + k::kSlabDataAlignment) / k::kSlabDataAlignment * k::kSlabDataAlignment;
  AlignedBuffer buffer(static_cast<std::uint8_t *>(std::aligned_alloc(k::kSlabDataAlignment, capacity)));
  if (!buffer) fail("out of memory");
  std::memset(buffer.get(), 0, capacity);
  return buffer;
}

AlignedBuffer aligned_copy(const std::uint8_t *data, std::size_t size) {
  AlignedBuffer buffer = aligned_buffer(size);
  if (size != 0) std::memcpy(buffer.get(), data, size);
  return buffer;
}

void check_view(const k::SlabView &view, std::uint64_t size) {
  check(view.total_bytes == size, "accepted view's total_bytes differs from the image size");
  for (const k::SlabTensorView &t : view.tensors) {
    check(t.data_offset <= size && t.data_bytes <= size - t.data_offset, "accepted tensor data outside the image");
    check(t.data_offset % k::kSlabDataAlignment == 0, "accepted tensor data not 256-aligned");
    const std::uint64_t scale_bytes = view.precision == k::SlabPrecision::kNf4 ? 2 : 4;
    if (t.scale_count != 0) {
      check(t.scales_offset <= size && t.scale_count <= (size - t.scales_offset) / scale_bytes,
            "accepted tensor scales outside the image");
    }
    if (t.shape.rows != 0) check(t.shape.cols <= UINT64_MAX / t.shape.rows, "accepted shape overflows");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t flags = data[0];
  ++data;
  --size;
  AlignedBuffer image = aligned_copy(data, size);
  if (flags & 1u) reseal(image.get(), size);

  const k::SlabReadResult result = k::read_slab(image.get(), size);
  if (!result.ok) {
    check(!result.error.empty(), "rejected image without an error message");
    return 0;
  }
  const k::SlabView &view = result.view;
  check_view(view, size);

  const k::CpuExec vectorized{k::CpuImpl::kVectorized, 1};
  const k::CpuExec reference{k::CpuImpl::kReference, 1};
  std::vector<std::vector<float>> decoded(view.tensors.size());
  for (std::size_t i = 0; i < view.tensors.size(); ++i) {
    const k::SlabTensorView &t = view.tensors[i];
    const std::uint64_t n = t.shape.rows * t.shape.cols;
    // The data bytes bound the element count (at least half a byte per element), and they lie in the image.
    check(n <= 2 * t.data_bytes + 1, "element count exceeds what the data bytes can hold");
    std::vector<float> fp32(n), fp32_ref(n);
    std::vector<std::uint16_t> bf16(n), bf16_ref(n);
    k::decode_slab_tensor_to_fp32(image.get(), view, i, fp32.data(), vectorized);
    k::decode_slab_tensor_to_fp32(image.get(), view, i, fp32_ref.data(), reference);
    k::decode_slab_tensor_to_bf16(image.get(), view, i, bf16.data(), vectorized);
    k::decode_slab_tensor_to_bf16(image.get(), view, i, bf16_ref.data(), reference);
    for (std::uint64_t e = 0; e < n; ++e) {
      check(same_bits_or_both_nan(fp32[e], fp32_ref[e]), "fp32 decode: vectorized and reference differ");
      check(same_bf16_or_both_nan(bf16[e], bf16_ref[e]), "bf16 decode: vectorized and reference differ");
      if (view.precision == k::SlabPrecision::kBf16) {
        std::uint32_t widened = std::uint32_t{bf16[e]} << 16;
        float expected;
        std::memcpy(&expected, &widened, sizeof expected);
        check(std::memcmp(&expected, &fp32[e], sizeof expected) == 0, "bf16 image: fp32 decode is not the widened bits");
      }
    }
    decoded[i] = std::move(fp32);
  }
  bool threw = false;
  try {
    k::decode_slab_tensor_to_fp32(image.get(), view, view.tensors.size(), nullptr, vectorized);
  } catch (const std::out_of_range &) {
    threw = true;
  }
  check(threw, "a tensor index past the end was not std::out_of_range");

  // A BF16 image rebuilt from its decoded values reads back with the same shapes and values.
  if (view.precision == k::SlabPrecision::kBf16) {
    std::vector<k::SlabTensorSource> sources(view.tensors.size());
    std::vector<k::TensorShape> shapes(view.tensors.size());
    for (std::size_t i = 0; i < view.tensors.size(); ++i) {
      sources[i] = {decoded[i].data(), view.tensors[i].shape};
      shapes[i] = view.tensors[i].shape;
    }
    const k::SlabEncoding encoding{};
    const std::uint64_t bytes = k::slab_image_bytes(encoding, shapes.data(), shapes.size());
    AlignedBuffer rebuilt = aligned_buffer(static_cast<std::size_t>(bytes));
    check(k::build_slab(encoding, sources.data(), sources.size(), rebuilt.get(), bytes, vectorized) == bytes,
          "build_slab wrote another size than slab_image_bytes");
    const k::SlabReadResult again = k::read_slab(rebuilt.get(), bytes);
    check(again.ok, "read_slab rejected a rebuilt BF16 image");
    check(again.view.tensors.size() == view.tensors.size(), "rebuilt image has another tensor count");
    for (std::size_t i = 0; i < view.tensors.size(); ++i) {
      const k::TensorShape shape = view.tensors[i].shape;
      check(again.view.tensors[i].shape.rows == shape.rows && again.view.tensors[i].shape.cols == shape.cols,
            "rebuilt image has another shape");
      std::vector<float> values(shape.rows * shape.cols);
      k::decode_slab_tensor_to_fp32(rebuilt.get(), again.view, i, values.data(), vectorized);
      for (std::size_t e = 0; e < values.size(); ++e) {
        check(same_bits_or_both_nan(values[e], decoded[i][e]), "rebuilt BF16 image decodes to other values");
      }
    }
  }
  return 0;
}
