// The Taylor terms of an image on the CPU: rows in fixed chunks, each quantized and decoded as
// build_slab() and the engines' decode would (groups never cross rows, so a chunk of rows is
// encoded exactly as within the whole tensor), then summed against the gradient in double.
#include "sp/kernels/taylor.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "sp/kernels/bf16.h"
#include "sp/kernels/nf4.h"
#include "sp/kernels/quantize.h"
#include "parallel.h"
#include "scalar_math.h"

namespace sp::kernels {
namespace {

constexpr std::size_t kChunkElements = 16384;

// Scratch of one thread: the chunk's image as bf16, and its codes and scales.
struct ChunkScratch {
  std::vector<uint16_t> image;
  std::vector<int8_t> int8_codes;
  std::vector<uint8_t> nf4_codes;
  std::vector<float> int8_scales;
  std::vector<uint16_t> nf4_scales;
};

void decode_chunk(const SlabEncoding &encoding, const float *master, std::size_t rows, std::size_t cols,
                  ChunkScratch &s) {
  const CpuExec one_thread{CpuImpl::kVectorized, 1, nullptr};
  const std::size_t n = rows * cols;
  s.image.resize(n);
  switch (encoding.precision) {
    case SlabPrecision::kBf16:
      fp32_to_bf16(master, s.image.data(), n, Bf16Options{}, one_thread);
      return;
    case SlabPrecision::kInt8:
      s.int8_codes.resize(n);
      s.int8_scales.resize(scale_count(rows, cols, encoding.group_size));
      quantize_int8(master, DType::kFloat32, rows, cols, QuantizeOptions{encoding.group_size}, s.int8_codes.data(),
                    s.int8_scales.data(), one_thread);
      dequantize_int8_to_bf16(s.int8_codes.data(), s.int8_scales.data(), rows, cols, encoding.group_size,
                              s.image.data(), one_thread);
      return;
    case SlabPrecision::kNf4:
      s.nf4_codes.resize(nf4_code_bytes(rows, cols));
      s.nf4_scales.resize(nf4_scale_count(rows, cols, encoding.group_size));
      quantize_nf4(master, DType::kFloat32, rows, cols, encoding.group_size, s.nf4_codes.data(), s.nf4_scales.data(),
                   one_thread);
      dequantize_nf4_to_bf16(s.nf4_codes.data(), s.nf4_scales.data(), rows, cols, encoding.group_size,
                             s.image.data(), one_thread);
      return;
  }
  throw std::invalid_argument("image_taylor_sums: unknown slab precision");
}

TaylorSums chunk_sums(const uint16_t *image, const float *master, const float *grad, std::size_t n) {
  double first = 0.0, second = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    const float decoded = detail::bf16_bits_to_float(image[i]);
    const double d = static_cast<double>(decoded) - static_cast<double>(master[i]);
    const double gd = static_cast<double>(grad[i]) * d;
    first += gd;
    second += gd * gd;
  }
  return {first, second};
}

}  // namespace

TaylorSums image_taylor_sums(const SlabEncoding &encoding, const float *master, const float *grad, TensorShape shape,
                             const CpuExec &exec) {
  slab_image_bytes(encoding, &shape, 1);  // the encoding's checks, by the slab's own rules
  const std::size_t rows = shape.rows, cols = shape.cols;
  if (rows == 0 || cols == 0) return {};
  if (master == nullptr || grad == nullptr) {
    throw std::invalid_argument("image_taylor_sums: null master or gradient with a non-empty shape");
  }
  const std::size_t rows_per_chunk = std::max<std::size_t>(1, kChunkElements / cols);
  const std::size_t n_chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  std::vector<TaylorSums> partial(n_chunks);
  detail::parallel_ranges(n_chunks, exec, 2, [&](std::size_t begin, std::size_t end) {
    ChunkScratch scratch;
    for (std::size_t c = begin; c < end; ++c) {
      const std::size_t row = c * rows_per_chunk;
      const std::size_t chunk_rows = std::min(rows_per_chunk, rows - row);
      const std::size_t offset = row * cols;
      decode_chunk(encoding, master + offset, chunk_rows, cols, scratch);
      partial[c] = chunk_sums(scratch.image.data(), master + offset, grad + offset, chunk_rows * cols);
    }
  });
  TaylorSums total;
  for (const TaylorSums &p : partial) {
    total.first += p.first;
    total.second += p.second;
  }
  return total;
}

}  // namespace sp::kernels
