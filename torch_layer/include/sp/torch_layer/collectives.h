// Data parallelism for the LibTorch layer: the collectives a StreamedModel needs when N
// processes train one model, each on its own share of the batch, over torch.distributed's c10d.
//
// A StreamedModel given Collectives (StreamedModelOptions::collectives) keeps every rank's
// policy on identical inputs, so that every rank takes identical precision decisions:
//   - the masters' gradients are averaged across ranks, block by block, each block's
//     all-reduce started in the backward as soon as the block's gradient exists;
//   - the gradients of the blocks' resident parameters are averaged as the backward produces
//     them (one bucket per block, before autograd adds them to the .grad);
//   - post_backward() computes the moments from the averaged gradients: the same numbers on
//     every rank, and the moments of the step's real gradient (those of N ranks x batch b are
//     those of 1 rank x batch N*b, to rounding), not a sum of N noisier per-rank moments;
//   - calibration errors come from rank 0 (broadcast);
//   - after compute_hints, every rank's hints are compared (a max and a min all-reduce of the
//     precisions); a difference stops the run with RankMismatchError naming the step and the
//     blocks;
//   - a hot swap is requested by rank 0 on every rank at the same step boundary, and its
//     outcome compared.
// The host averages its own parameters' gradients (average_gradients()) and passes the mean
// loss across ranks (average()) to end_step(). With StreamedModelOptions::shard_masters each
// block's gradient is reduced to its owner instead, whose moments every rank then takes, and
// the owner broadcasts the block's images (streamed_model.h).
//
// Collectives is an interface so that the layer does not depend on one c10d release's class
// layout: over_process_group() adapts a c10d group, by_device() joins a group for host tensors
// with one for device tensors, and from_environment() builds them from the variables torchrun
// sets. The layer's own collectives run on CPU tensors, so a group must take those (Gloo does;
// NCCL alone does not, and is refused by name). The masters' gradients are reduced where the
// backward makes them when the group reduces tensors there without the host (NCCL:
// Collectives::reduces_on): StreamedModel::gradient_reduction_device().
#pragma once

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "sp/error.h"

namespace sp::torch_layer {

// A collective that failed or timed out: a rank died, stalled or left. what() names the
// operation and the rank.
class CollectiveError : public ErrorAs<std::runtime_error> {
 public:
  explicit CollectiveError(const std::string& what) : ErrorAs(ErrorKind::collective, what) {}
};

// The ranks' policies decided differently (or a hot swap succeeded on some ranks only).
class RankMismatchError : public ErrorAs<std::runtime_error> {
 public:
  explicit RankMismatchError(const std::string& what) : ErrorAs(ErrorKind::collective, what) {}
};

enum class Reduction { sum, max, min };

// Threads: the layer calls rank(), size() and Pending::wait() from its update worker
// (update_masters_during_backward) while its driving thread starts other collectives, so an
// implementation must allow that, as c10d's process groups do.
class Collectives {
 public:
  // An operation in flight; wait() blocks until it completed, and throws CollectiveError.
  class Pending {
   public:
    virtual ~Pending() = default;
    virtual void wait() = 0;
  };

  virtual ~Collectives() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place over one contiguous tensor; `what` names the operation in errors.
  virtual std::unique_ptr<Pending> all_reduce(torch::Tensor tensor, Reduction op, std::string what) = 0;
  virtual void broadcast(torch::Tensor tensor, int root, std::string what) = 0;
  // The reduction lands in `root`'s tensor; the others' tensors hold what the implementation
  // leaves there (read nothing from them). By default an all_reduce, which is correct and
  // moves more bytes than a reduce needs.
  virtual std::unique_ptr<Pending> reduce(torch::Tensor tensor, int root, Reduction op, std::string what) {
    (void)root;
    return all_reduce(std::move(tensor), op, std::move(what));
  }
  // Every rank's `mine`, by rank, on every rank: a small all-gather for what the ranks must
  // agree on after work whose length differs between them (rank 0 writing a checkpoint while
  // the others wait). It may wait up to `timeout`, which may exceed the collectives' own. `key`
  // names this exchange and is used once per run (a counter in it). By default through
  // broadcasts, under the collectives' own timeout; a group with a c10d store
  // (over_process_group(group, store)) waits on the store for `timeout`. Throws
  // CollectiveError.
  virtual std::vector<std::string> exchange(const std::string& key, const std::string& mine,
                                            std::chrono::milliseconds timeout);
  // Whether a tensor on `device` (not the CPU) is reduced where it is, without crossing to the
  // host: true for NCCL. A group that takes device tensors but stages them through the host
  // (Gloo) answers false: the layer then copies its gradients to the host once and reduces
  // them there, instead of letting them cross twice. By default false.
  virtual bool reduces_on(const torch::Device& device) const {
    (void)device;
    return false;
  }
};

namespace detail {
std::string collective_failure(int rank, int size, const std::string& what, const std::string& why);

// A c10d work handle (its type differs between c10d releases), waited on with named errors.
template <typename Handle>
class PendingWork final : public Collectives::Pending {
 public:
  PendingWork(Handle handle, int rank, int size, std::string what)
      : handle_(std::move(handle)), rank_(rank), size_(size), what_(std::move(what)) {}
  void wait() override {
    try {
      handle_->wait();
    } catch (const std::exception& e) {
      throw CollectiveError(collective_failure(rank_, size_, what_, e.what()));
    }
  }

 private:
  Handle handle_;
  int rank_, size_;
  std::string what_;
};

// The name of the c10d backend that takes `device`'s tensors in `group` ("nccl", "gloo"), or ""
// where it does not say: a ProcessGroup dispatches by device (getBackend), a Backend (such as
// ProcessGroupGloo) is one backend.
template <typename Group>
auto backend_name(Group& group, c10::DeviceType type, int) -> decltype(group.getBackend(type)->getBackendName()) {
  try {
    return group.getBackend(type)->getBackendName();
  } catch (const std::exception&) {
    return {};
  }
}
template <typename Group>
std::string backend_name(Group& group, c10::DeviceType, long) {
  try {
    return group.getBackendName();
  } catch (const std::exception&) {
    return {};
  }
}

// Collectives::exchange() over a store: each rank sets its key, then waits for the others'.
std::vector<std::string> exchange_through_store(c10d::Store& store, int rank, int size, const std::string& key,
                                                const std::string& mine, std::chrono::milliseconds timeout);

template <typename Group>
class ProcessGroupCollectives final : public Collectives {
 public:
  ProcessGroupCollectives(c10::intrusive_ptr<Group> group, c10::intrusive_ptr<c10d::Store> store)
      : group_(std::move(group)), store_(std::move(store)) {}
  int rank() const override { return group_->getRank(); }
  int size() const override { return group_->getSize(); }
  std::unique_ptr<Pending> all_reduce(torch::Tensor tensor, Reduction op, std::string what) override {
    c10d::AllreduceOptions options;
    options.reduceOp = reduce_op(op);
    std::vector<torch::Tensor> tensors{std::move(tensor)};
    return pending(group_->allreduce(tensors, options), std::move(what));
  }
  std::unique_ptr<Pending> reduce(torch::Tensor tensor, int root, Reduction op, std::string what) override {
    c10d::ReduceOptions options;
    options.reduceOp = reduce_op(op);
    options.rootRank = root;
    std::vector<torch::Tensor> tensors{std::move(tensor)};
    return pending(group_->reduce(tensors, options), std::move(what));
  }
  void broadcast(torch::Tensor tensor, int root, std::string what) override {
    c10d::BroadcastOptions options;
    options.rootRank = root;
    std::vector<torch::Tensor> tensors{std::move(tensor)};
    pending(group_->broadcast(tensors, options), std::move(what))->wait();
  }
  std::vector<std::string> exchange(const std::string& key, const std::string& mine,
                                    std::chrono::milliseconds timeout) override {
    if (!store_) return Collectives::exchange(key, mine, timeout);
    return exchange_through_store(*store_, rank(), size(), key, mine, timeout);
  }
  bool reduces_on(const torch::Device& device) const override {
    return !device.is_cpu() && backend_name(*group_, device.type(), 0) == "nccl";
  }

 private:
  static c10d::ReduceOp reduce_op(Reduction op) {
    return op == Reduction::sum ? c10d::ReduceOp::SUM : op == Reduction::max ? c10d::ReduceOp::MAX : c10d::ReduceOp::MIN;
  }
  template <typename Handle>
  std::unique_ptr<Pending> pending(Handle handle, std::string what) const {
    return std::make_unique<PendingWork<Handle>>(std::move(handle), rank(), size(), std::move(what));
  }
  c10::intrusive_ptr<Group> group_;
  c10::intrusive_ptr<c10d::Store> store_;  // null: exchange() through broadcasts
};
}  // namespace detail

// A c10d process group type (a ProcessGroup, or a Backend such as ProcessGroupGloo): its
// allreduce, reduce and broadcast, one CPU tensor each; with the group's store (or any store
// every rank shares), exchange() waits on the store for as long as it is asked to.
template <typename Group>
std::shared_ptr<Collectives> over_process_group(c10::intrusive_ptr<Group> group,
                                                c10::intrusive_ptr<c10d::Store> store = {}) {
  return std::make_shared<detail::ProcessGroupCollectives<Group>>(std::move(group), std::move(store));
}

// Collectives that send each tensor by its device: CPU tensors to `host`, any other to
// `device`, as a torch.distributed group with a backend per device does ("cpu:gloo,cuda:nccl").
// exchange() goes through `host`. Both must span the same ranks in the same order; throws
// std::invalid_argument when their rank or size differ.
std::shared_ptr<Collectives> by_device(std::shared_ptr<Collectives> host, std::shared_ptr<Collectives> device);

// The groups of torchrun's variables: RANK, WORLD_SIZE, MASTER_ADDR (default 127.0.0.1),
// MASTER_PORT (default 29500). Null when WORLD_SIZE is unset or 1. A Gloo group; when the model
// computes on a CUDA device and this build has NCCL (nccl_available()), joined by_device() with
// an NCCL group for the device's tensors, both over one rendezvous. Every collective, and the
// rendezvous, gives up after `timeout` with a CollectiveError. Throws std::invalid_argument
// naming a variable that is malformed.
std::shared_ptr<Collectives> from_environment(std::chrono::milliseconds timeout, const torch::Device& compute_device);

// Whether this build has c10d's NCCL group (a CUDA build of LibTorch with NCCL and its
// headers, found when the project was configured).
bool nccl_available();

// An NCCL group of `size` ranks meeting through `store`, for tensors on the CUDA device each
// rank computes on; join it to a group for host tensors with by_device(). Its collectives wait
// blocking (TORCH_NCCL_BLOCKING_WAIT, unless the environment sets it), so that a rank that died
// or stalled makes wait() throw a CollectiveError after `timeout` instead of hanging. Throws
// std::logic_error where !nccl_available(), and std::invalid_argument where the nccl.h this
// build was compiled with is not the version of the NCCL that LibTorch loaded.
std::shared_ptr<Collectives> nccl_group(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                        std::chrono::milliseconds timeout);

}  // namespace sp::torch_layer
