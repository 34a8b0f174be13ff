#include "replay_inputs.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace sp::replay {
namespace {

using ::testing::HasSubstr;

std::string block(int id, const std::string& extra = "") {
  return "{\"id\":" + std::to_string(id) +
         ",\"sum_sq\":4.0,\"sum\":-0.5,\"max_abs\":0.25,\"count\":100,\"nonfinite\":0" + extra + "}";
}

std::vector<TraceStep> read_all(const std::string& text, uint32_t n_blocks) {
  std::istringstream in(text);
  TraceReader reader(in, "t.jsonl", n_blocks);
  std::vector<TraceStep> steps;
  while (auto step = reader.next()) steps.push_back(std::move(*step));
  return steps;
}

std::string error_of(const std::string& text, uint32_t n_blocks = 4) {
  try {
    read_all(text, n_blocks);
  } catch (const InputError& e) {
    return e.what();
  }
  return "no error";
}

TEST(TraceReader, ReadsStepsInOrderWithAbsentBlocks) {
  const auto steps =
      read_all("{\"step\":0,\"blocks\":[" + block(0) + "," + block(2) + "]}\n\n" + "{\"step\":1,\"blocks\":[]}\n", 4);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].step, 0);
  ASSERT_EQ(steps[0].moments.size(), 2u);
  EXPECT_EQ(steps[0].moments[1].block_id, 2u);
  EXPECT_DOUBLE_EQ(steps[0].moments[1].sum_sq, 4.0);
  EXPECT_DOUBLE_EQ(steps[0].moments[1].sum, -0.5);
  EXPECT_DOUBLE_EQ(steps[0].moments[1].max_abs, 0.25);
  EXPECT_EQ(steps[0].moments[1].count, 100u);
  EXPECT_TRUE(steps[1].moments.empty());
}

TEST(TraceReader, ReadsAnOptionalLossNullMeaningUnknown) {
  const auto steps = read_all(
      "{\"step\":0,\"blocks\":[],\"loss\":2.75}\n{\"step\":1,\"blocks\":[],\"loss\":null}\n"
      "{\"step\":2,\"blocks\":[]}\n",
      4);
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_EQ(steps[0].loss, 2.75);
  EXPECT_TRUE(std::isnan(steps[1].loss));
  EXPECT_TRUE(std::isnan(steps[2].loss));
}

struct BadTrace {
  const char* name;
  std::string text;
  std::string expected;
};

class BadTraceTest : public ::testing::TestWithParam<BadTrace> {};

TEST_P(BadTraceTest, NamesLineFieldAndProblem) {
  EXPECT_THAT(error_of(GetParam().text), HasSubstr(GetParam().expected));
}

const std::string kGoodFirst = "{\"step\":0,\"blocks\":[" + block(0) + "]}\n";

INSTANTIATE_TEST_SUITE_P(
    TraceReader, BadTraceTest,
    ::testing::Values(
        BadTrace{"NotJson", "{\"step\":0,", "t.jsonl:1: line: not valid JSON"},
        BadTrace{"NumberBeyondDouble", "{\"step\":1e400}",
                 "t.jsonl:1: line: not valid JSON ([json.exception.out_of_range.406]"},
        BadTrace{"NotObject", "[1,2]", "t.jsonl:1: line: expected a JSON object, got array"},
        BadTrace{"MissingStep", "{\"blocks\":[]}", "t.jsonl:1: step: missing"},
        BadTrace{"StepNotInteger", "{\"step\":\"0\",\"blocks\":[]}", "step: expected an integer >= 0, got string"},
        BadTrace{"NegativeStep", "{\"step\":-1,\"blocks\":[]}", "step: expected an integer >= 0, got -1"},
        BadTrace{"SkippedStep", kGoodFirst + "{\"step\":2,\"blocks\":[]}", "t.jsonl:2: step: expected step 1"},
        BadTrace{"UnknownTopKey", "{\"step\":0,\"blocks\":[],\"lr\":1}", "lr: unknown key"},
        BadTrace{"LossNotANumber", "{\"step\":0,\"blocks\":[],\"loss\":\"2.5\"}",
                 "t.jsonl:1: loss: expected a number, got string"},
        BadTrace{"BlocksNotArray", "{\"step\":0,\"blocks\":{}}", "blocks: expected an array, got object"},
        BadTrace{"BlockNotObject", "{\"step\":0,\"blocks\":[3]}", "blocks[0]: expected an object, got number"},
        BadTrace{"IdOutOfRange", "{\"step\":0,\"blocks\":[" + block(9) + "]}",
                 "blocks[0].id: block id 9 is out of range: --blocks is 4"},
        BadTrace{"DuplicateId", "{\"step\":0,\"blocks\":[" + block(1) + "," + block(1) + "]}",
                 "blocks[1].id: block 1 is listed twice"},
        BadTrace{"MissingField",
                 "{\"step\":0,\"blocks\":[{\"id\":0,\"sum_sq\":1,\"sum\":0,\"max_abs\":1,\"count\":3}]}",
                 "blocks[0].nonfinite: missing"},
        BadTrace{
            "NegativeSumSq",
            "{\"step\":0,\"blocks\":[{\"id\":0,\"sum_sq\":-1,\"sum\":0,\"max_abs\":1,\"count\":3,\"nonfinite\":0}]}",
            "blocks[0].sum_sq: expected a number >= 0, got -1"},
        BadTrace{"StringMoment",
                 "{\"step\":0,\"blocks\":[{\"id\":0,\"sum_sq\":\"nan\",\"sum\":0,\"max_abs\":1,\"count\":3,"
                 "\"nonfinite\":0}]}",
                 "blocks[0].sum_sq: expected a number, got string"},
        BadTrace{
            "FractionalCount",
            "{\"step\":0,\"blocks\":[{\"id\":0,\"sum_sq\":1,\"sum\":0,\"max_abs\":1,\"count\":2.5,\"nonfinite\":0}]}",
            "blocks[0].count: expected an integer >= 0"},
        BadTrace{
            "NonfiniteAboveCount",
            "{\"step\":0,\"blocks\":[{\"id\":0,\"sum_sq\":1,\"sum\":0,\"max_abs\":1,\"count\":2,\"nonfinite\":3}]}",
            "blocks[0].nonfinite: 3 non-finite elements exceed count 2"},
        BadTrace{"UnknownBlockKey", "{\"step\":0,\"blocks\":[" + block(0, ",\"l2\":3") + "]}",
                 "blocks[0].l2: unknown key"}),
    [](const auto& info) { return std::string(info.param.name); });

class CalibrationFileTest : public ::testing::Test {
 protected:
  std::string write(const std::string& text) {
    const auto path = std::filesystem::path(::testing::TempDir()) /
                      (::testing::UnitTest::GetInstance()->current_test_info()->name() + std::string(".json"));
    std::ofstream(path) << text;
    return path.string();
  }
  std::string error_of(const std::string& text) {
    const std::string path = write(text);
    try {
      read_calibration_file(path, 4);
    } catch (const InputError& e) {
      return e.what();
    }
    return "no error";
  }
};

TEST_F(CalibrationFileTest, ReadsErrorsPerBlock) {
  const auto file = read_calibration_file(write(R"({"block_errors": {"0": 0.01, "3": 0.07}})"), 4);
  EXPECT_EQ(file.errors[sp::Precision::int8].block_ids, (std::vector<uint32_t>{0, 3}));
  EXPECT_EQ(file.errors[sp::Precision::int8].errors, (std::vector<double>{0.01, 0.07}));
  EXPECT_TRUE(file.errors[sp::Precision::nf4].block_ids.empty());
}

TEST_F(CalibrationFileTest, ReadsNf4ErrorsBesideInt8OnesOrAlone) {
  const auto both =
      read_calibration_file(write(R"({"block_errors": {"1": 0.01}, "nf4_block_errors": {"1": 0.09, "2": 0.2}})"), 4);
  EXPECT_EQ(both.errors[sp::Precision::int8].block_ids, (std::vector<uint32_t>{1}));
  EXPECT_EQ(both.errors[sp::Precision::nf4].block_ids, (std::vector<uint32_t>{1, 2}));
  EXPECT_EQ(both.errors[sp::Precision::nf4].errors, (std::vector<double>{0.09, 0.2}));
  const auto nf4_only = read_calibration_file(write(R"({"nf4_block_errors": {"0": 0.1}})"), 4);
  EXPECT_TRUE(nf4_only.errors[sp::Precision::int8].block_ids.empty());
  EXPECT_EQ(nf4_only.errors[sp::Precision::nf4].block_ids, (std::vector<uint32_t>{0}));
}

TEST_F(CalibrationFileTest, RejectsEachDefectWithItsField) {
  EXPECT_THAT(error_of("{"), HasSubstr("not valid JSON"));
  EXPECT_THAT(error_of(R"({"block_errors": {"0": 1e400}})"), HasSubstr("not valid JSON"));
  EXPECT_THAT(error_of(R"({"errors": {}})"), HasSubstr("errors: unknown key"));
  EXPECT_THAT(
      error_of(R"({})"),
      HasSubstr("document: expected at least one of \"block_errors\" (INT8), \"nf4_block_errors\" (NF4); found none"));
  EXPECT_THAT(error_of(R"({"nf4_block_errors": {"5": 0.1}})"),
              HasSubstr("nf4_block_errors.5: block id 5 is out of range"));
  EXPECT_THAT(error_of(R"({"nf4_block_errors": {"1": -1}})"), HasSubstr("nf4_block_errors.1: expected a number >= 0"));
  EXPECT_THAT(error_of(R"({"block_errors": [0.1]})"), HasSubstr("block_errors: expected an object"));
  EXPECT_THAT(error_of(R"({"block_errors": {"x1": 0.1}})"), HasSubstr("block_errors.x1: the key must be a block id"));
  EXPECT_THAT(error_of(R"({"block_errors": {"-1": 0.1}})"), HasSubstr("block_errors.-1: the key must be a block id"));
  EXPECT_THAT(error_of(R"({"block_errors": {"4": 0.1}})"), HasSubstr("block_errors.4: block id 4 is out of range"));
  EXPECT_THAT(error_of(R"({"block_errors": {"0": 0.1, "00": 0.2}})"),
              HasSubstr("block_errors.00: block id 0 is given twice"));
  EXPECT_THAT(error_of(R"({"block_errors": {"1": -0.1}})"), HasSubstr("block_errors.1: expected a number >= 0"));
  EXPECT_THAT(error_of(R"({"block_errors": {"1": "big"}})"),
              HasSubstr("block_errors.1: expected a number, got string"));
  EXPECT_THROW(
      {
        try {
          read_calibration_file("/nonexistent/k.json", 4);
        } catch (const InputError& e) {
          EXPECT_THAT(e.what(), HasSubstr("/nonexistent/k.json: cannot open"));
          throw;
        }
      },
      InputError);
}

}  // namespace
}  // namespace sp::replay
