#include "sp/adapters/streaming_engine.h"

#include <algorithm>
#include <chrono>
#include <iterator>
#include <stdexcept>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "sp/adapters/route_encoding.h"
#include "sp/kernels/nf4.h"
#include "sp/kernels/quantize.h"

namespace sp::adapters {
namespace {

namespace kn = sp::kernels;

std::string block_label(const BlockSpec &block, std::uint32_t id) {
  return fmt::format("block '{}' (id {})", block.name, id);
}

// The group size of each route: per StreamingConfig for the quantized ones, none for BF16.
struct GroupSizes {
  std::uint32_t int8 = 0;
  std::uint32_t nf4 = kn::kNf4DefaultGroupSize;
};

GroupSizes group_sizes(const StreamingConfig &config) {
  return GroupSizes{config.int8_group_size, config.nf4_group_size};
}

kn::SlabEncoding encoding_for(Precision precision, const GroupSizes &groups) {
  return slab_encoding(precision, precision == Precision::nf4 ? groups.nf4 : groups.int8);
}

std::uint64_t image_size(const BlockSpec &block, Precision precision, const GroupSizes &groups) {
  std::vector<kn::TensorShape> shapes;
  shapes.reserve(block.tensors.size());
  for (const TensorSpec &tensor : block.tensors) {
    shapes.push_back(kn::TensorShape{tensor.rows, tensor.cols});
  }
  return kn::slab_image_bytes(encoding_for(precision, groups), shapes.data(), shapes.size());
}

constexpr Precision kAllPrecisions[] = {Precision::bf16, Precision::int8, Precision::nf4};

// Everything that can be wrong with the config or the blocks is reported here, before any
// memory is allocated, naming the field or the block and both sizes.
const StreamingConfig &validated(const StreamingConfig &config, const std::vector<BlockSpec> &blocks) {
  if (blocks.empty()) {
    throw std::invalid_argument("StreamingEngine: there are no blocks to stream");
  }
  if (config.host_slab_bytes == 0) {
    throw std::invalid_argument("StreamingConfig.host_slab_bytes must be > 0");
  }
  if (config.host_slab_count == 0) {
    throw std::invalid_argument("StreamingConfig.host_slab_count must be > 0");
  }
  if (config.device_slot_bytes == 0) {
    throw std::invalid_argument("StreamingConfig.device_slot_bytes must be > 0");
  }
  if (!kn::is_supported_group_size(config.int8_group_size)) {
    throw std::invalid_argument(
        fmt::format("StreamingConfig.int8_group_size is {}; expected 0 (one scale per row), 32, 64, 128 "
                    "or 256",
                    config.int8_group_size));
  }
  if (!kn::is_supported_nf4_group_size(config.nf4_group_size)) {
    throw std::invalid_argument(
        fmt::format("StreamingConfig.nf4_group_size is {}; expected 32, 64, 128 or 256 (NF4 has no "
                    "per-row mode)",
                    config.nf4_group_size));
  }
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    const BlockSpec &block = blocks[b];
    if (block.tensors.empty()) {
      throw std::invalid_argument(fmt::format("{} has no tensors", block_label(block, b)));
    }
    for (const TensorSpec &tensor : block.tensors) {
      if (tensor.master == nullptr && tensor.rows * tensor.cols != 0) {
        throw std::invalid_argument(
            fmt::format("{}: tensor '{}' has no master weights", block_label(block, b), tensor.name));
      }
    }
    const std::uint64_t bf16_bytes = image_size(block, Precision::bf16, group_sizes(config));
    if (bf16_bytes > config.device_slot_bytes) {
      throw std::invalid_argument(
          fmt::format("{} needs {} bytes of bf16 weights in a device slot but "
                      "StreamingConfig.device_slot_bytes is {}",
                      block_label(block, b), bf16_bytes, config.device_slot_bytes));
    }
    std::uint64_t largest_image = 0;
    for (Precision precision : kAllPrecisions) {
      largest_image = std::max(largest_image, image_size(block, precision, group_sizes(config)));
    }
    if (largest_image > config.host_slab_bytes) {
      throw std::invalid_argument(
          fmt::format("{} has a {} byte transfer image but StreamingConfig.host_slab_bytes is {}",
                      block_label(block, b), largest_image, config.host_slab_bytes));
    }
  }
  return config;
}

// A slot's staging region holds the image of either quantized route.
std::uint64_t largest_quantized_image(const std::vector<BlockSpec> &blocks, const GroupSizes &groups) {
  std::uint64_t largest = 0;
  for (const BlockSpec &block : blocks) {
    for (Precision precision : kAllPrecisions) {
      if (is_quantized(precision)) {
        largest = std::max(largest, image_size(block, precision, groups));
      }
    }
  }
  return largest;
}

}  // namespace

struct StreamingEngine::BlockImage {
  std::uint32_t slab = 0;
  Precision precision = Precision::bf16;
  std::uint64_t weights_version = 0;                    // bumped by on_weights_updated()
  std::uint64_t built_version = 0;                      // the weights version the image holds
  kn::SlabView view;                                    // layout of the image now in the slab
  const Event *last_reader = nullptr;                   // copy-end event of the latest copy out of the slab
  std::uint64_t bytes[std::size(kAllPrecisions)] = {};  // image size per route
  std::uint64_t bytes_of(Precision p) const { return bytes[static_cast<std::size_t>(p)]; }
};

struct StreamingEngine::FetchEvents {
  std::unique_ptr<Event> copy_start;
  std::unique_ptr<Event> copy_end;
  std::unique_ptr<Event> dequant_start;
  std::unique_ptr<Event> dequant_end;
};

struct StreamingEngine::PendingStep {
  StepTransferMetrics metrics;
  std::uint32_t generation = 0;
  std::vector<Precision> fetch_precisions;  // one per issued fetch
};

StreamingEngine::StreamingEngine(TransferBackend &backend, const StreamingConfig &config, std::vector<BlockSpec> blocks)
    : backend_(backend),
      config_(validated(config, blocks)),
      blocks_(std::move(blocks)),
      schedule_(
          ScheduleOptions{static_cast<std::uint32_t>(blocks_.size()), config_.backward}),
      bridge_(static_cast<std::uint32_t>(blocks_.size())),
      pool_(backend, config_.host_slab_bytes, config_.host_slab_count),
      slots_(backend, config_.device_slot_bytes, largest_quantized_image(blocks_, group_sizes(config_)),
             config_.prefetch_window + 2) {
  const auto n = static_cast<std::uint32_t>(blocks_.size());
  images_.resize(n);
  updating_.assign(n, false);
  masters_forgotten_.assign(n, false);
  bf16_layouts_.resize(n);
  std::size_t most_tensors = 0;
  for (std::uint32_t b = 0; b < n; ++b) {
    BlockImage &image = images_[b];
    for (Precision precision : kAllPrecisions) {
      image.bytes[static_cast<std::size_t>(precision)] = image_size(blocks_[b], precision, group_sizes(config_));
    }
    image.slab =
        pool_.acquire(fmt::format("{} at startup (StreamingConfig.host_slab_count must be at least the number of "
                                  "blocks, {})",
                                  block_label(blocks_[b], b), n));
    // Every block starts on the BF16 route; its image also fixes the compute layout.
    image.weights_version = 1;
    ensure_image(b, Precision::bf16);
    bf16_layouts_[b] = image.view;
    most_tensors = std::max(most_tensors, blocks_[b].tensors.size());
  }
  const std::size_t fetches = schedule_.fetches().size();
  events_.resize(2 * fetches);
  for (FetchEvents &set : events_) {
    set.copy_start = backend_.create_event();
    set.copy_end = backend_.create_event();
    set.dequant_start = backend_.create_event();
    set.dequant_end = backend_.create_event();
  }
  fetch_used_.assign(fetches, false);
  fetch_precision_.assign(fetches, Precision::bf16);
  view_.tensors.reserve(most_tensors);
  dequant_job_.tensors.reserve(most_tensors);
  if (!config_.metrics_path.empty()) {
    metrics_writer_ = std::make_unique<MetricsJsonlWriter>(config_.metrics_path);
  }
  current_ = StepTransferMetrics{};
}

StreamingEngine::~StreamingEngine() {
  try {
    flush_metrics();
    // Worker queues may still hold waits on this engine's events: let them drain first.
    std::unique_ptr<Event> drained = backend_.create_event();
    for (Queue queue : {Queue::copy, Queue::dequant}) {
      backend_.record(*drained, queue);
      backend_.synchronize(*drained);
    }
  } catch (const std::exception &error) {
    spdlog::error("StreamingEngine shutdown: {}", error.what());
  }
}

std::uint64_t StreamingEngine::image_bytes(std::uint32_t block, Precision precision) const {
  return images_.at(block).bytes_of(precision);
}

std::vector<sp_block_desc_v1> StreamingEngine::block_descs() const {
  std::vector<sp_block_desc_v1> descs(blocks_.size());
  for (std::uint32_t b = 0; b < blocks_.size(); ++b) {
    sp_block_desc_v1 &desc = descs[b];
    desc.struct_size = sizeof desc;
    desc.block_id = b;
    desc.num_params = 0;
    for (const TensorSpec &tensor : blocks_[b].tensors) {
      desc.num_params += tensor.rows * tensor.cols;
    }
    desc.bf16_bytes = images_[b].bytes_of(Precision::bf16);
    desc.int8_bytes = images_[b].bytes_of(Precision::int8);
    // sp_block_desc_v1 is frozen: the NF4 size is nf4_image_bytes(b).
    desc.name = blocks_[b].name.c_str();
  }
  return descs;
}

void StreamingEngine::require_step(const char *call) const {
  if (!in_step_) {
    throw std::logic_error(fmt::format("StreamingEngine::{}: no step is active; call begin_step()", call));
  }
}

StreamingEngine::FetchEvents &StreamingEngine::events_of(std::uint32_t generation, std::uint32_t fetch) {
  return events_[generation * schedule_.fetches().size() + fetch];
}

const Event &StreamingEngine::ready_event(std::uint32_t fetch) {
  FetchEvents &events = events_of(generation_, fetch);
  return is_quantized(fetch_precision_[fetch]) ? *events.dequant_end : *events.copy_end;
}

void StreamingEngine::stall_on(const Event &event) {
  const auto start = std::chrono::steady_clock::now();
  backend_.synchronize(event);
  ++current_.stalls;
  current_.stall_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void StreamingEngine::reclaim_retired_slabs() {
  for (auto it = retired_.begin(); it != retired_.end();) {
    if (backend_.query(*it->last_reader)) {
      pool_.release(it->slab);
      it = retired_.erase(it);
    } else {
      ++it;
    }
  }
}

// The stale-image guard. An image is current when it was built for this precision from the
// latest weights; otherwise it is rebuilt, never in a slab that a copy may still be reading.
void StreamingEngine::ensure_image(std::uint32_t block, Precision precision) {
  require_not_updating(block, "fetch");
  const BlockImage &image = images_[block];
  if (image.precision == precision && image.built_version == image.weights_version) {
    return;
  }
  const BlockSpec &spec = blocks_[block];
  if (masters_forgotten_[block]) {
    throw std::logic_error(fmt::format(
        "StreamingEngine: the {} image of {} is not here and its masters live in another process; it must arrive "
        "through receive_image() (its owner sends the image of the route this block takes)",
        precision_name(precision), block_label(spec, block)));
  }
  std::vector<kn::SlabTensorSource> sources;
  sources.reserve(spec.tensors.size());
  for (const TensorSpec &tensor : spec.tensors) {
    sources.push_back(kn::SlabTensorSource{tensor.master, kn::TensorShape{tensor.rows, tensor.cols}});
  }
  write_image(block, precision, [&](const kn::SlabEncoding &encoding, std::uint8_t *slab, std::uint64_t capacity) {
    return kn::build_slab(encoding, sources.data(), sources.size(), slab, capacity);
  });
}

void StreamingEngine::write_image(std::uint32_t block, Precision precision, const ImageWriter &write) {
  const std::uint32_t target = writable_slab(block);
  std::uint64_t bytes = 0;
  try {
    bytes = write(encoding_for(precision, group_sizes(config_)), reinterpret_cast<std::uint8_t *>(pool_.data(target)),
                  pool_.slab_bytes());
  } catch (...) {
    drop_written_slab(block, target);
    throw;
  }
  install_image(block, precision, target, bytes);
}

std::uint32_t StreamingEngine::writable_slab(std::uint32_t block) {
  const BlockImage &image = images_[block];
  if (image.last_reader != nullptr && !backend_.query(*image.last_reader)) {
    reclaim_retired_slabs();
    if (std::optional<std::uint32_t> spare = pool_.try_acquire()) {
      return *spare;
    }
    stall_on(*image.last_reader);
  }
  return image.slab;
}

void StreamingEngine::drop_written_slab(std::uint32_t block, std::uint32_t slab) {
  if (slab != images_[block].slab) pool_.release(slab);
}

void StreamingEngine::install_image(std::uint32_t block, Precision precision, std::uint32_t slab,
                                    std::uint64_t bytes) {
  BlockImage &image = images_[block];
  kn::SlabReadResult read = kn::read_slab(reinterpret_cast<const std::uint8_t *>(pool_.data(slab)), bytes);
  if (!read.ok) {
    drop_written_slab(block, slab);
    throw std::logic_error(fmt::format("the {} transfer image of {} failed validation: {}", precision_name(precision),
                                       block_label(blocks_[block], block), read.error));
  }
  if (read.view.precision == kn::SlabPrecision::kNf4 && !kn::nf4_codes_high_nibble_first(read.view)) {
    drop_written_slab(block, slab);
    throw std::logic_error(fmt::format("the {} transfer image of {} is slab version {}, whose NF4 nibble order the "
                                       "device decoder does not read (expected version {}: a rank of another build?)",
                                       precision_name(precision), block_label(blocks_[block], block),
                                       read.view.version, kn::kSlabVersion));
  }
  if (slab != image.slab) retired_.push_back(RetiredSlab{image.slab, image.last_reader});
  image.view = std::move(read.view);
  image.slab = slab;
  image.precision = precision;
  image.built_version = image.weights_version;
  image.last_reader = nullptr;
  ++current_.image_rebuilds;
}

void StreamingEngine::require_block(std::uint32_t block, const char *call) const {
  if (block >= blocks_.size()) {
    throw std::invalid_argument(fmt::format("StreamingEngine::{}: block id {} is out of range (there are {} blocks)",
                                            call, block, blocks_.size()));
  }
  require_not_updating(block, call);
}

StreamingEngine::ImageBytes StreamingEngine::image(std::uint32_t block, Precision precision) {
  require_block(block, "image");
  ensure_image(block, precision);
  const BlockImage &current = images_[block];
  return ImageBytes{reinterpret_cast<const std::uint8_t *>(pool_.data(current.slab)), current.bytes_of(precision)};
}

void StreamingEngine::receive_image(std::uint32_t block, Precision precision,
                                    const std::function<void(std::uint8_t *, std::uint64_t)> &fill) {
  require_block(block, "receive_image");
  const std::uint64_t expected = images_[block].bytes_of(precision);
  write_image(block, precision, [&](const kn::SlabEncoding &encoding, std::uint8_t *slab, std::uint64_t capacity) {
    if (expected > capacity) {
      throw std::logic_error(fmt::format("StreamingEngine::receive_image: the {} image of {} needs {} bytes, the slab "
                                         "holds {}",
                                         precision_name(precision), block_label(blocks_[block], block), expected,
                                         capacity));
    }
    fill(slab, expected);
    const kn::SlabReadResult read = kn::read_slab(slab, expected);
    if (read.ok && (read.view.precision != encoding.precision || read.view.group_size != encoding.group_size)) {
      throw std::logic_error(fmt::format(
          "StreamingEngine::receive_image: the image received for {} is not a {} image of this engine's group size",
          block_label(blocks_[block], block), precision_name(precision)));
    }
    return expected;  // install_image() validates it whole
  });
}

void StreamingEngine::forget_masters(std::uint32_t block) {
  require_block(block, "forget_masters");
  masters_forgotten_[block] = true;
  for (TensorSpec &tensor : blocks_[block].tensors) tensor.master = nullptr;
}

void StreamingEngine::require_not_updating(std::uint32_t block, const char *call) const {
  if (updating_[block]) {
    throw std::logic_error(fmt::format("StreamingEngine::{}: {} is being updated (begin_update() without "
                                       "finish_update()); its image is not valid",
                                       call, block_label(blocks_[block], block)));
  }
}

void StreamingEngine::issue_fetch(std::uint32_t fetch) {
  const std::uint32_t block = schedule_.fetches()[fetch].block;
  const RouteDecision route = bridge_.decide(block);
  const Precision precision = route.precision;
  ensure_image(block, precision);
  if (route.decided_by == RouteAuthority::transfer_policy) {
    current_.fetches_bf16_by_transfer_policy += precision == Precision::bf16;
    current_.fetches_int8_by_transfer_policy += precision == Precision::int8;
  }
  current_.fetches_pinned += route.decided_by == RouteAuthority::runtime_pin;

  BlockImage &image = images_[block];
  DeviceSlot &slot = slots_.slot(fetch % slots_.size());
  FetchEvents &events = events_of(generation_, fetch);
  const std::uint64_t bytes = image.view.total_bytes;
  const bool quantized = is_quantized(precision);
  std::byte *destination = quantized ? slot.staging : slot.compute;

  // The slot's previous occupant is done once its release event fires; the copy queue waits
  // for that on the device.
  backend_.wait(Queue::copy, *slot.released);
  backend_.record(*events.copy_start, Queue::copy);
  backend_.copy_host_to_device_async(destination, pool_.data(image.slab), bytes);
  backend_.record(*events.copy_end, Queue::copy);
  image.last_reader = events.copy_end.get();

  if (quantized) {
    // INT8 and NF4 alike: the staged image's codes and scales, dequantized into the compute
    // region at the BF16 image's offsets. Only the kernel differs (DequantJob::precision).
    const kn::SlabView &layout = bf16_layouts_[block];
    dequant_job_.precision = precision;
    dequant_job_.group_size = image.view.group_size;
    dequant_job_.tensors.clear();
    for (std::size_t t = 0; t < image.view.tensors.size(); ++t) {
      const kn::SlabTensorView &staged = image.view.tensors[t];
      dequant_job_.tensors.push_back(DequantTensor{
          slot.staging + staged.data_offset, slot.staging + staged.scales_offset, staged.shape.rows, staged.shape.cols,
          reinterpret_cast<std::uint16_t *>(slot.compute + layout.tensors[t].data_offset)});
    }
    backend_.wait(Queue::dequant, *events.copy_end);
    backend_.record(*events.dequant_start, Queue::dequant);
    backend_.dequantize_async(dequant_job_);
    backend_.record(*events.dequant_end, Queue::dequant);
  }
  current_.h2d_bytes[precision] += bytes;
  ++current_.fetches[precision];
  current_.h2d_bytes_all_bf16 += image.bytes_of(Precision::bf16);
  fetch_precision_[fetch] = precision;
  ++next_fetch_;
  current_.slots_in_flight_peak = std::max(current_.slots_in_flight_peak, next_fetch_ - fetches_used_);
}

// Issues fetches ahead of `current` (or from the start of the step when there is none), up to
// the lookahead the bridge allows, whichever direction the schedule goes next.
void StreamingEngine::top_up(std::optional<std::uint32_t> current) {
  const auto &fetches = schedule_.fetches();
  const std::uint32_t first_ahead = current ? *current + 1 : 0;
  const Phase phase = fetches[current.value_or(0)].phase;
  const auto limit = static_cast<std::uint32_t>(
      std::min<std::uint64_t>(fetches.size(), std::uint64_t{first_ahead} + bridge_.lookahead(config_.prefetch_window)));
  while (next_fetch_ < limit) {
    if (bridge_.limits().suppress_speculative && fetches[next_fetch_].phase != phase) {
      break;
    }
    issue_fetch(next_fetch_);
  }
}

void StreamingEngine::begin_step(std::int64_t step, const RuntimeLimitHints &limits) {
  if (in_step_) {
    throw std::logic_error(fmt::format(
        "StreamingEngine::begin_step({}): step {} is still active; call end_step() first", step, current_.step));
  }
  bridge_.begin_step();
  // Before any image is built or fetch issued below. tighten() checks every pinned block
  // before it changes anything, so a rejected pin leaves no step begun.
  bridge_.tighten(limits);
  // The images of switched or updated blocks are built now rather than on the first fetch,
  // before the step counts as begun: one that cannot be (its masters are elsewhere) leaves
  // none begun.
  for (std::uint32_t b = 0; b < blocks_.size(); ++b) {
    ensure_image(b, bridge_.route(b));
  }
  generation_ = static_cast<std::uint32_t>(steps_begun_ % 2);
  ++steps_begun_;
  // This generation's events still hold the timings of the step before last.
  while (!pending_.empty() && pending_.front().generation == generation_) {
    finalize(pending_.front(), /*may_block=*/true);
    pending_.pop_front();
  }
  current_.step = step;
  next_use_ = 0;
  next_fetch_ = 0;
  fetches_used_ = 0;
  acquired_use_.reset();
  std::fill(fetch_used_.begin(), fetch_used_.end(), false);
  pool_.reset_peak();
  in_step_ = true;
  top_up(std::nullopt);
}

const BlockView &StreamingEngine::acquire(std::uint32_t block) {
  require_step("acquire");
  if (acquired_use_) {
    throw std::logic_error(fmt::format("StreamingEngine::acquire({}): {} is still acquired", block,
                                       schedule_.describe_use(*acquired_use_)));
  }
  const auto &uses = schedule_.uses();
  if (next_use_ >= uses.size()) {
    throw std::logic_error(
        fmt::format("StreamingEngine::acquire({}): all {} uses of the step are done", block, uses.size()));
  }
  const BlockUse &use = uses[next_use_];
  if (use.block != block) {
    throw std::logic_error(fmt::format("StreamingEngine::acquire({}) out of order: expected {}", block,
                                       schedule_.describe_use(next_use_)));
  }
  const std::uint32_t fetch = use.fetch;
  if (!fetch_used_[fetch]) {
    if (fetch < next_fetch_) {
      ++current_.prefetch_hits;
    } else {
      ++current_.prefetch_misses;
      while (next_fetch_ <= fetch) {
        issue_fetch(next_fetch_);
      }
    }
    fetch_used_[fetch] = true;
    ++fetches_used_;
    top_up(fetch);
    backend_.wait(Queue::compute, ready_event(fetch));
  }

  const DeviceSlot &slot = slots_.slot(fetch % slots_.size());
  const BlockSpec &spec = blocks_[block];
  const kn::SlabView &layout = bf16_layouts_[block];
  view_.block = block;
  view_.phase = use.phase;
  view_.precision = fetch_precision_[fetch];
  view_.tensors.clear();
  for (std::size_t t = 0; t < spec.tensors.size(); ++t) {
    view_.tensors.push_back(TensorView{&spec.tensors[t].name,
                                       reinterpret_cast<std::uint16_t *>(slot.compute + layout.tensors[t].data_offset),
                                       spec.tensors[t].rows, spec.tensors[t].cols});
  }
  acquired_use_ = next_use_;
  return view_;
}

void StreamingEngine::release(std::uint32_t block) {
  require_step("release");
  if (!acquired_use_ || schedule_.uses()[*acquired_use_].block != block) {
    throw std::logic_error(fmt::format("StreamingEngine::release({}): the block is not acquired", block));
  }
  const std::uint32_t fetch = schedule_.uses()[*acquired_use_].fetch;
  backend_.record(*slots_.slot(fetch % slots_.size()).released, Queue::compute);
  acquired_use_.reset();
  ++next_use_;
}

StepTransferMetrics StreamingEngine::end_step() {
  require_step("end_step");
  if (acquired_use_) {
    throw std::logic_error(
        fmt::format("StreamingEngine::end_step: {} is still acquired", schedule_.describe_use(*acquired_use_)));
  }
  // A fetch the step never used (a forward-only step that prefetched into backward) still
  // writes its slot; order the slot's next reuse after that write.
  for (std::uint32_t fetch = 0; fetch < next_fetch_; ++fetch) {
    if (!fetch_used_[fetch]) {
      backend_.wait(Queue::compute, ready_event(fetch));
      backend_.record(*slots_.slot(fetch % slots_.size()).released, Queue::compute);
      ++current_.prefetch_unused;
    }
  }
  current_.slabs_total = pool_.capacity();
  current_.slabs_in_use_peak = pool_.peak_in_use();
  current_.slab_bytes = pool_.slab_bytes();
  current_.slots_total = slots_.size();
  current_.slot_bytes = slots_.compute_bytes();

  PendingStep pending;
  pending.metrics = current_;
  pending.generation = generation_;
  pending.fetch_precisions.assign(fetch_precision_.begin(), fetch_precision_.begin() + next_fetch_);
  pending_.push_back(std::move(pending));

  StepTransferMetrics finished = current_;
  current_ = StepTransferMetrics{};
  in_step_ = false;
  while (!pending_.empty() && finalize(pending_.front(), /*may_block=*/false)) {
    pending_.pop_front();
  }
  return finished;
}

void StreamingEngine::on_weights_updated(std::uint32_t block) {
  if (block >= blocks_.size()) {
    throw std::invalid_argument(
        fmt::format("StreamingEngine::on_weights_updated: block id {} is out of range (there are {} blocks)", block,
                    blocks_.size()));
  }
  if (masters_forgotten_[block]) {
    throw std::logic_error(fmt::format(
        "StreamingEngine::on_weights_updated: {}'s masters live in another process (forget_masters()); its image "
        "arrives through receive_image()",
        block_label(blocks_[block], block)));
  }
  ++images_[block].weights_version;
  ensure_image(block, bridge_.route(block));
}

namespace {

// The tensors of a fused update must be the block's masters, in BlockSpec order.
void check_update_tensors(const BlockSpec &spec, std::uint32_t block, const std::vector<kn::AdamWTensor> &tensors) {
  if (tensors.size() != spec.tensors.size()) {
    throw std::invalid_argument(fmt::format("StreamingEngine::update_weights: {} has {} tensors, {} were given",
                                            block_label(spec, block), spec.tensors.size(), tensors.size()));
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec &expected = spec.tensors[i];
    const kn::AdamWTensor &given = tensors[i];
    if (given.master != expected.master || given.shape.rows != expected.rows || given.shape.cols != expected.cols) {
      throw std::invalid_argument(fmt::format(
          "StreamingEngine::update_weights: tensor {} of {} is not the block's master '{}' ({} x {}); tensors go in "
          "the BlockSpec's order",
          i, block_label(spec, block), expected.name, expected.rows, expected.cols));
    }
  }
}

}  // namespace

void StreamingEngine::update_weights(std::uint32_t block, const kn::AdamWStep &step,
                                     const std::vector<kn::AdamWTensor> &tensors) {
  if (block < blocks_.size()) check_update_tensors(blocks_[block], block, tensors);
  WeightUpdate update = begin_update(block);
  update.run(step, tensors);
  finish_update(update);
}

StreamingEngine::WeightUpdate StreamingEngine::begin_update(std::uint32_t block) {
  if (block >= blocks_.size()) {
    throw std::invalid_argument(fmt::format(
        "StreamingEngine::update_weights: block id {} is out of range (there are {} blocks)", block, blocks_.size()));
  }
  require_not_updating(block, "begin_update");
  if (masters_forgotten_[block]) {
    throw std::logic_error(fmt::format(
        "StreamingEngine::update_weights: {}'s masters live in another process (forget_masters()); it is updated "
        "there",
        block_label(blocks_[block], block)));
  }
  WeightUpdate update;
  update.spec_ = &blocks_[block];
  update.block_ = block;
  update.precision_ = bridge_.route(block);
  update.encoding_ = encoding_for(update.precision_, group_sizes(config_));
  update.slab_ = writable_slab(block);
  update.data_ = reinterpret_cast<std::uint8_t *>(pool_.data(update.slab_));
  update.capacity_ = pool_.slab_bytes();
  updating_[block] = true;
  return update;
}

void StreamingEngine::WeightUpdate::run(const kn::AdamWStep &step, const std::vector<kn::AdamWTensor> &tensors) noexcept {
  if (ran_) {
    error_ = std::make_exception_ptr(std::logic_error("StreamingEngine::WeightUpdate::run: called twice"));
    return;
  }
  ran_ = true;
  try {
    check_update_tensors(*spec_, block_, tensors);
    bytes_ = kn::adamw_update_slab(encoding_, step, tensors.data(), tensors.size(), data_, capacity_);
  } catch (...) {
    error_ = std::current_exception();
  }
}

void StreamingEngine::finish_update(WeightUpdate &update) {
  const std::uint32_t block = update.block_;
  if (update.spec_ != &blocks_.at(block) || !updating_[block]) {
    throw std::logic_error("StreamingEngine::finish_update: not an update begun by this engine, or finished already");
  }
  updating_[block] = false;
  if (!update.ran_) {
    // A cancel: nothing was written, the current image still holds the masters' weights.
    drop_written_slab(block, update.slab_);
    return;
  }
  if (update.error_) {
    // The kernel refuses bad arguments before it writes, but a failure inside the sweep (a
    // thread that could not start) may leave some masters stepped and the slab half written:
    // the image is rebuilt from the masters at the block's next fetch.
    drop_written_slab(block, update.slab_);
    ++images_[block].weights_version;
    std::rethrow_exception(update.error_);
  }
  ++images_[block].weights_version;
  install_image(block, update.precision_, update.slab_, update.bytes_);
}

bool StreamingEngine::finalize(PendingStep &pending, bool may_block) {
  const auto fetches = static_cast<std::uint32_t>(pending.fetch_precisions.size());
  for (std::uint32_t fetch = 0; fetch < fetches; ++fetch) {
    FetchEvents &events = events_of(pending.generation, fetch);
    const Event *last =
        is_quantized(pending.fetch_precisions[fetch]) ? events.dequant_end.get() : events.copy_end.get();
    // Every earlier event of the fetch precedes `last` on its queue or through a wait.
    if (!backend_.query(*last)) {
      if (!may_block) {
        return false;
      }
      stall_on(*last);
    }
  }
  StepTransferMetrics &metrics = pending.metrics;
  for (std::uint32_t fetch = 0; fetch < fetches; ++fetch) {
    FetchEvents &events = events_of(pending.generation, fetch);
    metrics.copy_seconds += backend_.elapsed_seconds(*events.copy_start, *events.copy_end);
    if (is_quantized(pending.fetch_precisions[fetch])) {
      metrics.dequant_seconds += backend_.elapsed_seconds(*events.dequant_start, *events.dequant_end);
    }
  }
  metrics.timings_complete = true;
  last_completed_ = metrics;
  if (metrics_writer_) {
    metrics_writer_->append(metrics.to_json());
  }
  return true;
}

void StreamingEngine::flush_metrics() {
  while (!pending_.empty()) {
    finalize(pending_.front(), /*may_block=*/true);
    pending_.pop_front();
  }
}

void size_streaming_config(StreamingConfig &config, const std::vector<BlockSpec> &blocks, std::uint32_t spare_slabs) {
  const GroupSizes groups = group_sizes(config);
  config.host_slab_bytes = 0;
  config.device_slot_bytes = 0;
  for (const BlockSpec &block : blocks) {
    for (Precision precision : kAllPrecisions) {
      config.host_slab_bytes = std::max(config.host_slab_bytes, image_size(block, precision, groups));
    }
    config.device_slot_bytes = std::max(config.device_slot_bytes, image_size(block, Precision::bf16, groups));
  }
  config.host_slab_count = static_cast<std::uint32_t>(blocks.size()) + spare_slabs;
}

}  // namespace sp::adapters
