// One thread that runs tasks in the order they were given: the layer's update during the
// backward runs each block's fused AdamW sweep here while the backward goes on. One thread,
// not one per task: the sweeps are bandwidth-bound and multi-threaded themselves, so two at
// once would only compete.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace sp::torch_layer {

class SerialWorker {
 public:
  SerialWorker() = default;
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;
  // Runs the tasks still queued, then joins.
  ~SerialWorker() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

  // Queues `task`; the future holds its completion or its exception. The thread starts with the
  // first task.
  std::future<void> submit(std::function<void()> task) {
    std::packaged_task<void()> packaged(std::move(task));
    std::future<void> done = packaged.get_future();
    {
      std::lock_guard lock(mutex_);
      // Started before the task is queued: a thread that cannot start leaves no task behind
      // for a later thread to run after its caller gave up on it.
      if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
      tasks_.push_back(std::move(packaged));
    }
    wake_.notify_one();
    return done;
  }

 private:
  void run() {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::packaged_task<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace sp::torch_layer
