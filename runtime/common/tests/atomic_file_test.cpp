#include "sp/runtime/atomic_file.h"
#include "sp/input_files/read_file.h"

#include <sys/resource.h>
#include <sys/stat.h>

#include <cerrno>
#include <csignal>
#include <cstring>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace sp::runtime {
namespace {

namespace fs = std::filesystem;
using input_files::FileReadError;
using input_files::read_whole_file;

class AtomicFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("atomic-" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::string read(const fs::path& p) {
    std::ifstream in(p);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  size_t entries() const { return static_cast<size_t>(std::distance(fs::directory_iterator(dir_), {})); }

  fs::path dir_;
};

TEST_F(AtomicFileTest, CommitReplacesTheTargetWhole) {
  const fs::path target = dir_ / "out.json";
  std::ofstream(target) << "old";
  write_file_atomically(target, "new contents");
  EXPECT_EQ(read(target), "new contents");
  EXPECT_EQ(entries(), 1u) << "the temporary file must be gone";
  struct stat st {};
  ASSERT_EQ(::stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
}

TEST_F(AtomicFileTest, AbandonedWriterKeepsTheOldFileAndLeavesNoTemporary) {
  const fs::path target = dir_ / "out.json";
  std::ofstream(target) << "old";
  {
    AtomicFileWriter writer(target);
    writer.stream() << "half written";
  }
  EXPECT_EQ(read(target), "old");
  EXPECT_EQ(entries(), 1u);
}

// A full disk (here: the file size limit) names the system's reason and keeps the previous file.
TEST_F(AtomicFileTest, AFailedWriteNamesItsCauseAndKeepsThePreviousFile) {
  const fs::path target = dir_ / "checkpoint.bin";
  std::ofstream(target) << "previous";
  std::signal(SIGXFSZ, SIG_IGN);  // over the limit, write() fails with EFBIG instead
  rlimit previous{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &previous), 0);
  rlimit small = previous;
  small.rlim_cur = 1000;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string message;
  try {
    write_file_atomically(target, std::string(200000, 'x'));
  } catch (const std::runtime_error& e) {
    message = e.what();
  }
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &previous), 0);
  EXPECT_NE(message.find(std::strerror(EFBIG)), std::string::npos) << message;
  EXPECT_NE(message.find("the previous file is kept"), std::string::npos) << message;
  EXPECT_EQ(read(target), "previous");
  EXPECT_EQ(entries(), 1u) << "the temporary file must be gone";
}

TEST_F(AtomicFileTest, MissingDirectoryIsAClearError) {
  const fs::path target = dir_ / "no-such-dir" / "out.json";
  try {
    write_file_atomically(target, "x");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no-such-dir/out.json"), std::string::npos) << e.what();
  }
}

TEST_F(AtomicFileTest, OutputPathsAreJudgedBeforeAnyWork) {
  EXPECT_EQ(output_file_problem(dir_ / "report.json"), "");
  EXPECT_EQ(output_file_problem("relative-in-cwd.json"), "");
  EXPECT_EQ(output_file_problem(""), "expected a file path, found an empty string");
  EXPECT_EQ(output_file_problem(dir_), dir_.string() + " is a directory; expected a file path");
  EXPECT_EQ(output_file_problem(dir_ / "absent" / "report.json"),
            "the directory " + (dir_ / "absent").string() + " of " + (dir_ / "absent" / "report.json").string() +
                " does not exist");
}

TEST_F(AtomicFileTest, ReadingAWholeFileNamesWhatWentWrong) {
  const fs::path file = dir_ / "in.txt";
  std::ofstream(file) << "line one\nline two";
  EXPECT_EQ(read_whole_file(file, "input"), "line one\nline two");
  const auto message_of = [](const fs::path& path) -> std::pair<std::string, bool> {
    try {
      read_whole_file(path, "checkpoint");
    } catch (const FileReadError& e) {
      return {e.what(), e.missing()};
    }
    return {"no error", false};
  };
  EXPECT_EQ(message_of(dir_), std::make_pair(dir_.string() + ": is a directory; expected the checkpoint", false));
  EXPECT_EQ(message_of("/dev/zero"),
            std::make_pair(std::string("/dev/zero: is not a regular file; expected the checkpoint"), false));
  ASSERT_EQ(::mkfifo((dir_ / "fifo").c_str(), 0600), 0);
  EXPECT_EQ(message_of(dir_ / "fifo").first,
            (dir_ / "fifo").string() + ": is not a regular file; expected the checkpoint");
  const auto [missing, is_missing] = message_of(dir_ / "absent");
  EXPECT_THAT(missing,
              ::testing::StartsWith((dir_ / "absent").string() + ": cannot open the checkpoint: No such file"));
  EXPECT_TRUE(is_missing);
}

}  // namespace
}  // namespace sp::runtime
