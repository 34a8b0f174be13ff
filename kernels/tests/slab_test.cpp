#include "sp/kernels/slab.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "sp/kernels/bf16.h"
#include "sp/kernels/fp8.h"
#include "sp/kernels/quantize.h"
#include "test_support.h"

namespace sp::kernels {
namespace {

struct AlignedFree {
  void operator()(uint8_t *p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t[], AlignedFree>;

Buffer allocate(uint64_t bytes, uint8_t fill) {
  Buffer buffer(static_cast<uint8_t *>(std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256)));
  std::memset(buffer.get(), fill, (bytes + 255) / 256 * 256 + 256);
  return buffer;
}

// The tensors of one GPT block of width d: LN gains/biases, QKV, attention output, 4d MLP.
std::vector<TensorShape> gpt_block(uint64_t d) {
  return {{1, d}, {1, d}, {3 * d, d}, {1, 3 * d}, {d, d}, {1, d},
          {1, d}, {1, d}, {4 * d, d}, {1, 4 * d}, {d, 4 * d}, {1, d}};
}

struct Block {
  std::vector<std::vector<float>> masters;
  std::vector<SlabTensorSource> sources;
  std::vector<TensorShape> shapes;
};

Block make_block(const std::vector<TensorShape> &shapes) {
  Block block;
  block.shapes = shapes;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    block.masters.push_back(testing::special_matrix(shapes[i].rows, shapes[i].cols, 100 + i));
  }
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    block.sources.push_back(SlabTensorSource{block.masters[i].data(), shapes[i]});
  }
  return block;
}

const std::vector<TensorShape> kOddShapes = {{257, 259}, {1, 7}, {0, 5}, {128, 129}, {1, 1}, {9, 1000}};

std::vector<SlabEncoding> all_encodings() {
  std::vector<SlabEncoding> encodings = {SlabEncoding{SlabPrecision::kBf16, 0, Rounding::kNearestEven, 0},
                                         SlabEncoding{SlabPrecision::kBf16, 0, Rounding::kStochastic, 8}};
  for (const uint32_t group : {0u, 32u, 64u, 128u, 256u}) {
    encodings.push_back(SlabEncoding{SlabPrecision::kInt8, group, Rounding::kNearestEven, 0});
    encodings.push_back(SlabEncoding{SlabPrecision::kInt8, group, Rounding::kStochastic, 8});
    encodings.push_back(SlabEncoding{SlabPrecision::kFp8E4M3, group, Rounding::kNearestEven, 0});
  }
  return encodings;
}

TEST(Slab, RoundTripMatchesTheKernelsForEveryEncoding) {
  const Block block = make_block(kOddShapes);
  for (const SlabEncoding &encoding : all_encodings()) {
    SCOPED_TRACE(std::string(slab_precision_name(encoding.precision)) + " group " +
                 std::to_string(encoding.group_size));
    const uint64_t bytes = slab_image_bytes(encoding, block.shapes.data(), block.shapes.size());
    Buffer image = allocate(bytes, 0xCD);
    ASSERT_EQ(build_slab(encoding, block.sources.data(), block.sources.size(), image.get(), bytes), bytes);
    const SlabReadResult read = read_slab(image.get(), bytes);
    ASSERT_TRUE(read.ok) << read.error;
    ASSERT_EQ(read.view.tensors.size(), block.shapes.size());
    EXPECT_EQ(read.view.precision, encoding.precision);
    for (std::size_t i = 0; i < block.shapes.size(); ++i) {
      const SlabTensorView &t = read.view.tensors[i];
      EXPECT_EQ(t.data_offset % kSlabDataAlignment, 0u);
      EXPECT_EQ(t.shape.rows, block.shapes[i].rows);
      const std::size_t n = t.shape.rows * t.shape.cols;
      std::vector<uint16_t> decoded(n);
      decode_slab_tensor_to_bf16(image.get(), read.view, i, decoded.data());
      // What the same kernels give on the tensor alone (stochastic seeds are per tensor, so
      // only round-to-nearest is reproduced here; stochastic images are checked for
      // determinism below).
      if (encoding.rounding == Rounding::kStochastic) continue;
      std::vector<uint16_t> expected(n);
      const float *master = block.masters[i].data();
      const std::size_t scales = encoding.precision == SlabPrecision::kBf16
                                     ? 0
                                     : scale_count(t.shape.rows, t.shape.cols, encoding.group_size);
      std::vector<float> s(scales);
      if (encoding.precision == SlabPrecision::kBf16) {
        fp32_to_bf16(master, expected.data(), n);
      } else if (encoding.precision == SlabPrecision::kInt8) {
        std::vector<int8_t> codes(n);
        quantize_int8(master, DType::kFloat32, t.shape.rows, t.shape.cols,
                      QuantizeOptions{encoding.group_size}, codes.data(), s.data());
        dequantize_int8_to_bf16(codes.data(), s.data(), t.shape.rows, t.shape.cols,
                                encoding.group_size, expected.data());
      } else {
        std::vector<uint8_t> codes(n);
        quantize_fp8_e4m3(master, DType::kFloat32, t.shape.rows, t.shape.cols,
                          encoding.group_size, codes.data(), s.data());
        dequantize_fp8_e4m3_to_bf16(codes.data(), s.data(), t.shape.rows, t.shape.cols,
                                    encoding.group_size, expected.data());
      }
      EXPECT_EQ(decoded, expected) << "tensor " << i;
    }
  }
}

TEST(Slab, ImagesAreDeterministicWhateverTheBufferHeld) {
  const Block block = make_block(kOddShapes);
  for (const SlabEncoding &encoding : all_encodings()) {
    const uint64_t bytes = slab_image_bytes(encoding, block.shapes.data(), block.shapes.size());
    Buffer a = allocate(bytes, 0x00);
    Buffer b = allocate(bytes, 0xFF);
    build_slab(encoding, block.sources.data(), block.sources.size(), a.get(), bytes,
               CpuExec{CpuImpl::kVectorized, 1});
    build_slab(encoding, block.sources.data(), block.sources.size(), b.get(), bytes,
               CpuExec{CpuImpl::kVectorized, 3});
    ASSERT_EQ(0, std::memcmp(a.get(), b.get(), bytes)) << slab_precision_name(encoding.precision);
  }
}

TEST(Slab, Int8PerRowIsAtMost052OfBf16ForGptBlocks) {
  for (const uint64_t d : {1024u, 2048u, 4096u}) {
    const std::vector<TensorShape> shapes = gpt_block(d);
    const double bf16 = static_cast<double>(slab_image_bytes(SlabEncoding{SlabPrecision::kBf16}, shapes.data(), shapes.size()));
    uint64_t elements = 0;
    for (const TensorShape &s : shapes) elements += s.rows * s.cols;
    EXPECT_GE(bf16, 2.0 * static_cast<double>(elements));
    for (const uint32_t group : {0u, 128u}) {
      const double int8 = static_cast<double>(
          slab_image_bytes(SlabEncoding{SlabPrecision::kInt8, group}, shapes.data(), shapes.size()));
      EXPECT_LE(int8 / bf16, 0.52) << "d = " << d << " group " << group;
    }
  }
}

TEST(Slab, ByteCountIsExact) {
  // Two tensors, per-row INT8: header 64 + 2 entries 128 = 192 -> payload at 256.
  // Tensor 0: 3 x 5 = 15 bytes at 256; tensor 1: 1 x 300 at 512, ends at 812.
  // Scales at align16(812) = 816: 3 + 1 floats -> 832.
  const std::vector<TensorShape> shapes = {{3, 5}, {1, 300}};
  EXPECT_EQ(slab_image_bytes(SlabEncoding{SlabPrecision::kInt8}, shapes.data(), 2), 832u);
  // BF16: 30 bytes at 256, 600 bytes at 512 -> 1112, no scales.
  EXPECT_EQ(slab_image_bytes(SlabEncoding{SlabPrecision::kBf16}, shapes.data(), 2), 1112u);
  // Group 32: tensor 1 has ceil(300 / 32) = 10 scales -> 3 + 10 floats from 816 -> 868.
  EXPECT_EQ(slab_image_bytes(SlabEncoding{SlabPrecision::kInt8, 32}, shapes.data(), 2), 868u);
  EXPECT_EQ(slab_image_bytes(SlabEncoding{SlabPrecision::kInt8}, nullptr, 0), 256u);
}

TEST(Slab, RejectsBadEncodingsAndBuffers) {
  const Block block = make_block({{4, 4}});
  const uint64_t bytes = slab_image_bytes(SlabEncoding{SlabPrecision::kInt8}, block.shapes.data(), 1);
  Buffer image = allocate(bytes, 0);
  EXPECT_THROW(build_slab(SlabEncoding{SlabPrecision::kInt8}, block.sources.data(), 1, image.get(), bytes - 1),
               std::invalid_argument);
  EXPECT_THROW(build_slab(SlabEncoding{SlabPrecision::kInt8}, block.sources.data(), 1, image.get() + 4, bytes),
               std::invalid_argument);
  EXPECT_THROW(slab_image_bytes(SlabEncoding{SlabPrecision::kBf16, 32}, block.shapes.data(), 1), std::invalid_argument);
  EXPECT_THROW(slab_image_bytes(SlabEncoding{SlabPrecision::kInt8, 100}, block.shapes.data(), 1), std::invalid_argument);
  EXPECT_THROW(slab_image_bytes(SlabEncoding{static_cast<SlabPrecision>(9)}, block.shapes.data(), 1), std::invalid_argument);
  EXPECT_THROW(slab_image_bytes(SlabEncoding{SlabPrecision::kFp8E4M3, 0, Rounding::kStochastic}, block.shapes.data(), 1),
               std::invalid_argument);
  const TensorShape huge{1ull << 40, 1ull << 40};
  EXPECT_THROW(slab_image_bytes(SlabEncoding{SlabPrecision::kBf16}, &huge, 1), std::invalid_argument);
  build_slab(SlabEncoding{SlabPrecision::kInt8}, block.sources.data(), 1, image.get(), bytes);
  const SlabReadResult read = read_slab(image.get(), bytes);
  ASSERT_TRUE(read.ok);
  std::vector<float> out(16);
  EXPECT_THROW(decode_slab_tensor_to_fp32(image.get(), read.view, 1, out.data()), std::out_of_range);
}

class SlabCorruption : public ::testing::Test {
 protected:
  void SetUp() override {
    block_ = make_block(kOddShapes);
    bytes_ = slab_image_bytes(encoding_, block_.shapes.data(), block_.shapes.size());
    image_ = allocate(bytes_, 0);
    build_slab(encoding_, block_.sources.data(), block_.sources.size(), image_.get(), bytes_);
  }
  SlabEncoding encoding_{SlabPrecision::kInt8, 64, Rounding::kNearestEven, 0};
  Block block_;
  uint64_t bytes_ = 0;
  Buffer image_;
};

TEST_F(SlabCorruption, EveryTruncationIsAnError) {
  for (uint64_t size = 0; size < bytes_; size += (size < 1024 ? 1 : 997)) {
    const SlabReadResult read = read_slab(image_.get(), size);
    ASSERT_FALSE(read.ok) << size;
    ASSERT_FALSE(read.error.empty());
  }
  EXPECT_FALSE(read_slab(nullptr, bytes_).ok);
}

TEST_F(SlabCorruption, EveryBitFlipInTheHeaderAndTableIsAnError) {
  const uint64_t table_bytes = sizeof(SlabHeader) + block_.shapes.size() * sizeof(SlabTensorEntry);
  for (uint64_t byte = 0; byte < table_bytes; ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      image_[byte] ^= static_cast<uint8_t>(1u << bit);
      const SlabReadResult read = read_slab(image_.get(), bytes_);
      image_[byte] ^= static_cast<uint8_t>(1u << bit);
      ASSERT_FALSE(read.ok) << "byte " << byte << " bit " << bit;
    }
  }
  EXPECT_TRUE(read_slab(image_.get(), bytes_).ok);
}

TEST_F(SlabCorruption, ErrorsNameTheField) {
  SlabHeader header;
  std::memcpy(&header, image_.get(), sizeof header);
  header.version = 2;
  std::memcpy(image_.get(), &header, sizeof header);
  EXPECT_NE(read_slab(image_.get(), bytes_).error.find("version 2"), std::string::npos);
  header.version = kSlabVersion;
  header.group_size = 48;
  std::memcpy(image_.get(), &header, sizeof header);
  EXPECT_NE(read_slab(image_.get(), bytes_).error.find("group_size 48"), std::string::npos);
  header.group_size = 64;
  std::memcpy(image_.get(), &header, sizeof header);
  SlabTensorEntry entry;
  std::memcpy(&entry, image_.get() + sizeof(SlabHeader), sizeof entry);
  entry.data_offset += 256;
  std::memcpy(image_.get() + sizeof(SlabHeader), &entry, sizeof entry);
  EXPECT_NE(read_slab(image_.get(), bytes_).error.find("table_crc32"), std::string::npos);
}

}  // namespace
}  // namespace sp::kernels
