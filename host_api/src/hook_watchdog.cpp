#include "hook_watchdog.h"

namespace sp::host {

HookWatchdog::HookWatchdog(std::chrono::milliseconds deadline)
    : shared_(std::make_shared<Shared>()), deadline_(deadline) {
  worker_ = std::thread([shared = shared_] {
    std::unique_lock<std::mutex> lock(shared->mutex);
    for (;;) {
      shared->wake.wait(lock, [&] { return shared->has_task || shared->stop; });
      if (shared->stop) return;
      std::function<sp_status()> task = std::move(shared->task);
      shared->has_task = false;
      lock.unlock();
      sp_status result = SP_ERR_INTERNAL;
      try {
        result = task();
      } catch (...) {
      }
      lock.lock();
      shared->result = result;
      shared->done = true;
      shared->wake.notify_all();
    }
  });
}

HookWatchdog::~HookWatchdog() {
  if (abandoned_) {
    worker_.detach();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->stop = true;
  }
  shared_->wake.notify_all();
  worker_.join();
}

std::optional<sp_status> HookWatchdog::run(std::function<sp_status()> call) {
  if (abandoned_) return std::nullopt;
  std::unique_lock<std::mutex> lock(shared_->mutex);
  shared_->task = std::move(call);
  shared_->has_task = true;
  shared_->done = false;
  shared_->wake.notify_all();
  if (!shared_->wake.wait_for(lock, deadline_, [&] { return shared_->done; })) {
    abandoned_ = true;
    return std::nullopt;
  }
  return shared_->result;
}

}  // namespace sp::host
