// sp-train as a child process, for the tests that drive the binary: started with arguments
// and environment variables, waited on by its own progress records, not by the clock.
#pragma once

#include <grp.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace sp::train::testing {

inline std::size_t line_count(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::size_t lines = 0;
  for (std::string line; std::getline(in, line);) ++lines;
  return lines;
}

// Who the child runs as: the test's own user, or, when that is root (whom file permissions do
// not stop), the unprivileged `nobody` (uid and gid 65534), for the tests of permissions.
enum class RunAs { self, unprivileged };

// Starts sp-train (SP_TRAIN_BINARY) with `args` and the extra environment `env` in a child
// process whose output goes to `log`.
inline pid_t spawn_sp_train(const std::vector<std::string>& args, const std::filesystem::path& log,
                            const std::vector<std::pair<std::string, std::string>>& env = {},
                            RunAs run_as = RunAs::self) {
  const pid_t child = ::fork();
  if (child != 0) return child;
  std::vector<char*> argv{const_cast<char*>(SP_TRAIN_BINARY)};
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& [name, value] : env) ::setenv(name.c_str(), value.c_str(), 1);
  std::FILE* sink = std::freopen(log.c_str(), "w", stdout);
  if (sink == nullptr || ::dup2(::fileno(stdout), 2) < 0) ::_exit(99);
  if (run_as == RunAs::unprivileged && ::geteuid() == 0) {
    constexpr uid_t kNobody = 65534;
    if (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 || ::setuid(kNobody) != 0) ::_exit(97);
  }
  ::execv(SP_TRAIN_BINARY, argv.data());
  ::_exit(98);
}

// Polls the run's own progress record, so that a test waits for an event, not for a time.
inline void wait_for_steps(pid_t child, const std::filesystem::path& metrics, std::size_t steps) {
  while (line_count(metrics) < steps) {
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, WNOHANG), 0) << "sp-train exited before step " << steps;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// The child's exit code; -1 when it did not exit (a signal ended it).
inline int wait_exit_code(pid_t child) {
  int status = 0;
  if (::waitpid(child, &status, 0) != child || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// A TCP port on the loopback that was free a moment ago (for MASTER_PORT).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

}  // namespace sp::train::testing
