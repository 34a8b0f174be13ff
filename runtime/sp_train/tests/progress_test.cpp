// The progress bar and the log share a terminal: under a pseudo-terminal, a log line must
// clear the bar, take a line of its own and have the bar redrawn after it.
#include <fcntl.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include <gtest/gtest.h>
#include <spdlog/logger.h>

#include "progress.h"

namespace sp::train {
namespace {

// A pseudo-terminal pair: `tty` is the terminal the program writes to, `read_all()` returns
// what a terminal emulator would have received, byte for byte (raw mode: no \n -> \r\n).
class PseudoTerminal {
 public:
  PseudoTerminal() {
    master_ = ::posix_openpt(O_RDWR | O_NOCTTY);
    if (master_ < 0 || ::grantpt(master_) != 0 || ::unlockpt(master_) != 0) return;
    const int slave = ::open(::ptsname(master_), O_RDWR | O_NOCTTY);
    if (slave < 0) return;
    termios mode{};
    ::tcgetattr(slave, &mode);
    ::cfmakeraw(&mode);
    ::tcsetattr(slave, TCSANOW, &mode);
    tty = ::fdopen(slave, "w");
    ::fcntl(master_, F_SETFL, ::fcntl(master_, F_GETFL) | O_NONBLOCK);
  }
  ~PseudoTerminal() {
    if (tty != nullptr) std::fclose(tty);
    if (master_ >= 0) ::close(master_);
  }
  void set_columns(unsigned short columns) {
    winsize size{};
    size.ws_col = columns;
    size.ws_row = 24;
    ::ioctl(::fileno(tty), TIOCSWINSZ, &size);
  }
  std::string read_all() const {
    std::string out;
    char buffer[4096];
    for (ssize_t n; (n = ::read(master_, buffer, sizeof buffer)) > 0;) out.append(buffer, static_cast<size_t>(n));
    return out;
  }
  std::FILE* tty = nullptr;

 private:
  int master_ = -1;
};

ProgressState state_at(std::int64_t step) {
  ProgressState state;
  state.step = step;
  state.total = 10;
  state.loss = 2.5;
  state.eta_seconds = 12;
  return state;
}

ProgressState busy_state() {
  ProgressState state = state_at(1234);
  state.total = 100000;
  state.val_loss = 2.4567;
  state.tokens_per_second = 123456;
  state.blocks[sp::Precision::bf16] = 12;
  state.blocks[sp::Precision::int8] = 34;
  state.blocks[sp::Precision::nf4] = 56;
  state.bytes_saved = 123456789012;
  state.bytes_all_bf16 = 234567890123;
  state.eta_seconds = 98765;
  return state;
}

TEST(ProgressLine, OnAnEightyColumnTerminalTheLineFitsAndKeepsStepAndLoss) {
  const ProgressState state = busy_state();
  const std::string full = format_progress(state);
  ASSERT_GT(full.size(), 80u) << full;
  PseudoTerminal terminal;
  ASSERT_NE(terminal.tty, nullptr);
  terminal.set_columns(80);
  EXPECT_EQ(terminal_columns(terminal.tty), 80u);
  ProgressLine progress(terminal.tty, true);
  progress.update(state);
  const std::string drawn = terminal.read_all();
  ASSERT_EQ(drawn.rfind("\r\033[2K", 0), 0u) << drawn;
  const std::string line = drawn.substr(5);
  EXPECT_LE(line.size(), 79u) << line;  // one column spare: no wrap at the last column
  EXPECT_EQ(line, format_progress(state, 79));
  EXPECT_NE(line.find("step 1234/100000"), std::string::npos) << line;
  EXPECT_NE(line.find("loss 2.5000"), std::string::npos) << line;
  // The bar's picture goes first, the time left last.
  EXPECT_EQ(line.find('#'), std::string::npos) << line;
  EXPECT_NE(line.find("eta 98765s"), std::string::npos) << line;
}

TEST(ProgressLine, FieldsLeaveInTheirOrderAsTheTerminalNarrows) {
  const ProgressState state = busy_state();
  const std::string full = format_progress(state);
  std::size_t previous = full.size();
  for (std::size_t columns = full.size(); columns >= 10; --columns) {
    const std::string line = format_progress(state, columns);
    ASSERT_LE(line.size(), columns);
    ASSERT_LE(line.size(), previous);
    previous = line.size();
  }
  EXPECT_EQ(format_progress(state, 40), "step 1234/100000 | loss 2.5000");
  EXPECT_EQ(format_progress(state, 10), "step 1234/");
  EXPECT_EQ(format_progress(state, 0), full);
}

TEST(ProgressLine, ALogLineUnderATerminalClearsTheBarAndRedrawsIt) {
  PseudoTerminal terminal;
  ASSERT_NE(terminal.tty, nullptr) << "no pseudo-terminal: " << std::strerror(errno);
  auto progress = std::make_shared<ProgressLine>(terminal.tty, true);
  spdlog::logger logger("progress-test", make_progress_aware_sink(progress, terminal.tty));

  progress->update(state_at(3));
  logger.info("step 3: block 1 bf16 -> nf4 (reason threshold)");
  progress->update(state_at(4));
  progress->finish();

  const std::string bar3 = format_progress(state_at(3));
  const std::string bar4 = format_progress(state_at(4));
  const std::string clear = "\r\033[2K";
  const std::string out = terminal.read_all();
  // The failure seen under tmux: "... | eta 12s[09:20:21.467] [info] ..." on one line.
  EXPECT_EQ(out.find("eta 12s["), std::string::npos) << out;
  const std::string before_line = clear + bar3 + clear;
  ASSERT_EQ(out.substr(0, before_line.size()), before_line) << out;
  const std::size_t line_start = before_line.size();
  const std::string message_end = "(reason threshold)\n";
  const std::size_t line_end = out.find(message_end, line_start);
  ASSERT_NE(line_end, std::string::npos) << out;
  EXPECT_NE(out.substr(line_start, line_end - line_start).find("] [\033[32minfo\033[m] step 3: block 1"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.substr(line_end + message_end.size()), bar3 + clear + bar4 + "\n");
}

TEST(ProgressLine, ALogLineToAFileLeavesTheBarAlone) {
  PseudoTerminal terminal;
  ASSERT_NE(terminal.tty, nullptr);
  std::FILE* log_file = std::tmpfile();
  ASSERT_NE(log_file, nullptr);
  auto progress = std::make_shared<ProgressLine>(terminal.tty, true);
  spdlog::logger logger("progress-test", make_progress_aware_sink(progress, log_file));
  progress->update(state_at(3));
  logger.warn("plain");
  std::fflush(log_file);
  std::rewind(log_file);
  char line[256] = {};
  ASSERT_NE(std::fgets(line, sizeof line, log_file), nullptr);
  std::fclose(log_file);
  EXPECT_NE(std::string(line).find("] [warning] plain\n"), std::string::npos) << line;
  EXPECT_EQ(terminal.read_all(), "\r\033[2K" + format_progress(state_at(3)));
}

}  // namespace
}  // namespace sp::train
