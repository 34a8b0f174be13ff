#include "sp/adapters/streaming_engine.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "sp/kernels/nf4.h"
#include "sp/kernels/quantize.h"
#include "sp/kernels/slab.h"
#include "streaming_images.h"

namespace sp::adapters {
namespace {

namespace kn = sp::kernels;

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
  const detail::GroupSizes groups = detail::group_sizes(config);
  for (const RouteTraits &route : kRouteTraits) {
    if (!is_quantized(route.precision) || is_supported_group_size(route.precision, groups[route.precision])) continue;
    throw std::invalid_argument(fmt::format("StreamingConfig.{} is {}; expected {}", route.group_size_option,
                                            groups[route.precision], group_size_expectation(route.precision)));
  }
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    const BlockSpec &block = blocks[b];
    if (block.tensors.empty()) {
      throw std::invalid_argument(fmt::format("{} has no tensors", detail::block_label(block, b)));
    }
    for (const TensorSpec &tensor : block.tensors) {
      if (tensor.master == nullptr && tensor.rows * tensor.cols != 0) {
        throw std::invalid_argument(
            fmt::format("{}: tensor '{}' has no master weights", detail::block_label(block, b), tensor.name));
      }
    }
    const std::uint64_t bf16_bytes = detail::image_size(block, Precision::bf16, detail::group_sizes(config));
    if (bf16_bytes > config.device_slot_bytes) {
      throw std::invalid_argument(
          fmt::format("{} needs {} bytes of bf16 weights in a device slot but "
                      "StreamingConfig.device_slot_bytes is {}",
                      detail::block_label(block, b), bf16_bytes, config.device_slot_bytes));
    }
    std::uint64_t largest_image = 0;
    for (Precision precision : kPrecisions) {
      largest_image = std::max(largest_image, detail::image_size(block, precision, detail::group_sizes(config)));
    }
    if (largest_image > config.host_slab_bytes) {
      throw std::invalid_argument(
          fmt::format("{} has a {} byte transfer image but StreamingConfig.host_slab_bytes is {}",
                      detail::block_label(block, b), largest_image, config.host_slab_bytes));
    }
  }
  return config;
}

// A slot's staging region holds the image of either quantized route.
std::uint64_t largest_quantized_image(const std::vector<BlockSpec> &blocks, const detail::GroupSizes &groups) {
  std::uint64_t largest = 0;
  for (const BlockSpec &block : blocks) {
    for (Precision precision : kPrecisions) {
      if (is_quantized(precision)) {
        largest = std::max(largest, detail::image_size(block, precision, groups));
      }
    }
  }
  return largest;
}

}  // namespace

struct StreamingEngine::FetchEvents {
  std::unique_ptr<Event> copy_start;
  std::unique_ptr<Event> copy_end;
  std::unique_ptr<Event> dequant_start;
  std::unique_ptr<Event> dequant_end;
};

struct StreamingEngine::PendingStep {
  StepTransferMetrics metrics;
  std::uint32_t generation = 0;
  std::uint32_t first_fetch = 0;            // the schedule fetch the step began at
  std::vector<Precision> fetch_precisions;  // one per issued fetch, from first_fetch on
};

StreamingEngine::StreamingEngine(TransferBackend &backend, const StreamingConfig &config, std::vector<BlockSpec> blocks)
    : backend_(backend),
      config_(validated(config, blocks)),
      blocks_(std::move(blocks)),
      schedule_(ScheduleOptions{static_cast<std::uint32_t>(blocks_.size()), config_.backward, {}}),
      bridge_(static_cast<std::uint32_t>(blocks_.size())),
      pool_(backend, config_.host_slab_bytes, config_.host_slab_count),
      slots_(backend, config_.device_slot_bytes, largest_quantized_image(blocks_, detail::group_sizes(config_)),
             config_.prefetch_window + 2) {
  const auto n = static_cast<std::uint32_t>(blocks_.size());
  images_.resize(n);
  updating_.assign(n, false);
  masters_forgotten_.assign(n, false);
  bf16_layouts_.resize(n);
  std::size_t most_tensors = 0;
  for (std::uint32_t b = 0; b < n; ++b) {
    BlockImage &image = images_[b];
    for (Precision precision : kPrecisions) {
      image.bytes[precision] = detail::image_size(blocks_[b], precision, detail::group_sizes(config_));
    }
    image.slab =
        pool_.acquire(fmt::format("{} at startup (StreamingConfig.host_slab_count must be at least the number of "
                                  "blocks, {})",
                                  detail::block_label(blocks_[b], b), n));
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

kn::SlabEncoding StreamingEngine::image_encoding(Precision precision) const {
  return detail::encoding_for(precision, detail::group_sizes(config_));
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
    // sp_block_desc_v1 is frozen with ABI 1.0's routes: a later route's size is image_bytes(b, route).
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

void StreamingEngine::issue_fetch(std::uint32_t fetch) {
  const std::uint32_t block = schedule_.fetches()[fetch].block;
  const RouteDecision route = bridge_.decide(block);
  const Precision precision = route.precision;
  ensure_image(block, precision);
  if (route.decided_by == RouteAuthority::transfer_policy) current_.fetches_by_transfer_policy[precision] += 1;
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
  const std::uint32_t first_ahead = current ? *current + 1 : first_fetch_;
  const Phase phase = fetches[current.value_or(first_fetch_)].phase;
  const auto limit = static_cast<std::uint32_t>(
      std::min<std::uint64_t>(fetches.size(), std::uint64_t{first_ahead} + bridge_.lookahead(config_.prefetch_window)));
  while (next_fetch_ < limit) {
    if (bridge_.limits().suppress_speculative && fetches[next_fetch_].phase != phase) {
      break;
    }
    issue_fetch(next_fetch_);
  }
}

void StreamingEngine::begin_step(std::int64_t step, const RuntimeLimitHints &limits, std::uint32_t first_use) {
  if (in_step_) {
    throw std::logic_error(fmt::format(
        "StreamingEngine::begin_step({}): step {} is still active; call end_step() first", step, current_.step));
  }
  if (first_use >= schedule_.uses().size()) {
    throw std::invalid_argument(fmt::format("StreamingEngine::begin_step({}): first_use {} is past the schedule's {} uses",
                                            step, first_use, schedule_.uses().size()));
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
  first_use_ = first_use;
  next_use_ = first_use;
  first_fetch_ = schedule_.uses()[first_use].fetch;
  next_fetch_ = first_fetch_;
  fetches_used_ = first_fetch_;
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
  // The use just released, asked for again: its fetch is still in its slot (the next fetch into
  // that slot is further ahead than any prefetch), so it serves the repeat.
  const bool repeat = next_use_ > first_use_ && uses[next_use_ - 1].block == block &&
                      (next_use_ >= uses.size() || uses[next_use_].block != block);
  if (next_use_ >= uses.size() && !repeat) {
    throw std::logic_error(
        fmt::format("StreamingEngine::acquire({}): all {} uses of the step are done", block, uses.size()));
  }
  const std::uint32_t use_index = repeat ? next_use_ - 1 : next_use_;
  const BlockUse &use = uses[use_index];
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
  acquired_use_ = use_index;
  return view_;
}

void StreamingEngine::release(std::uint32_t block) {
  require_step("release");
  if (!acquired_use_ || schedule_.uses()[*acquired_use_].block != block) {
    throw std::logic_error(fmt::format("StreamingEngine::release({}): the block is not acquired", block));
  }
  const std::uint32_t fetch = schedule_.uses()[*acquired_use_].fetch;
  backend_.record(*slots_.slot(fetch % slots_.size()).released, Queue::compute);
  if (*acquired_use_ == next_use_) ++next_use_;
  acquired_use_.reset();
}

void StreamingEngine::set_block_order(std::vector<std::uint32_t> order) {
  if (in_step_) {
    throw std::logic_error(fmt::format(
        "StreamingEngine::set_block_order: step {} is active; the order changes between steps", current_.step));
  }
  // Any order has as many fetches as the default one (only the turning block's two uses share
  // one), so the per-fetch events and slots stay as they are.
  schedule_ = StepSchedule(ScheduleOptions{static_cast<std::uint32_t>(blocks_.size()), config_.backward, std::move(order)});
}

StepTransferMetrics StreamingEngine::end_step() {
  require_step("end_step");
  if (acquired_use_) {
    throw std::logic_error(
        fmt::format("StreamingEngine::end_step: {} is still acquired", schedule_.describe_use(*acquired_use_)));
  }
  // A fetch the step never used (a forward-only step that prefetched into backward) still
  // writes its slot; order the slot's next reuse after that write.
  for (std::uint32_t fetch = first_fetch_; fetch < next_fetch_; ++fetch) {
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
  pending.first_fetch = first_fetch_;
  pending.fetch_precisions.assign(fetch_precision_.begin() + first_fetch_, fetch_precision_.begin() + next_fetch_);
  pending_.push_back(std::move(pending));

  StepTransferMetrics finished = current_;
  current_ = StepTransferMetrics{};
  in_step_ = false;
  while (!pending_.empty() && finalize(pending_.front(), /*may_block=*/false)) {
    pending_.pop_front();
  }
  return finished;
}

bool StreamingEngine::finalize(PendingStep &pending, bool may_block) {
  const auto fetches = static_cast<std::uint32_t>(pending.fetch_precisions.size());
  for (std::uint32_t fetch = 0; fetch < fetches; ++fetch) {
    FetchEvents &events = events_of(pending.generation, pending.first_fetch + fetch);
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
    FetchEvents &events = events_of(pending.generation, pending.first_fetch + fetch);
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
  const detail::GroupSizes groups = detail::group_sizes(config);
  config.host_slab_bytes = 0;
  config.device_slot_bytes = 0;
  for (const BlockSpec &block : blocks) {
    for (Precision precision : kPrecisions) {
      config.host_slab_bytes = std::max(config.host_slab_bytes, detail::image_size(block, precision, groups));
    }
    config.device_slot_bytes = std::max(config.device_slot_bytes, detail::image_size(block, Precision::bf16, groups));
  }
  config.host_slab_count = static_cast<std::uint32_t>(blocks.size()) + spare_slabs;
}

}  // namespace sp::adapters
