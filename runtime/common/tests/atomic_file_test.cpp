#include "sp/runtime/atomic_file.hpp"

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

namespace sp::runtime {
namespace {

namespace fs = std::filesystem;

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

TEST_F(AtomicFileTest, MissingDirectoryIsAClearError) {
  const fs::path target = dir_ / "no-such-dir" / "out.json";
  try {
    write_file_atomically(target, "x");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no-such-dir/out.json"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace sp::runtime
