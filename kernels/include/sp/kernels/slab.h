// The slab: one block's weights packed into one contiguous buffer, the unit that crosses PCIe.
//
// Image layout, version 3 (all integers little-endian, offsets from the image start):
//   SlabHeader                      64 bytes
//   SlabTensorEntry[tensor_count]   64 bytes each
//   zero padding to a 256-byte boundary
//   tensor 0 payload, zero padding to 256, tensor 1 payload, ... (each payload 256-aligned:
//     bf16 bit patterns for kBf16, int8 codes for kInt8, packed 4-bit codes for kNf4 (two per byte, sp/kernels/nf4.h;
//     ceil(rows * cols / 2) bytes))
//   zero padding to 16 bytes, then the scales of tensor 0, tensor 1, ... (quantized only):
//     fp32 for kInt8, bf16 bit patterns for kNf4
// total_bytes covers everything above; slab_image_bytes() returns it before building.
//
// Version 2 added kNf4 and nothing else: a version-1 image (bf16 or int8 only) has the
// same layout, and read_slab() still accepts it. Version 3 changed kNf4 only, to bitsandbytes'
// codes: the first element of a pair in the HIGH nibble (version 2: the low one), and the
// scale absmax rounded to nearest bf16 (version 2: rounded up, the codes computed against it).
// read_slab() accepts every version and decode_slab_tensor_* decodes a version-2 kNf4 image as
// it was written; the GPU path streams only the images this build writes
// (nf4_codes_high_nibble_first). build_slab() always writes version 3.
//
// A reader on the GPU side applies the same offsets to the device copy of the image.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "sp/kernels/dtype.h"

namespace sp::kernels {

enum class SlabPrecision : uint32_t {
  kBf16 = 1,
  kInt8 = 2,
  // 3 was FP8 E4M3. No route ever streamed it, so it was removed; read_slab() rejects the code.
  kNf4 = 4,  // version 2 and later
};

const char *slab_precision_name(SlabPrecision precision);

constexpr uint32_t kSlabMagic = 0x42414C53u;        // "SLAB" read as little-endian bytes
constexpr uint16_t kSlabVersion = 3;                // what build_slab() writes
constexpr uint16_t kSlabOldestReadableVersion = 1;  // read_slab() accepts 1 to 3
constexpr uint64_t kSlabDataAlignment = 256;
constexpr uint64_t kSlabScaleAlignment = 16;

struct SlabHeader {
  uint32_t magic;         // kSlabMagic
  uint16_t version;       // kSlabVersion (1 and 2 are still read; 1 has no kNf4)
  uint16_t header_bytes;  // sizeof(SlabHeader)
  uint32_t precision;     // SlabPrecision
  uint32_t group_size;    // 0 = per row; quantized precisions only (0 for kBf16; kNf4 needs
                          // 32, 64, 128 or 256)
  uint32_t tensor_count;
  uint32_t entry_bytes;     // sizeof(SlabTensorEntry)
  uint64_t total_bytes;     // size of the whole image
  uint64_t payload_offset;  // first payload byte (256-aligned)
  uint64_t scales_offset;   // first scale byte; == total_bytes when there are no scales
  uint32_t table_crc32;     // CRC-32 (IEEE) of this header with table_crc32 = 0, then the entries
  uint32_t reserved0;       // zero
  uint64_t reserved1;       // zero
};
static_assert(sizeof(SlabHeader) == 64, "slab header layout is part of the format");

struct SlabTensorEntry {
  uint64_t rows;
  uint64_t cols;
  uint64_t data_offset;    // 256-aligned
  uint64_t data_bytes;     // rows * cols * element size; nf4_code_bytes(rows, cols) for kNf4
  uint64_t scales_offset;  // 16-aligned for the first tensor, then scale-size-aligned (4, or 2
                           // for kNf4); 0 when none
  uint64_t scale_count;    // scale_count(rows, cols, group_size), nf4_scale_count for kNf4;
                           // 0 for kBf16
  uint64_t reserved[2];    // zero
};
static_assert(sizeof(SlabTensorEntry) == 64, "slab entry layout is part of the format");

// Shape of one tensor: row-major rows x cols (a 1-D tensor of n elements is 1 x n).
struct TensorShape {
  uint64_t rows = 0;
  uint64_t cols = 0;
};

struct SlabEncoding {
  SlabPrecision precision = SlabPrecision::kBf16;
  uint32_t group_size = 0;                     // kInt8: 0 = per row, else one of kSupportedGroupSizes;
                                               // kNf4: 32, 64, 128 or 256 (kNf4DefaultGroupSize = 64)
  Rounding rounding = Rounding::kNearestEven;  // kBf16 and kInt8; kNf4 is RNE only
  uint64_t seed = 0;                           // stochastic rounding: tensor i uses a seed derived from (seed, i)
};

// Exact size in bytes of the image build_slab() writes for these shapes.
// Throws std::invalid_argument for a bad encoding (unknown precision, unsupported group size,
// group size with kBf16, group size 0 with kNf4, stochastic rounding with kNf4) or
// a size overflow.
uint64_t slab_image_bytes(const SlabEncoding &encoding, const TensorShape *shapes, std::size_t n_tensors);

// One fp32 master tensor to pack.
struct SlabTensorSource {
  const float *master = nullptr;
  TensorShape shape;
};

// Writes the image of `tensors` into `image` (capacity bytes, e.g. a pinned slab from a pool)
// and returns its size (== slab_image_bytes). Padding bytes are zero, so equal inputs give
// byte-identical images. Throws std::invalid_argument when capacity is too small, on a bad
// encoding or on a null master with a non-empty shape.
uint64_t build_slab(const SlabEncoding &encoding, const SlabTensorSource *tensors, std::size_t n_tensors,
                    uint8_t *image, uint64_t capacity, const CpuExec &exec = {});

// A validated image, as plain numbers; offsets are relative to the image start.
struct SlabTensorView {
  TensorShape shape;
  uint64_t data_offset = 0;
  uint64_t data_bytes = 0;
  uint64_t scales_offset = 0;
  uint64_t scale_count = 0;
};

struct SlabView {
  SlabPrecision precision = SlabPrecision::kBf16;
  uint16_t version = kSlabVersion;
  uint32_t group_size = 0;
  uint64_t total_bytes = 0;
  std::vector<SlabTensorView> tensors;
};

struct SlabReadResult {
  bool ok = false;
  std::string error;  // set when !ok: which field is wrong and what was expected
  SlabView view;
};

// kNf4 codes of version 3 and later pack the first of a pair in the high nibble, as
// sp/kernels/nf4.h and its CUDA twin read them; version 2 packed it in the low one.
inline bool nf4_codes_high_nibble_first(const SlabView &view) { return view.version >= 3; }

// Validates an image of `size` bytes: magic, version (1 to 3; kNf4 needs 2), struct sizes, the
// table checksum, precision, group size, every offset and size in bounds, aligned, consistent with the shapes
// and non-overlapping, reserved fields zero, total_bytes == size. Never reads outside
// [image, image + size). The checksum covers the header and the entry table (every offset the
// reader trusts), not the payload: hashing the payload would cost a pass over the bytes that
// cross PCIe.
SlabReadResult read_slab(const uint8_t *image, uint64_t size);

// Decodes tensor `index` of a validated image (view from read_slab on the same bytes) into
// rows * cols values. kBf16 images copy their bit patterns; quantized ones dequantize.
// Throws std::out_of_range for a bad index.
void decode_slab_tensor_to_bf16(const uint8_t *image, const SlabView &view, std::size_t index, uint16_t *dst,
                                const CpuExec &exec = {});
void decode_slab_tensor_to_fp32(const uint8_t *image, const SlabView &view, std::size_t index, float *dst,
                                const CpuExec &exec = {});

}  // namespace sp::kernels
