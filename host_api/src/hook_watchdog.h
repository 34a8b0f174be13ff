// Runs plugin hook calls on a supervised thread, so that a hook that never returns costs the
// training loop one deadline instead of the run (PolicyHostOptions::hook_deadline). Private to
// the host library.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "sp/plugin_abi_v1.h"

namespace sp::host {

class HookWatchdog {
 public:
  explicit HookWatchdog(std::chrono::milliseconds deadline);
  // Joins the worker; a worker still inside an abandoned call is detached instead (it holds
  // what it uses), since nothing can interrupt a plugin's code.
  ~HookWatchdog();
  HookWatchdog(const HookWatchdog&) = delete;
  HookWatchdog& operator=(const HookWatchdog&) = delete;

  // The call's status, or nullopt when it did not return within the deadline: the call goes
  // on in the background, and this watchdog takes no further calls. Whatever the call reads
  // or writes must be owned by the call itself (captured by value).
  std::optional<sp_status> run(std::function<sp_status()> call);
  bool abandoned() const { return abandoned_; }
  std::chrono::milliseconds deadline() const { return deadline_; }

 private:
  struct Shared {
    std::mutex mutex;
    std::condition_variable wake;
    std::function<sp_status()> task;
    bool has_task = false;
    bool done = false;
    bool stop = false;
    sp_status result = SP_OK;
  };
  std::shared_ptr<Shared> shared_;
  std::chrono::milliseconds deadline_;
  std::thread worker_;
  bool abandoned_ = false;
};

}  // namespace sp::host
