// The shard plan (issue 51): the process group the layer's ranks share, and who owns what.
// Sharded data parallelism (StreamedModelOptions::shard_masters on more than one rank) keeps
// each unit's masters on one rank, its owner, which computes the unit's moments and signals and
// sends its images to the others; otherwise every rank owns every unit.
// Not installed: the layer's insides (streamed_model_impl.h holds one).
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <utility>

#include "policy_link.h"
#include "sp/torch_layer/collectives.h"

namespace sp::torch_layer {

class ShardPlan {
 public:
  // `group` null: one process. `units` gives each block's unit, and outlives the plan.
  // Throws std::invalid_argument for sharding without a group.
  void connect(std::shared_ptr<Collectives> group, bool shard_masters, const PolicyLink& units) {
    if (shard_masters && !group) {
      throw std::invalid_argument(
          "StreamedModelOptions::shard_masters needs collectives: sharding spreads the masters over the ranks");
    }
    group_ = std::move(group);
    sharded_ = shard_masters && group_->size() > 1;
    units_ = &units;
  }
  // The ranks' group, or null in one process.
  Collectives* group() const { return group_.get(); }
  const std::shared_ptr<Collectives>& shared_group() const { return group_; }
  bool sharded() const { return sharded_; }
  int rank() const { return group_ ? group_->rank() : 0; }

  // A unit's blocks share their owner.
  int unit_owner(std::uint32_t u) const {
    return sharded_ ? static_cast<int>(u % static_cast<std::uint32_t>(group_->size())) : rank();
  }
  int owner(std::uint32_t b) const { return unit_owner(units_->unit_of(b)); }
  bool owns_unit(std::uint32_t u) const { return unit_owner(u) == rank(); }
  bool owns(std::uint32_t b) const { return owns_unit(units_->unit_of(b)); }

 private:
  std::shared_ptr<Collectives> group_;
  bool sharded_ = false;
  const PolicyLink* units_ = nullptr;
};

}  // namespace sp::torch_layer
