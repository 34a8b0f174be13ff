// The host-side transfer images of StreamingEngine: building them from the masters, receiving
// them from the rank that owns the masters, and updating them in place with the optimizer step.
#include "streaming_images.h"

#include <exception>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "sp/adapters/route_encoding.h"
#include "sp/kernels/adamw.h"
#include "sp/kernels/slab.h"

namespace sp::adapters {
namespace {

namespace kn = sp::kernels;

// The tensors of a fused update must be the block's masters, in BlockSpec order.
void check_update_tensors(const BlockSpec &spec, std::uint32_t block, const std::vector<kn::AdamWTensor> &tensors) {
  if (tensors.size() != spec.tensors.size()) {
    throw std::invalid_argument(fmt::format("StreamingEngine::update_weights: {} has {} tensors, {} were given",
                                            detail::block_label(spec, block), spec.tensors.size(), tensors.size()));
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec &expected = spec.tensors[i];
    const kn::AdamWTensor &given = tensors[i];
    if (given.master != expected.master || given.shape.rows != expected.rows || given.shape.cols != expected.cols) {
      throw std::invalid_argument(fmt::format(
          "StreamingEngine::update_weights: tensor {} of {} is not the block's master '{}' ({} x {}); tensors go in "
          "the BlockSpec's order",
          i, detail::block_label(spec, block), expected.name, expected.rows, expected.cols));
    }
  }
}

}  // namespace

namespace detail {

std::string block_label(const BlockSpec &block, std::uint32_t id) {
  return fmt::format("block '{}' (id {})", block.name, id);
}

GroupSizes group_sizes(const StreamingConfig &config) {
  // A route without an option of its own here packs at its row's default.
  GroupSizes groups;
  for (const RouteTraits &route : kRouteTraits) groups[route.precision] = route.default_group_size;
  groups[Precision::int8] = config.int8_group_size;
  groups[Precision::nf4] = config.nf4_group_size;
  return groups;
}

kn::SlabEncoding encoding_for(Precision precision, const GroupSizes &groups) {
  return slab_encoding(precision, groups[precision]);
}

std::uint64_t image_size(const BlockSpec &block, Precision precision, const GroupSizes &groups) {
  std::vector<kn::TensorShape> shapes;
  shapes.reserve(block.tensors.size());
  for (const TensorSpec &tensor : block.tensors) {
    shapes.push_back(kn::TensorShape{tensor.rows, tensor.cols});
  }
  return kn::slab_image_bytes(encoding_for(precision, groups), shapes.data(), shapes.size());
}

}  // namespace detail

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
        precision_name(precision), detail::block_label(spec, block)));
  }
  std::vector<kn::SlabTensorSource> sources;
  sources.reserve(spec.tensors.size());
  for (const TensorSpec &tensor : spec.tensors) {
    sources.push_back(kn::SlabTensorSource{tensor.master, kn::TensorShape{tensor.rows, tensor.cols}});
  }
  write_image(block, precision, [&](const kn::SlabEncoding &encoding, std::uint8_t *slab, std::uint64_t capacity) {
    return kn::build_slab(encoding, sources.data(), sources.size(), slab, capacity, config_.host_exec);
  });
}

void StreamingEngine::write_image(std::uint32_t block, Precision precision, const ImageWriter &write) {
  const std::uint32_t target = writable_slab(block);
  std::uint64_t bytes = 0;
  try {
    bytes = write(detail::encoding_for(precision, detail::group_sizes(config_)),
                  reinterpret_cast<std::uint8_t *>(pool_.data(target)), pool_.slab_bytes());
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

void StreamingEngine::install_image(std::uint32_t block, Precision precision, std::uint32_t slab, std::uint64_t bytes) {
  BlockImage &image = images_[block];
  kn::SlabReadResult read = kn::read_slab(reinterpret_cast<const std::uint8_t *>(pool_.data(slab)), bytes);
  if (!read.ok) {
    drop_written_slab(block, slab);
    throw std::logic_error(fmt::format("the {} transfer image of {} failed validation: {}", precision_name(precision),
                                       detail::block_label(blocks_[block], block), read.error));
  }
  if (read.view.precision == kn::SlabPrecision::kNf4 && !kn::nf4_codes_high_nibble_first(read.view)) {
    drop_written_slab(block, slab);
    throw std::logic_error(fmt::format(
        "the {} transfer image of {} is slab version {}, whose NF4 nibble order the "
        "device decoder does not read (expected version {}: a rank of another build?)",
        precision_name(precision), detail::block_label(blocks_[block], block), read.view.version, kn::kSlabVersion));
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
      throw std::logic_error(
          fmt::format("StreamingEngine::receive_image: the {} image of {} needs {} bytes, the slab "
                      "holds {}",
                      precision_name(precision), detail::block_label(blocks_[block], block), expected, capacity));
    }
    fill(slab, expected);
    const kn::SlabReadResult read = kn::read_slab(slab, expected);
    if (read.ok && (read.view.precision != encoding.precision || read.view.group_size != encoding.group_size)) {
      throw std::logic_error(fmt::format(
          "StreamingEngine::receive_image: the image received for {} is not a {} image of this engine's group size",
          detail::block_label(blocks_[block], block), precision_name(precision)));
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
    throw std::logic_error(
        fmt::format("StreamingEngine::{}: {} is being updated (begin_update() without "
                    "finish_update()); its image is not valid",
                    call, detail::block_label(blocks_[block], block)));
  }
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
        detail::block_label(blocks_[block], block)));
  }
  ++images_[block].weights_version;
  ensure_image(block, bridge_.route(block));
}

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
        detail::block_label(blocks_[block], block)));
  }
  WeightUpdate update;
  update.spec_ = &blocks_[block];
  update.block_ = block;
  update.precision_ = bridge_.route(block);
  update.encoding_ = detail::encoding_for(update.precision_, detail::group_sizes(config_));
  update.slab_ = writable_slab(block);
  update.data_ = reinterpret_cast<std::uint8_t *>(pool_.data(update.slab_));
  update.capacity_ = pool_.slab_bytes();
  update.exec_ = config_.host_exec;
  updating_[block] = true;
  return update;
}

void StreamingEngine::WeightUpdate::run(const kn::AdamWStep &step,
                                        const std::vector<kn::AdamWTensor> &tensors) noexcept {
  if (ran_) {
    error_ = std::make_exception_ptr(std::logic_error("StreamingEngine::WeightUpdate::run: called twice"));
    return;
  }
  ran_ = true;
  try {
    check_update_tensors(*spec_, block_, tensors);
    bytes_ = kn::adamw_update_slab(encoding_, step, tensors.data(), tensors.size(), data_, capacity_, exec_);
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

}  // namespace sp::adapters
