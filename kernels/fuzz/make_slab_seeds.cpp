// Writes the seed corpus of slab_image_fuzzer: small valid images of every precision (one flags
// byte 0x01 = re-seal, then the image), and a few near-valid ones (truncated, one header field
// changed without re-sealing). Run once by hand; the files are committed:
//
//   build-fuzz/bin/slab_image_seed_writer kernels/fuzz/corpus/slab_image
#include "sp/kernels/slab.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace k = sp::kernels;

namespace {

void write_seed(const std::string &dir, const std::string &name, std::uint8_t flags, const std::vector<std::uint8_t> &image,
                std::size_t size) {
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out.put(static_cast<char>(flags));
  out.write(reinterpret_cast<const char *>(image.data()), static_cast<std::streamsize>(size));
}

std::vector<std::uint8_t> build(const k::SlabEncoding &encoding, const std::vector<k::TensorShape> &shapes) {
  std::vector<std::vector<float>> masters;
  std::vector<k::SlabTensorSource> sources;
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    std::vector<float> values(shapes[t].rows * shapes[t].cols);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = std::sin(0.7f * static_cast<float>(i + 3 * t)) * 2.5f;
    masters.push_back(std::move(values));
  }
  for (std::size_t t = 0; t < shapes.size(); ++t) sources.push_back({masters[t].data(), shapes[t]});
  const std::uint64_t bytes = k::slab_image_bytes(encoding, shapes.data(), shapes.size());
  auto *raw = static_cast<std::uint8_t *>(std::aligned_alloc(256, (bytes + 255) / 256 * 256));
  k::build_slab(encoding, sources.data(), sources.size(), raw, bytes);
  std::vector<std::uint8_t> image(raw, raw + bytes);
  std::free(raw);
  return image;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const std::vector<k::TensorShape> two = {{2, 8}, {1, 5}};
  const std::vector<k::TensorShape> grouped = {{2, 64}};

  const auto bf16 = build({k::SlabPrecision::kBf16, 0}, two);
  write_seed(dir, "bf16-two-tensors", 1, bf16, bf16.size());
  write_seed(dir, "bf16-truncated", 0, bf16, bf16.size() - 7);
  const auto empty = build({k::SlabPrecision::kBf16, 0}, {});
  write_seed(dir, "bf16-no-tensor", 1, empty, empty.size());
  write_seed(dir, "int8-per-row", 1, build({k::SlabPrecision::kInt8, 0}, two), build({k::SlabPrecision::kInt8, 0}, two).size());
  const auto int8 = build({k::SlabPrecision::kInt8, 32}, grouped);
  write_seed(dir, "int8-group32", 1, int8, int8.size());
  // The precision code FP8 E4M3 had (3), which the reader now refuses: the INT8 image, re-sealed.
  auto retired = build({k::SlabPrecision::kInt8, 0}, two);
  retired[8] = 3;
  write_seed(dir, "fp8-retired-code", 1, retired, retired.size());
  const auto nf4 = build({k::SlabPrecision::kNf4, 32}, {{1, 33}, {2, 32}});
  write_seed(dir, "nf4-group32", 1, nf4, nf4.size());
  // Version 1 (no NF4): the same BF16 image with the version field set to 1, re-sealed.
  auto v1 = bf16;
  v1[4] = 1;
  write_seed(dir, "bf16-version1", 1, v1, v1.size());
  // A changed field without re-sealing: the checksum rejects it.
  auto stale = int8;
  stale[12] ^= 0x40;
  write_seed(dir, "int8-stale-crc", 0, stale, stale.size());
  return 0;
}
