// The streaming engine: keeps every block's transfer image in pinned memory, fetches blocks
// into device slots in the order the step needs them, prefetching ahead across the
// forward-to-backward turn, and routes each fetch through the BF16, the INT8 or the NF4 path.
//
// Per block it makes no host synchronization: copies, dequantization and compute are ordered
// by events on the backend's queues. The host blocks only to rewrite a transfer image whose
// previous copy is still in flight when no spare slab is free (counted as a stall).
//
// Usage per step:
//   begin_step(step);                 // or begin_step(step, limits): pins and caps for the step
//   for each use in schedule().uses(): view = acquire(block); ...compute...; release(block);
//   metrics = end_step();             // bytes and counters now; timings follow in the JSONL
//   (plugin routes -> policy_bridge().set_plugin_routes(), optimizer -> on_weights_updated())
#pragma once

#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sp/adapters/backend.h"
#include "sp/adapters/metrics.h"
#include "sp/adapters/policy_bridge.h"
#include "sp/adapters/schedule.h"
#include "sp/adapters/slab_pool.h"
#include "sp/adapters/slot_ring.h"
#include "sp/adapters/transfer_image.h"
#include "sp/kernels/adamw.h"
#include "sp/kernels/nf4.h"
#include "sp/kernels/slab.h"
#include "sp/plugin_abi_v1.h"

namespace sp::adapters {

struct StreamingConfig {
  std::uint64_t host_slab_bytes = 0;  // room for the largest BF16 transfer image
  // At least one slab per block. Spare slabs let an image be rebuilt while its previous
  // version is still being copied, instead of blocking the host.
  std::uint32_t host_slab_count = 0;
  std::uint64_t device_slot_bytes = 0;  // room for the largest block's bf16 weights
  std::uint32_t prefetch_window = 1;    // fetches in flight ahead of the current one
  std::uint32_t int8_group_size = 0;    // 0: one scale per row; else 32, 64, 128 or 256
  // NF4 has no per-row mode: 32, 64, 128 or 256 elements per bf16 scale.
  std::uint32_t nf4_group_size = sp::kernels::kNf4DefaultGroupSize;
  bool backward = true;
  std::string metrics_path;  // JSONL, one record per step; empty: none
  // How the engine's host-side kernels (image builds, the fused update) run: a host that keeps
  // a thread pool lends it here (CpuExec::pool, which must outlive the engine).
  sp::kernels::CpuExec host_exec;
};

struct TensorView {
  const std::string *name = nullptr;
  std::uint16_t *bf16 = nullptr;  // device memory, rows x cols, valid until release()
  std::uint64_t rows = 0;
  std::uint64_t cols = 0;
};

struct BlockView {
  std::uint32_t block = 0;
  Phase phase = Phase::forward;
  Precision precision = Precision::bf16;  // the path the weights took
  std::vector<TensorView> tensors;
};

// Sizes `config` for `blocks` from its group sizes: host_slab_bytes (the largest image on any
// route), device_slot_bytes (the largest BF16 image) and host_slab_count (one slab per block
// plus `spare_slabs`). What every host would otherwise compute by hand.
void size_streaming_config(StreamingConfig &config, const std::vector<BlockSpec> &blocks, std::uint32_t spare_slabs);

class StreamingEngine {
 public:
  // Sizes everything once. Throws std::invalid_argument naming the field or block when the
  // config or a block does not fit, and std::runtime_error when the slab pool is exhausted.
  StreamingEngine(TransferBackend &backend, const StreamingConfig &config, std::vector<BlockSpec> blocks);
  ~StreamingEngine();
  StreamingEngine(const StreamingEngine &) = delete;
  StreamingEngine &operator=(const StreamingEngine &) = delete;

  PolicyBridge &policy_bridge() { return bridge_; }
  const StepSchedule &schedule() const { return schedule_; }
  std::uint32_t slot_count() const { return slots_.size(); }
  // Bytes one transfer of the block puts on the wire on `precision`'s route (the whole image:
  // header, payload, scales).
  std::uint64_t image_bytes(std::uint32_t block, Precision precision) const;
  // The slab encoding of `precision`'s images: the route's kernels' format at the group size the
  // config gives it.
  sp::kernels::SlabEncoding image_encoding(Precision precision) const;
  // Block descriptions for the plugin's create(); names point into this engine.
  std::vector<sp_block_desc_v1> block_descs() const;

  // Begins a step. `limits` are the runtime's limits for the whole step, in force before the
  // fetches that begin_step itself issues ahead: the bridge resets its limits, then tightens
  // them with these, then the step's first fetches are routed. Limits tightened later through
  // policy_bridge().tighten() bind only the fetches not yet issued, so a pin that must hold for
  // every fetch of the step (calibration measuring one route) goes here. `first_use`: the use
  // of the schedule the step begins at (a host whose forward ended in an earlier step and
  // whose backward runs now begins at the first backward use, num_blocks). Throws
  // std::invalid_argument for a pinned block id or a first use out of range, before the step
  // begins.
  void begin_step(std::int64_t step, const RuntimeLimitHints &limits = {}, std::uint32_t first_use = 0);
  // The next use in the schedule must be `block`, or the use just released asked for again (a
  // host's own recompute of a block before its backward: the same fetch serves it); throws
  // std::logic_error otherwise. The compute queue has been ordered after the block's transfer;
  // the view stays valid until release().
  const BlockView &acquire(std::uint32_t block);
  void release(std::uint32_t block);
  StepTransferMetrics end_step();
  // Between steps: from the next step on, the forward uses the blocks in `order` and the
  // backward in reverse (ScheduleOptions::order), for a host whose blocks are called in another
  // order than their ids. Throws std::logic_error during a step, std::invalid_argument for an
  // order that does not list each block once; either way the schedule is unchanged.
  void set_block_order(std::vector<std::uint32_t> order);

  // The optimizer changed the block's master weights: its image is rebuilt now for the route
  // the block will take next.
  void on_weights_updated(std::uint32_t block);
  // The fused host optimizer: one AdamW step on the block's masters and the rebuild of its
  // image for the route it takes next, in one sweep (sp::kernels::adamw_update_slab); replaces
  // the optimizer's own update of these masters and on_weights_updated(block). `tensors` are
  // the block's masters in BlockSpec order, each with its gradient and moments (owned by the
  // caller; the masters and moments are updated in place). Throws std::invalid_argument, with
  // nothing changed, when a tensor is not the block's master or its buffers are missing.
  void update_weights(std::uint32_t block, const sp::kernels::AdamWStep &step,
                      const std::vector<sp::kernels::AdamWTensor> &tensors);

  // update_weights() in three parts, for a host that runs the sweep on a thread of its own
  // while this engine streams other blocks (the LibTorch layer's update during the backward):
  //   begin_update()       on the engine's thread: picks the slab the new image goes to, for
  //                        the block's route now, and marks the block busy: fetching it throws
  //                        std::logic_error until finish_update();
  //   WeightUpdate::run()  on any thread, once: the sweep, which touches the tensors given and
  //                        that slab, nothing else of the engine's;
  //   finish_update()      on the engine's thread: validates and installs the image. An
  //                        update that never ran is cancelled (the block keeps its image);
  //                        after a run that failed, the image is rebuilt from the masters at
  //                        the block's next fetch, and the error is rethrown here.
  // The image is for the route of begin_update(); a route decided later gets its image at the
  // block's next fetch, as after on_weights_updated().
  class WeightUpdate {
   public:
    std::uint32_t block() const { return block_; }
    // The fused sweep (as update_weights()). Never throws: an error waits for finish_update().
    void run(const sp::kernels::AdamWStep &step, const std::vector<sp::kernels::AdamWTensor> &tensors) noexcept;

   private:
    friend class StreamingEngine;
    const BlockSpec *spec_ = nullptr;
    std::uint32_t block_ = 0;
    Precision precision_ = Precision::bf16;
    std::uint32_t slab_ = 0;
    std::uint8_t *data_ = nullptr;
    std::uint64_t capacity_ = 0;
    sp::kernels::SlabEncoding encoding_{};
    sp::kernels::CpuExec exec_;
    std::uint64_t bytes_ = 0;
    bool ran_ = false;
    std::exception_ptr error_;
  };
  // Throws std::invalid_argument for a block out of range, std::logic_error for a block
  // already being updated.
  WeightUpdate begin_update(std::uint32_t block);
  void finish_update(WeightUpdate &update);

  // A block whose masters live in another process (the LibTorch layer's sharded data
  // parallelism: each rank keeps the masters of some blocks and streams all of them). The
  // owner sends its image's bytes; every other process installs them, and never builds that
  // block's image itself:
  //   image()          the block's image for `precision`, built now from the masters unless it
  //                    is current: `bytes` bytes at `data`, which this engine owns, valid until
  //                    the block's image next changes (a rebuild, an update, receive_image());
  //   receive_image()  `fill(data, bytes)` writes image_bytes(block, precision) bytes, an image
  //                    of an engine with the same blocks and group sizes, into a slab that no
  //                    copy reads; they are validated and become the block's current image.
  //                    Throws std::logic_error, with the old image kept, when they fail
  //                    validation or are of another route; what `fill` throws, the same way;
  //   forget_masters() from now on the block's masters are not read (the host may free them):
  //                    a fetch, update or image() that would rebuild the image throws
  //                    std::logic_error naming the block, so that a missing image can never be
  //                    rebuilt from freed memory.
  // Each throws std::invalid_argument for a block out of range, std::logic_error for a block
  // being updated (begin_update()).
  struct ImageBytes {
    const std::uint8_t *data = nullptr;
    std::uint64_t bytes = 0;
  };
  ImageBytes image(std::uint32_t block, Precision precision);
  void receive_image(std::uint32_t block, Precision precision,
                     const std::function<void(std::uint8_t *data, std::uint64_t bytes)> &fill);
  void forget_masters(std::uint32_t block);
  bool has_masters(std::uint32_t block) const { return !masters_forgotten_.at(block); }

  // Fetches issued so far in the current step (for schedule checks).
  std::uint32_t issued_fetches() const { return next_fetch_; }
  // Waits for the timing events of finished steps and writes their records.
  void flush_metrics();
  // Records of metrics_path that could not be written (disk full, ...): MetricsJsonlWriter.
  std::uint64_t metrics_records_lost() const { return metrics_writer_ ? metrics_writer_->lost() : 0; }
  // The most recent step whose timings are complete (after flush_metrics(), the last step).
  const std::optional<StepTransferMetrics> &last_completed_metrics() const { return last_completed_; }

 private:
  struct BlockImage;
  struct FetchEvents;
  struct PendingStep;

  void issue_fetch(std::uint32_t fetch);
  void top_up(std::optional<std::uint32_t> current);
  void ensure_image(std::uint32_t block, Precision precision);
  // Writes the block's image for `precision` with `write(encoding, slab, capacity)`, which
  // returns the image size, in a slab no copy is reading; validates it and makes it current.
  using ImageWriter = std::function<std::uint64_t(const sp::kernels::SlabEncoding &, std::uint8_t *, std::uint64_t)>;
  void write_image(std::uint32_t block, Precision precision, const ImageWriter &write);
  // write_image()'s halves: the slab to write (the block's own, or a spare while a copy may
  // still read the own one), and making the written image current (or dropping the slab).
  std::uint32_t writable_slab(std::uint32_t block);
  void install_image(std::uint32_t block, Precision precision, std::uint32_t slab, std::uint64_t bytes);
  void drop_written_slab(std::uint32_t block, std::uint32_t slab);
  void require_not_updating(std::uint32_t block, const char *call) const;
  void require_block(std::uint32_t block, const char *call) const;
  void reclaim_retired_slabs();
  void stall_on(const Event &event);
  FetchEvents &events_of(std::uint32_t generation, std::uint32_t fetch);
  const Event &ready_event(std::uint32_t fetch);
  // Writes the step's record once its timing events completed; blocks only if may_block.
  bool finalize(PendingStep &pending, bool may_block);
  void require_step(const char *call) const;

  TransferBackend &backend_;
  StreamingConfig config_;
  std::vector<BlockSpec> blocks_;
  StepSchedule schedule_;
  PolicyBridge bridge_;
  PinnedSlabPool pool_;
  DeviceSlotRing slots_;
  std::vector<BlockImage> images_;
  std::vector<bool> updating_;  // per block: between begin_update() and finish_update()
  std::vector<bool> masters_forgotten_;  // per block: forget_masters() was called
  std::vector<sp::kernels::SlabView> bf16_layouts_;
  struct RetiredSlab {
    std::uint32_t slab;
    const Event *last_reader;
  };
  std::deque<RetiredSlab> retired_;
  std::vector<FetchEvents> events_;  // two generations of one set per schedule fetch
  std::deque<PendingStep> pending_;
  std::unique_ptr<MetricsJsonlWriter> metrics_writer_;
  std::optional<StepTransferMetrics> last_completed_;

  bool in_step_ = false;
  std::uint32_t generation_ = 0;
  std::uint64_t steps_begun_ = 0;
  std::uint32_t first_use_ = 0;    // the use the step began at
  std::uint32_t first_fetch_ = 0;  // and its fetch
  std::uint32_t next_use_ = 0;
  std::uint32_t next_fetch_ = 0;
  std::uint32_t fetches_used_ = 0;
  std::optional<std::uint32_t> acquired_use_;
  std::vector<bool> fetch_used_;
  std::vector<Precision> fetch_precision_;
  StepTransferMetrics current_;
  BlockView view_;
  DequantJob dequant_job_;
};

}  // namespace sp::adapters
