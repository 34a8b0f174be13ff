// One sp-train per run directory: an exclusive lock on <run dir>/.sp-train.lock, held for the
// life of the run, so that a second run on the same --out is refused by name instead of
// writing every step twice and cutting back the logs the first one is still writing.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace sp::train {

class RunDirectoryLock {
 public:
  // Takes the lock or throws ConfigError naming the directory and the pid that holds it.
  // flock(2): released by the kernel when the process ends, however it ends.
  explicit RunDirectoryLock(const std::filesystem::path& run_dir);
  ~RunDirectoryLock();
  RunDirectoryLock(const RunDirectoryLock&) = delete;
  RunDirectoryLock& operator=(const RunDirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

// Removes the temporary files that killed atomic writes of `names` left in `run_dir`
// (".<name>.tmp-XXXXXX", sp/runtime/atomic_file.h), and of every file whose name begins with
// one of `name_prefixes` (a family such as the checkpoint shards, one file per step). Only
// under the lock: a live writer's temporary file would otherwise go too. Returns what it
// removed.
std::vector<std::filesystem::path> remove_stale_temporaries(const std::filesystem::path& run_dir,
                                                            const std::vector<std::string>& names,
                                                            const std::vector<std::string>& name_prefixes = {});

}  // namespace sp::train
