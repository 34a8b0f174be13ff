// The CPU cases, run on the GPU and compared with the CPU versions bit for bit (moments and
// relative error, whose reduction orders differ by design, within a tolerance). Every test
// skips when no CUDA device is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "sp/kernels/bf16.h"
#include "sp/kernels/cuda/bf16.h"
#include "sp/kernels/cuda/moments.h"
#include "sp/kernels/cuda/nf4.h"
#include "sp/kernels/cuda/quantize.h"
#include "sp/kernels/cuda/relative_error.h"
#include "sp/kernels/moments.h"
#include "sp/kernels/nf4.h"
#include "sp/kernels/quantize.h"
#include "sp/kernels/relative_error.h"
#include "sp/kernels/slab.h"
#include "sp/testing/gpu_gate.h"
#include "test_support.h"

namespace sp::kernels {
namespace {

bool has_cuda_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define SKIP_WITHOUT_GPU() SP_SKIP_UNLESS_GPU(has_cuda_device(), "no CUDA device")

void check(cudaError_t error) { ASSERT_EQ(error, cudaSuccess) << cudaGetErrorString(error); }

// A device copy of a host vector, freed on scope exit.
template <typename T>
struct DeviceBuffer {
  T *ptr = nullptr;
  std::size_t size = 0;
  explicit DeviceBuffer(std::size_t n) : size(n) {
    if (n != 0) {
      EXPECT_EQ(cudaMalloc(reinterpret_cast<void **>(&ptr), n * sizeof(T)), cudaSuccess);
    }
  }
  explicit DeviceBuffer(const std::vector<T> &host) : DeviceBuffer(host.size()) {
    if (size != 0) {
      EXPECT_EQ(cudaMemcpy(ptr, host.data(), size * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer &) = delete;
  DeviceBuffer &operator=(const DeviceBuffer &) = delete;
  std::vector<T> download() const {
    std::vector<T> host(size);
    if (size != 0) {
      EXPECT_EQ(cudaMemcpy(host.data(), ptr, size * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return host;
  }
};

// fp32 outputs compare by bits, except that any NaN equals any NaN: the GPU produces the
// canonical NaN where the CPU propagates the operand's payload.
bool same_floats(const std::vector<float> &a, const std::vector<float> &b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (!testing::same_bits(a[i], b[i])) return false;
  }
  return true;
}

TEST(CudaQuantizeInt8, MatchesCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  std::vector<testing::Shape> shapes = testing::odd_shapes();
  shapes.push_back({64, 4096});  // the vectorized dequant path
  for (const testing::Shape shape : shapes) {
    const std::vector<float> x = testing::special_matrix(shape.rows, shape.cols, 21);
    std::vector<uint16_t> x_bf16(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) x_bf16[i] = testing::bf16_truncate(x[i]);
    DeviceBuffer<float> d_x(x);
    DeviceBuffer<uint16_t> d_x_bf16(x_bf16);
    for (const uint32_t group : {0u, 32u, 64u, 128u, 256u}) {
      for (const Rounding rounding : {Rounding::kNearestEven, Rounding::kStochastic}) {
        for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
          SCOPED_TRACE(std::to_string(shape.rows) + "x" + std::to_string(shape.cols) + " group " +
                       std::to_string(group) + " " + dtype_name(dtype));
          const QuantizeOptions options{group, rounding, 77};
          const std::size_t n_scales = scale_count(shape.rows, shape.cols, group);
          const void *host_src = dtype == DType::kFloat32 ? static_cast<const void *>(x.data()) : x_bf16.data();
          const void *device_src = dtype == DType::kFloat32 ? static_cast<const void *>(d_x.ptr) : d_x_bf16.ptr;
          std::vector<int8_t> codes(x.size());
          std::vector<float> scales(n_scales);
          std::vector<uint16_t> bf16(x.size());
          std::vector<float> fp32(x.size());
          quantize_int8(host_src, dtype, shape.rows, shape.cols, options, codes.data(), scales.data());
          dequantize_int8_to_bf16(codes.data(), scales.data(), shape.rows, shape.cols, group, bf16.data());
          dequantize_int8_to_fp32(codes.data(), scales.data(), shape.rows, shape.cols, group, fp32.data());
          DeviceBuffer<int8_t> d_codes(x.size());
          DeviceBuffer<float> d_scales(n_scales);
          DeviceBuffer<uint16_t> d_bf16(x.size());
          DeviceBuffer<float> d_fp32(x.size());
          cuda::quantize_int8(device_src, dtype, shape.rows, shape.cols, options, d_codes.ptr, d_scales.ptr, nullptr);
          cuda::dequantize_int8_to_bf16(d_codes.ptr, d_scales.ptr, shape.rows, shape.cols, group, d_bf16.ptr, nullptr);
          cuda::dequantize_int8_to_fp32(d_codes.ptr, d_scales.ptr, shape.rows, shape.cols, group, d_fp32.ptr, nullptr);
          check(cudaDeviceSynchronize());
          ASSERT_EQ(codes, d_codes.download());
          ASSERT_TRUE(same_floats(scales, d_scales.download()));
          ASSERT_EQ(bf16, d_bf16.download());
          ASSERT_TRUE(same_floats(fp32, d_fp32.download()));
        }
      }
    }
  }
}

TEST(CudaBf16, MatchesCpuForBothRoundings) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  std::vector<float> x(300007);
  for (float &v : x) {
    const uint32_t bits = rng();
    std::memcpy(&v, &bits, sizeof v);
  }
  DeviceBuffer<float> d_x(x);
  for (const Rounding rounding : {Rounding::kNearestEven, Rounding::kStochastic}) {
    for (const std::size_t offset : {std::size_t{0}, std::size_t{1}}) {  // aligned and misaligned
      const std::size_t n = x.size() - offset;
      std::vector<uint16_t> expected(n);
      fp32_to_bf16(x.data() + offset, expected.data(), n, Bf16Options{rounding, 9});
      DeviceBuffer<uint16_t> d_out(n);
      cuda::fp32_to_bf16(d_x.ptr + offset, d_out.ptr, n, Bf16Options{rounding, 9}, nullptr);
      ASSERT_EQ(expected, d_out.download()) << offset;
    }
  }
}

TEST(CudaGradMoments, MatchesCpuAndIsDeterministic) {
  SKIP_WITHOUT_GPU();
  std::vector<float> a = testing::gaussian(257 * 259, 1);
  a[10] = std::nanf("");
  const std::vector<float> b = testing::gaussian(3 * 16384 + 5, 2, 1e-3f);
  std::vector<uint16_t> c(1001);
  for (std::size_t i = 0; i < c.size(); ++i) c[i] = testing::bf16_truncate(static_cast<float>(i) - 500.0f);
  c[7] = 0xFF80;  // -Inf
  DeviceBuffer<float> d_a(a);
  DeviceBuffer<float> d_b(b);
  DeviceBuffer<uint16_t> d_c(c);
  const std::vector<GradTensor> host = {{a.data(), a.size(), DType::kFloat32, 2},
                                        {b.data(), b.size(), DType::kFloat32, 0},
                                        {nullptr, 0, DType::kFloat32, 0},
                                        {c.data(), c.size(), DType::kBFloat16, 2},
                                        {a.data() + 1, 7, DType::kFloat32, 0}};
  const std::vector<GradTensor> device = {{d_a.ptr, a.size(), DType::kFloat32, 2},
                                          {d_b.ptr, b.size(), DType::kFloat32, 0},
                                          {nullptr, 0, DType::kFloat32, 0},
                                          {d_c.ptr, c.size(), DType::kBFloat16, 2},
                                          {d_a.ptr + 1, 7, DType::kFloat32, 0}};
  const uint32_t n_blocks = 4;
  std::vector<sp_grad_moments_v1> expected(n_blocks);
  grad_moments(host.data(), host.size(), n_blocks, expected.data(), CpuExec{CpuImpl::kReference, 1});
  cuda::GradMomentsPlan plan(device.data(), device.size(), n_blocks);
  DeviceBuffer<uint8_t> workspace(plan.workspace_bytes());
  DeviceBuffer<sp_grad_moments_v1> out(n_blocks);
  plan.upload(workspace.ptr, nullptr);
  plan.launch(workspace.ptr, out.ptr, nullptr);
  const std::vector<sp_grad_moments_v1> first = out.download();
  for (uint32_t blk = 0; blk < n_blocks; ++blk) {
    SCOPED_TRACE(blk);
    EXPECT_EQ(first[blk].block_id, blk);
    EXPECT_EQ(first[blk].count, expected[blk].count);
    EXPECT_EQ(first[blk].nonfinite, expected[blk].nonfinite);
    EXPECT_EQ(first[blk].max_abs, expected[blk].max_abs);
    EXPECT_NEAR(first[blk].sum_sq, expected[blk].sum_sq, 1e-5 * expected[blk].sum_sq);
    EXPECT_NEAR(first[blk].sum, expected[blk].sum,
                1e-5 * std::sqrt(expected[blk].sum_sq * static_cast<double>(expected[blk].count)));
  }
  for (int run = 0; run < 5; ++run) {
    plan.launch(workspace.ptr, out.ptr, nullptr);
    const std::vector<sp_grad_moments_v1> again = out.download();
    ASSERT_EQ(0, std::memcmp(first.data(), again.data(), first.size() * sizeof(first[0])));
  }
}

TEST(CudaRelativeError, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  const std::vector<float> a = testing::gaussian(200001, 4);
  std::vector<uint16_t> b(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) b[i] = testing::bf16_truncate(a[i]);
  const double expected = relative_error(a.data(), DType::kFloat32, b.data(), DType::kBFloat16, a.size());
  DeviceBuffer<float> d_a(a);
  DeviceBuffer<uint16_t> d_b(b);
  std::size_t bytes = 0;
  cuda::relative_error(d_a.ptr, DType::kFloat32, d_b.ptr, DType::kBFloat16, a.size(), nullptr, &bytes, nullptr,
                       nullptr);
  DeviceBuffer<uint8_t> workspace(bytes);
  DeviceBuffer<double> result(1);
  cuda::relative_error(d_a.ptr, DType::kFloat32, d_b.ptr, DType::kBFloat16, a.size(), workspace.ptr, &bytes, result.ptr,
                       nullptr);
  EXPECT_NEAR(result.download()[0], expected, 1e-9 * expected);
}

TEST(CudaSlab, DeviceDequantOfAnImageMatchesTheCpuDecode) {
  SKIP_WITHOUT_GPU();
  const std::vector<TensorShape> shapes = {{256, 1024}, {1, 1024}, {257, 259}};
  std::vector<std::vector<float>> masters;
  std::vector<SlabTensorSource> sources;
  for (std::size_t i = 0; i < shapes.size(); ++i)
    masters.push_back(testing::gaussian(shapes[i].rows * shapes[i].cols, 30 + i));
  for (std::size_t i = 0; i < shapes.size(); ++i) sources.push_back({masters[i].data(), shapes[i]});
  for (const uint32_t group : {0u, 128u}) {
    const SlabEncoding encoding{SlabPrecision::kInt8, group};
    const uint64_t bytes = slab_image_bytes(encoding, shapes.data(), shapes.size());
    std::vector<uint64_t> storage((bytes + 7) / 8 + 32);
    auto *image = reinterpret_cast<uint8_t *>(storage.data());
    build_slab(encoding, sources.data(), sources.size(), image, bytes);
    const SlabReadResult read = read_slab(image, bytes);
    ASSERT_TRUE(read.ok) << read.error;
    DeviceBuffer<uint8_t> d_image(std::vector<uint8_t>(image, image + bytes));
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      const SlabTensorView &t = read.view.tensors[i];
      std::vector<uint16_t> expected(t.shape.rows * t.shape.cols);
      decode_slab_tensor_to_bf16(image, read.view, i, expected.data());
      DeviceBuffer<uint16_t> d_out(expected.size());
      cuda::dequantize_int8_to_bf16(reinterpret_cast<const int8_t *>(d_image.ptr + t.data_offset),
                                    reinterpret_cast<const float *>(d_image.ptr + t.scales_offset), t.shape.rows,
                                    t.shape.cols, group, d_out.ptr, nullptr);
      ASSERT_EQ(expected, d_out.download()) << i;
    }
  }
}

TEST(CudaNf4, MatchesCpuReferenceBitForBit) {
  SKIP_WITHOUT_GPU();
  std::vector<testing::Shape> shapes = testing::odd_shapes();
  shapes.push_back({64, 4096});  // the vectorized dequant path
  shapes.push_back({3, 96});     // vector path, groups of 32 inside a row
  shapes.push_back({5, 40});     // vector path, cols a multiple of 8 but not of 32
  shapes.push_back({301, 256});
  for (const testing::Shape shape : shapes) {
    std::vector<float> x = testing::special_matrix(shape.rows, shape.cols, 23);
    if (x.size() > 8) {
      x[x.size() - 1] = 3.3e38f;  // the clamped scale
      x[x.size() / 3] = 1e-40f;   // a subnormal value (its group is finite)
    }
    std::vector<uint16_t> x_bf16(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) x_bf16[i] = testing::bf16_truncate(x[i]);
    DeviceBuffer<float> d_x(x);
    DeviceBuffer<uint16_t> d_x_bf16(x_bf16);
    for (const uint32_t group : {32u, 64u, 128u, 256u}) {
      for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
        SCOPED_TRACE(std::to_string(shape.rows) + "x" + std::to_string(shape.cols) + " group " + std::to_string(group) +
                     " " + dtype_name(dtype));
        const std::size_t n_codes = nf4_code_bytes(shape.rows, shape.cols);
        const std::size_t n_scales = nf4_scale_count(shape.rows, shape.cols, group);
        const void *host_src = dtype == DType::kFloat32 ? static_cast<const void *>(x.data()) : x_bf16.data();
        const void *device_src = dtype == DType::kFloat32 ? static_cast<const void *>(d_x.ptr) : d_x_bf16.ptr;
        const CpuExec reference{CpuImpl::kReference, 1};
        // The CPU twin: fp32 absmax (what the device quantizer writes) and the slab's bf16
        // scales; the device decodes both.
        std::vector<uint8_t> codes(n_codes);
        std::vector<float> absmax(n_scales);
        std::vector<uint16_t> scales(n_scales);
        std::vector<uint16_t> bf16(x.size()), exact_bf16(x.size());
        std::vector<float> fp32(x.size()), exact_fp32(x.size());
        quantize_nf4(host_src, dtype, shape.rows, shape.cols, group, codes.data(), absmax.data(), reference);
        quantize_nf4(host_src, dtype, shape.rows, shape.cols, group, codes.data(), scales.data(), reference);
        dequantize_nf4_to_bf16(codes.data(), scales.data(), shape.rows, shape.cols, group, bf16.data(), reference);
        dequantize_nf4_to_fp32(codes.data(), scales.data(), shape.rows, shape.cols, group, fp32.data(), reference);
        dequantize_nf4_to_bf16(codes.data(), absmax.data(), shape.rows, shape.cols, group, exact_bf16.data(),
                               reference);
        dequantize_nf4_to_fp32(codes.data(), absmax.data(), shape.rows, shape.cols, group, exact_fp32.data(),
                               reference);
        DeviceBuffer<uint8_t> d_codes(std::vector<uint8_t>(n_codes, 0xA5));
        DeviceBuffer<float> d_absmax(n_scales);
        DeviceBuffer<uint16_t> d_scales(scales);
        DeviceBuffer<uint16_t> d_bf16(x.size()), d_exact_bf16(x.size());
        DeviceBuffer<float> d_fp32(x.size()), d_exact_fp32(x.size());
        cuda::quantize_nf4(device_src, dtype, shape.rows, shape.cols, group, d_codes.ptr, d_absmax.ptr, nullptr);
        cuda::dequantize_nf4_to_bf16(d_codes.ptr, d_scales.ptr, shape.rows, shape.cols, group, d_bf16.ptr, nullptr);
        cuda::dequantize_nf4_to_fp32(d_codes.ptr, d_scales.ptr, shape.rows, shape.cols, group, d_fp32.ptr, nullptr);
        cuda::dequantize_nf4_to_bf16(d_codes.ptr, d_absmax.ptr, shape.rows, shape.cols, group, d_exact_bf16.ptr,
                                     nullptr);
        cuda::dequantize_nf4_to_fp32(d_codes.ptr, d_absmax.ptr, shape.rows, shape.cols, group, d_exact_fp32.ptr,
                                     nullptr);
        check(cudaDeviceSynchronize());
        ASSERT_EQ(codes, d_codes.download());
        ASSERT_TRUE(same_floats(absmax, d_absmax.download()));
        ASSERT_EQ(bf16, d_bf16.download());
        ASSERT_TRUE(same_floats(fp32, d_fp32.download()));
        ASSERT_EQ(exact_bf16, d_exact_bf16.download());
        ASSERT_TRUE(same_floats(exact_fp32, d_exact_fp32.download()));
        // The scalar dequant path too (misaligned destination).
        if (!x.empty()) {
          DeviceBuffer<uint16_t> d_shifted(x.size() + 1);
          cuda::dequantize_nf4_to_bf16(d_codes.ptr, d_scales.ptr, shape.rows, shape.cols, group, d_shifted.ptr + 1,
                                       nullptr);
          std::vector<uint16_t> shifted = d_shifted.download();
          ASSERT_EQ(bf16, std::vector<uint16_t>(shifted.begin() + 1, shifted.end()));
        }
      }
    }
  }
}

TEST(CudaSlab, DeviceNf4DequantOfAnImageMatchesTheCpuDecode) {
  SKIP_WITHOUT_GPU();
  const std::vector<TensorShape> shapes = {{384, 128}, {128, 128}, {512, 128}, {128, 512}, {257, 259}};
  std::vector<std::vector<float>> masters;
  std::vector<SlabTensorSource> sources;
  for (std::size_t i = 0; i < shapes.size(); ++i)
    masters.push_back(testing::gaussian(shapes[i].rows * shapes[i].cols, 40 + i, 0.02f));
  for (std::size_t i = 0; i < shapes.size(); ++i) sources.push_back({masters[i].data(), shapes[i]});
  for (const uint32_t group : {32u, 64u, 256u}) {
    const SlabEncoding encoding{SlabPrecision::kNf4, group};
    const uint64_t bytes = slab_image_bytes(encoding, shapes.data(), shapes.size());
    std::vector<uint64_t> storage((bytes + 7) / 8 + 32);
    auto *image = reinterpret_cast<uint8_t *>(storage.data());
    build_slab(encoding, sources.data(), sources.size(), image, bytes);
    const SlabReadResult read = read_slab(image, bytes);
    ASSERT_TRUE(read.ok) << read.error;
    DeviceBuffer<uint8_t> d_image(std::vector<uint8_t>(image, image + bytes));
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      const SlabTensorView &t = read.view.tensors[i];
      std::vector<uint16_t> expected(t.shape.rows * t.shape.cols);
      decode_slab_tensor_to_bf16(image, read.view, i, expected.data(), CpuExec{CpuImpl::kReference, 1});
      DeviceBuffer<uint16_t> d_out(expected.size());
      cuda::dequantize_nf4_to_bf16(d_image.ptr + t.data_offset,
                                   reinterpret_cast<const uint16_t *>(d_image.ptr + t.scales_offset), t.shape.rows,
                                   t.shape.cols, group, d_out.ptr, nullptr);
      ASSERT_EQ(expected, d_out.download()) << i;
    }
  }
}

}  // namespace
}  // namespace sp::kernels
