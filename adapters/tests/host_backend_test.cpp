#include "sp/adapters/host_backend.h"

#include <cstring>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "sp/kernels/nf4.h"
#include "sp/kernels/quantize.h"

namespace sp::adapters {
namespace {

std::vector<std::byte> pattern(std::size_t bytes, unsigned seed) {
  std::vector<std::byte> data(bytes);
  for (std::size_t i = 0; i < bytes; ++i) {
    data[i] = static_cast<std::byte>((i * 131 + seed) & 0xFF);
  }
  return data;
}

TEST(HostBackend, CopiesLandInOrderAndEventsMarkCompletion) {
  HostBackendOptions options;
  options.bandwidth_cap_bytes_per_second = 1e9;  // paced: the bytes must not change
  options.pacing_chunk_bytes = 1000;
  HostBackend backend(options);
  Region host = backend.allocate_pinned_host(10000);
  Region device = backend.allocate_device(10000);
  const auto first = pattern(10000, 1);
  const auto second = pattern(4096, 2);
  std::memcpy(host.data(), first.data(), first.size());
  auto start = backend.create_event();
  auto done = backend.create_event();
  backend.record(*start, Queue::copy);
  backend.copy_host_to_device_async(device.data(), host.data(), first.size());
  // The second copy writes the first 4096 bytes again, after the first copy.
  std::vector<std::byte> staged(second);
  backend.copy_host_to_device_async(device.data(), staged.data(), staged.size());
  backend.record(*done, Queue::copy);
  backend.synchronize(*done);
  EXPECT_TRUE(backend.query(*done));
  std::vector<std::byte> out(10000);
  backend.read_device(out.data(), device.data(), out.size());
  EXPECT_EQ(0, std::memcmp(out.data(), second.data(), second.size()));
  EXPECT_EQ(0, std::memcmp(out.data() + 4096, first.data() + 4096, 10000 - 4096));
  EXPECT_GE(backend.elapsed_seconds(*start, *done), 0.0);
}

TEST(HostBackend, DequantQueueWaitsForTheCopyItDependsOn) {
  HostBackend backend;
  constexpr std::size_t rows = 3, cols = 65;
  std::vector<float> master(rows * cols);
  std::iota(master.begin(), master.end(), -90.0f);
  std::vector<std::int8_t> codes(rows * cols);
  std::vector<float> scales(rows);
  sp::kernels::quantize_int8(master.data(), sp::kernels::DType::kFloat32, rows, cols, {}, codes.data(), scales.data());
  // Scales sit 4-byte aligned after the codes, as in a slab: the kernels load them as floats.
  const std::size_t scales_offset = (codes.size() + alignof(float) - 1) / alignof(float) * alignof(float);
  const std::size_t bytes = scales_offset + scales.size() * sizeof(float);
  Region host = backend.allocate_pinned_host(bytes);
  Region device = backend.allocate_device(bytes + rows * cols * 2);
  std::memcpy(host.data(), codes.data(), codes.size());
  std::memcpy(host.data() + scales_offset, scales.data(), scales.size() * sizeof(float));

  auto copied = backend.create_event();
  auto dequantized = backend.create_event();
  backend.copy_host_to_device_async(device.data(), host.data(), bytes);
  backend.record(*copied, Queue::copy);
  backend.wait(Queue::dequant, *copied);
  DequantJob job;
  auto *out = reinterpret_cast<std::uint16_t *>(device.data() + bytes);
  job.tensors.push_back(DequantTensor{reinterpret_cast<const std::int8_t *>(device.data()),
                                      reinterpret_cast<const float *>(device.data() + scales_offset), rows, cols, out});
  backend.dequantize_async(job);
  backend.record(*dequantized, Queue::dequant);
  backend.wait(Queue::compute, *dequantized);  // the caller is the compute queue

  std::vector<std::uint16_t> expected(rows * cols);
  sp::kernels::dequantize_int8_to_bf16(codes.data(), scales.data(), rows, cols, 0, expected.data());
  EXPECT_EQ(0, std::memcmp(out, expected.data(), expected.size() * 2));
}

// The caller may drop an event right after it queued a record and a wait on it (the engine does
// on destruction); the queues finish both. Fails under ASan or TSan when a queue keeps a reference.
TEST(HostBackend, AnEventCanBeDestroyedWhileQueuesStillRecordAndWaitOnIt) {
  HostBackendOptions options;
  options.bandwidth_cap_bytes_per_second = 1e6;  // the copy queue stays busy for about 20 ms
  options.pacing_chunk_bytes = 1000;
  HostBackend backend(options);
  Region host = backend.allocate_pinned_host(20000);
  Region device = backend.allocate_device(20000);
  const auto data = pattern(20000, 3);
  std::memcpy(host.data(), data.data(), data.size());
  backend.copy_host_to_device_async(device.data(), host.data(), data.size());
  {
    auto dropped = backend.create_event();
    backend.record(*dropped, Queue::copy);
    backend.wait(Queue::dequant, *dropped);
  }
  auto copied = backend.create_event();
  auto dequant_done = backend.create_event();
  backend.record(*copied, Queue::copy);
  backend.record(*dequant_done, Queue::dequant);
  backend.synchronize(*copied);
  backend.synchronize(*dequant_done);
  std::vector<std::byte> out(data.size());
  backend.read_device(out.data(), device.data(), out.size());
  EXPECT_EQ(0, std::memcmp(out.data(), data.data(), data.size()));
}

// The NF4 job: packed codes and bf16 scales, dequantized by the same queue and dispatch.
TEST(HostBackend, DequantizesAnNf4JobLikeTheCpuKernel) {
  HostBackend backend;
  constexpr std::size_t rows = 3, cols = 71;  // odd element count: the last high nibble is 0
  constexpr std::uint32_t group = 32;
  std::vector<float> master(rows * cols);
  for (std::size_t i = 0; i < master.size(); ++i) {
    master[i] = 0.01f * static_cast<float>(static_cast<int>(i * 37 % 101) - 50);
  }
  std::vector<std::uint8_t> codes(sp::kernels::nf4_code_bytes(rows, cols));
  std::vector<std::uint16_t> scales(sp::kernels::nf4_scale_count(rows, cols, group));
  sp::kernels::quantize_nf4(master.data(), sp::kernels::DType::kFloat32, rows, cols, group, codes.data(),
                            scales.data());
  const std::size_t scales_offset = (codes.size() + 1) / 2 * 2;
  const std::size_t bytes = scales_offset + scales.size() * sizeof(std::uint16_t);
  Region device = backend.allocate_device(bytes + rows * cols * 2);
  std::memcpy(device.data(), codes.data(), codes.size());
  std::memcpy(device.data() + scales_offset, scales.data(), scales.size() * sizeof(std::uint16_t));

  DequantJob job;
  job.precision = Precision::nf4;
  job.group_size = group;
  auto *out = reinterpret_cast<std::uint16_t *>(device.data() + bytes);
  job.tensors.push_back(DequantTensor{device.data(), device.data() + scales_offset, rows, cols, out});
  auto dequantized = backend.create_event();
  backend.dequantize_async(job);
  backend.record(*dequantized, Queue::dequant);
  backend.wait(Queue::compute, *dequantized);

  std::vector<std::uint16_t> expected(rows * cols);
  sp::kernels::dequantize_nf4_to_bf16(codes.data(), scales.data(), rows, cols, group, expected.data());
  std::vector<std::uint16_t> actual(out, out + rows * cols);
  EXPECT_EQ(actual, expected);
}

TEST(HostBackend, ABf16DequantJobIsRejected) {
  DequantJob job;
  job.precision = Precision::bf16;
  EXPECT_THROW(dequantize_job(job, DequantCodecs{}, nullptr), std::invalid_argument);
}

TEST(HostBackend, EventsFollowTheirLatestRecord) {
  HostBackend backend;
  auto event = backend.create_event();
  EXPECT_TRUE(backend.query(*event));  // never recorded: nothing to wait for
  backend.record(*event, Queue::compute);
  EXPECT_TRUE(backend.query(*event));
  backend.wait(Queue::copy, *event);
  backend.record(*event, Queue::copy);
  backend.synchronize(*event);
  EXPECT_TRUE(backend.query(*event));
}

TEST(HostBackend, RejectsNegativeBandwidthCap) {
  HostBackendOptions options;
  options.bandwidth_cap_bytes_per_second = -1;
  EXPECT_THROW(HostBackend{options}, std::invalid_argument);
}

}  // namespace
}  // namespace sp::adapters
