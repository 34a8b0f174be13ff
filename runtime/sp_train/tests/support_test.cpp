// The plain-C++ parts of sp-train: corpus split and batches, checkpoint container,
// calibration cache, AdamW, and that compute weights are exactly what a route delivered.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <type_traits>

#include <gtest/gtest.h>

#include "adamw.h"
#include "calibration_cache.h"
#include "checkpoint_file.h"
#include "checkpoint_meta.h"
#include "error_report.h"
#include "sp/host/plugin_library.h"
#include "sp/input_files/read_file.h"
#include "sp/adapters/host_backend.h"
#include "sp/adapters/streaming_engine.h"
#include "sp/precision_abi.h"
#include "sp/kernels/bf16.h"
#include "sp/kernels/quantize.h"
#include "sp/runtime/hash.h"
#include "text_corpus.h"
#include "train_test_support.h"

namespace sp::train {
namespace {

namespace fs = std::filesystem;

class ScratchDir : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::make_scratch_dir("support"); }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

using Corpus = ScratchDir;

TEST_F(Corpus, SplitsEvenlyAndSamplesDeterministically) {
  fs::create_directories(dir_ / "d" / "sub");
  testing::write_text(dir_ / "d" / "a.txt", std::string(3000, 'a'));
  testing::write_text(dir_ / "d" / "sub" / "b.txt", std::string(3000, 'b'));
  fs::create_symlink(dir_ / "d" / "a.txt", dir_ / "d" / "c-link.txt");  // read once
  const TextCorpus corpus(dir_ / "d", 0.25, 1000, 16);
  EXPECT_EQ(corpus.stats().files, 2u);
  // 6002 bytes (each file ends with a newline) in 7 chunks; with f = 1/4 only chunk 3 is validation.
  EXPECT_EQ(corpus.stats().train_bytes + corpus.stats().val_bytes, 6002u);
  EXPECT_EQ(corpus.stats().val_bytes, 1000u);
  std::vector<std::int64_t> a, b, c;
  corpus.train_batch(1, 5, 4, a);
  corpus.train_batch(1, 5, 4, b);
  corpus.train_batch(1, 6, 4, c);
  EXPECT_EQ(a.size(), 4u * 17);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  corpus.val_batch(0, 2, 4, a);
  corpus.val_batch(1, 2, 4, b);
  EXPECT_NE(a, b);
}

TEST_F(Corpus, RejectsUnusablePathsByName) {
  EXPECT_THROW(TextCorpus(dir_ / "missing", 0.1, 1024, 16), DataError);
  testing::write_text(dir_ / "short.txt", "tiny");
  try {
    TextCorpus(dir_ / "short.txt", 0.1, 1024, 16);
    FAIL();
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("short.txt: 4 bytes of text in 1 file(s)"), std::string::npos) << e.what();
  }
  fs::create_symlink("loop", dir_ / "loop");
  try {
    TextCorpus(dir_ / "loop", 0.1, 1024, 16);
    FAIL();
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("loop: data path cannot be used: Too many levels of symbolic links"),
              std::string::npos)
        << e.what();
  }
}

using Checkpoint = ScratchDir;

// A viewed section is written from the caller's bytes; the file is the same as with a copy,
// and a later put() of the same name replaces the view.
TEST_F(Checkpoint, ViewedSectionsWriteTheSameFileAsCopiedOnes) {
  const std::vector<float> weights = {1.5f, -2.0f, 3.25f, 7.0f};
  CheckpointSections copied, viewed;
  copied.put("master/w", weights.data(), weights.size() * sizeof(float));
  copied.put("meta", std::string("{}").data(), 2);
  viewed.put("meta", std::string("{}").data(), 2);
  viewed.put_view("master/w", weights.data(), weights.size() * sizeof(float));
  viewed.put_view("replaced", weights.data(), sizeof(float));
  viewed.put("replaced", std::string("x").data(), 1);
  copied.put("replaced", std::string("x").data(), 1);
  copied.write_atomically(dir_ / "copied.bin");
  viewed.write_atomically(dir_ / "viewed.bin");
  std::ifstream a(dir_ / "copied.bin", std::ios::binary), b(dir_ / "viewed.bin", std::ios::binary);
  const std::string bytes_a((std::istreambuf_iterator<char>(a)), std::istreambuf_iterator<char>());
  const std::string bytes_b((std::istreambuf_iterator<char>(b)), std::istreambuf_iterator<char>());
  EXPECT_EQ(bytes_a, bytes_b);
  std::vector<float> back(4);
  CheckpointSections::read(dir_ / "viewed.bin").get_into("master/w", back.data(), back.size() * sizeof(float));
  EXPECT_EQ(back, weights);
  EXPECT_THROW(viewed.get("master/w"), CheckpointError) << "a view is only written";
}

TEST_F(Checkpoint, RoundTripsAndRejectsDamage) {
  CheckpointSections out;
  const std::vector<float> weights = {1.5f, -2.0f, 3.25f};
  out.put("master/w", weights.data(), weights.size() * sizeof(float));
  out.put("meta", std::string("{}").data(), 2);
  const fs::path file = dir_ / "ckpt.bin";
  out.write_atomically(file);
  const CheckpointSections in = CheckpointSections::read(file);
  std::vector<float> back(3);
  in.get_into("master/w", back.data(), back.size() * sizeof(float));
  EXPECT_EQ(back, weights);
  EXPECT_THROW(in.get("absent"), CheckpointError);
  EXPECT_THROW(in.get_into("master/w", back.data(), 2 * sizeof(float)), CheckpointError);

  const auto size = fs::file_size(file);
  fs::resize_file(file, size - 3);
  EXPECT_THROW(CheckpointSections::read(file), CheckpointError);
  out.write_atomically(file);
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(30);
    f.put('\x7f');
  }
  try {
    CheckpointSections::read(file);
    FAIL();
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos);
  }
}

// A read validates the file and then reads each section from it when asked, through the
// descriptor it opened: the next checkpoint renamed over the path changes nothing of what it
// reads, and a file cut short under it afterwards is named, not read past.
TEST_F(Checkpoint, SectionsAreReadFromTheValidatedFileWhenAskedFor) {
  std::vector<float> weights(3000);
  for (std::size_t i = 0; i < weights.size(); ++i) weights[i] = static_cast<float>(i) * 0.5f;
  CheckpointSections out;
  out.put("master/w", weights.data(), weights.size() * sizeof(float));
  out.put("meta", std::string("{}").data(), 2);
  const fs::path file = dir_ / "ckpt.bin";
  out.write_atomically(file);
  const CheckpointSections in = CheckpointSections::read(file);
  EXPECT_EQ(in.names(), (std::vector<std::string>{"master/w", "meta"}));

  CheckpointSections next;
  next.put("master/w", std::string("other").data(), 5);
  next.write_atomically(file);  // renamed over the path, as the next checkpoint is
  std::vector<float> back(weights.size());
  in.get_into("master/w", back.data(), back.size() * sizeof(float));
  EXPECT_EQ(back, weights);
  // A copy of the read sections writes the first file again, section by section.
  in.write_atomically(dir_ / "copy.bin");
  std::vector<float> copied(weights.size());
  CheckpointSections::read(dir_ / "copy.bin").get_into("master/w", copied.data(), copied.size() * sizeof(float));
  EXPECT_EQ(copied, weights);

  const CheckpointSections cut = CheckpointSections::read(dir_ / "copy.bin");
  fs::resize_file(dir_ / "copy.bin", 100);
  try {
    cut.get_into("master/w", back.data(), back.size() * sizeof(float));
    FAIL() << "read past the end of a file cut short";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("copy.bin: section 'master/w' (12000 bytes at offset"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(cut.get("meta"), CheckpointError) << "it lies after the cut too";
}

// Damage behind a valid checksum, as a writer with a bug would leave it: the reader still
// names it, and allocates nothing the file cannot back.
TEST_F(Checkpoint, SealedStructuralDamageIsNamed) {
  CheckpointSections out;
  out.put("aa", "1", 1);
  out.put("ab", "2", 1);
  const fs::path file = dir_ / "sealed.bin";
  out.write_atomically(file);
  std::string bytes = testing::read_text(file);
  const auto reseal = [&](std::string body) {
    body.resize(body.size() - 8);
    const std::uint64_t sum = sp::runtime::fnv1a64(body.data(), body.size());
    body.append(reinterpret_cast<const char*>(&sum), sizeof sum);
    testing::write_text(file, body);
  };
  const auto error = [&] {
    try {
      CheckpointSections::read(file);
    } catch (const CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string("read");
  };
  std::string twice = bytes;
  twice.replace(twice.find("ab"), 2, "aa");
  reseal(twice);
  EXPECT_NE(error().find("section 'aa' appears twice"), std::string::npos) << error();
  std::string long_name = bytes;
  const std::uint32_t huge = 0xFFFFFFFFu;
  std::memcpy(&long_name[8 + 4 + 4], &huge, sizeof huge);  // magic, version, count, then the first name length
  reseal(long_name);
  EXPECT_NE(error().find("the name of section 0 claims 4294967295 bytes"), std::string::npos) << error();
}

using CalibrationCache = ScratchDir;

TEST_F(CalibrationCache, HitsOnlyItsOwnFingerprint) {
  const nlohmann::json identity = {{"model", "tiny"}};
  const std::string fp = calibration_fingerprint(identity);
  const fs::path file = calibration_cache_file(dir_ / "cache", fp);
  EXPECT_EQ(read_calibration_cache(file, fp, 2).status, CacheStatus::missing);
  CalibrationErrors errors;
  errors[sp::Precision::int8] = {0.01, 0.02};
  errors[sp::Precision::nf4] = {0.11, 0.13};
  write_calibration_cache(file, fp, identity, errors);
  const CacheLookup hit = read_calibration_cache(file, fp, 2);
  ASSERT_EQ(hit.status, CacheStatus::hit);
  EXPECT_EQ(hit.errors[sp::Precision::int8], (std::vector<double>{0.01, 0.02}));
  EXPECT_EQ(hit.errors[sp::Precision::nf4], (std::vector<double>{0.11, 0.13}));
  EXPECT_EQ(read_calibration_cache(file, "0000000000000000", 2).status, CacheStatus::mismatch);
  EXPECT_EQ(read_calibration_cache(file, fp, 3).status, CacheStatus::mismatch);
  // An edited number breaks the checksum.
  std::ifstream in(file);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const char* edit : {"0.02", "0.13"}) {
    std::string edited = text;
    edited.replace(edited.find(edit), 4, "0.03");
    testing::write_text(file, edited);
    EXPECT_EQ(read_calibration_cache(file, fp, 2).status, CacheStatus::corrupt) << edit;
  }
  // A cache of the INT8-only version 1 is measured again, not trusted.
  std::string version_one = text;
  version_one.replace(version_one.find("\"version\": 2"), 12, "\"version\": 1");
  testing::write_text(file, version_one);
  const CacheLookup old = read_calibration_cache(file, fp, 2);
  EXPECT_EQ(old.status, CacheStatus::mismatch);
  EXPECT_NE(old.detail.find("cache version 1, this sp-train writes version 2"), std::string::npos) << old.detail;
  testing::write_text(file, "{\"format\": ");
  EXPECT_EQ(read_calibration_cache(file, fp, 2).status, CacheStatus::corrupt);
  // Fields of the wrong type are corrupt too, not an exception.
  for (const char* doc :
       {"{\"format\": 5, \"version\": 2}", "{\"format\": \"sp-train-calibration\", \"version\": \"2\"}", "[1, 2]",
        "{\"format\": \"sp-train-calibration\", \"version\": 2, \"block_errors\": 3}",
        "{\"format\": \"sp-train-calibration\", \"version\": 2, \"block_errors\": [], \"nf4_block_errors\": 3}"}) {
    testing::write_text(file, doc);
    EXPECT_EQ(read_calibration_cache(file, fp, 2).status, CacheStatus::corrupt) << doc;
  }
}

TEST(AdamW, MatchesTheDefinitionAndLeavesNonDecayedTensorsUndecayed) {
  std::vector<float> w = {1.0f, -0.5f}, g = {0.2f, -0.1f}, bias = {0.3f}, bias_g = {0.0f};
  AdamW adam(kernels::AdamWHyperparameters{0.9, 0.99, 1e-8, 0.1});
  const std::size_t wi = adam.add("w", w.data(), g.data(), 2, true);
  const std::size_t bi = adam.add("b", bias.data(), bias_g.data(), 1, false);
  adam.begin_step(0.01, 0.5);
  adam.step_parameter(wi);
  adam.step_parameter(bi);
  for (int i = 0; i < 2; ++i) {
    const double grad = 0.5 * (i == 0 ? 0.2 : -0.1);
    const double m = 0.1 * grad / 0.1, v = 0.01 * grad * grad / 0.01;
    const double expected = (i == 0 ? 1.0 : -0.5) * (1 - 0.01 * 0.1) - 0.01 * m / (std::sqrt(v) + 1e-8);
    EXPECT_NEAR(w[i], expected, 1e-6);
  }
  EXPECT_EQ(bias[0], 0.3f);
  EXPECT_EQ(adam.steps_taken(), 1);
}

// The trainer computes on views of the slot (widened exactly to fp32, or in place in bf16), so
// the slot must hold what the route delivers: BF16 route -> bf16(master); INT8 route ->
// bf16(dequant(quant(master))).
TEST(DeliveredWeights, AreExactlyWhatEachRouteDelivered) {
  const std::uint64_t rows = 24, cols = 64;
  std::vector<float> master(rows * cols);
  for (std::size_t i = 0; i < master.size(); ++i) master[i] = std::sin(0.37f * i) * (1.0f + (i % 7));
  adapters::BlockSpec block{"block0", {adapters::TensorSpec{"w", master.data(), rows, cols}}};
  adapters::HostBackend backend;
  adapters::StreamingConfig config;
  config.host_slab_bytes = 1 << 16;
  config.host_slab_count = 2;
  config.device_slot_bytes = 1 << 16;
  config.int8_group_size = 32;
  config.backward = false;
  adapters::StreamingEngine engine(backend, config, {block});

  std::vector<std::uint16_t> bf16(master.size());
  kernels::fp32_to_bf16(master.data(), bf16.data(), bf16.size());
  const std::vector<std::uint16_t> expected_bf16 = bf16;
  std::vector<std::int8_t> codes(master.size());
  std::vector<float> scales(kernels::scale_count(rows, cols, 32));
  kernels::QuantizeOptions q;
  q.group_size = 32;
  kernels::quantize_int8(master.data(), kernels::DType::kFloat32, rows, cols, q, codes.data(), scales.data());
  std::vector<std::uint16_t> expected_int8(master.size());
  kernels::dequantize_int8_to_bf16(codes.data(), scales.data(), rows, cols, 32, expected_int8.data());
  ASSERT_NE(expected_bf16, expected_int8);

  for (sp_precision route : {SP_PRECISION_BF16, SP_PRECISION_INT8}) {
    engine.policy_bridge().set_plugin_routes({*from_abi(route)});
    engine.begin_step(route);
    const adapters::BlockView& view = engine.acquire(0);
    EXPECT_EQ(view.precision, route == SP_PRECISION_INT8 ? Precision::int8 : Precision::bf16);
    const std::vector<std::uint16_t> slot(view.tensors[0].bf16, view.tensors[0].bf16 + master.size());
    engine.release(0);
    engine.end_step();
    EXPECT_EQ(slot, route == SP_PRECISION_INT8 ? expected_int8 : expected_bf16) << "route " << route;
  }
}

// sp-train's exit codes (docs/training.md): the user's errors keep their codes and messages,
// and a bug is an internal error (1) named as one, whatever exception type carries it.
TEST(ErrorReport, UserErrorsKeepTheirCodesAndBugsAreInternal) {
  static_assert(std::is_base_of_v<TrainError, ConfigError> && std::is_base_of_v<TrainError, DataError> &&
                std::is_base_of_v<TrainError, CheckpointError> && std::is_base_of_v<TrainError, ResumeError> &&
                std::is_base_of_v<TrainError, DivergedError>);
  const auto report = [](auto&& exception) { return report_error(std::make_exception_ptr(exception)); };
  const struct {
    ErrorReport got;
    int code;
  } user[] = {{report(ConfigError("tiny.yaml: train.lr: expected > 0")), 2},
              {report(sp::host::PluginError("cannot load policy plugin x.so")), 3},
              {report(DataError("data.path: no such file")), 4},
              {report(CheckpointError("checkpoint.bin: checksum mismatch")), 4},
              {report(ResumeError("checkpoint.bin: made for n_blocks = 3")), 4},
              {report(DivergedError("step 9: loss nan")), 5}};
  for (const auto& [got, code] : user) {
    EXPECT_EQ(static_cast<int>(got.exit_code), code) << got.message;
    EXPECT_EQ(got.message.find("internal error"), std::string::npos) << got.message;
  }
  EXPECT_EQ(user[0].got.message, "tiny.yaml: train.lr: expected > 0");
  for (const ErrorReport& bug : {report(std::out_of_range("vector::_M_range_check")),
                                 report(std::invalid_argument("AdamW: parameter 'x' has no weights")),
                                 report(std::logic_error("StreamingEngine::acquire(3) out of order")), report(42)}) {
    EXPECT_EQ(bug.exit_code, ExitCode::internal) << bug.message;
    EXPECT_EQ(bug.message.rfind(kBugReportPrefix, 0), 0u) << bug.message;
  }
  const ErrorReport outside = report(std::runtime_error("run/config.yaml: No space left on device"));
  EXPECT_EQ(outside.exit_code, ExitCode::internal);
  EXPECT_EQ(outside.message, "internal error: run/config.yaml: No space left on device");
}

TEST(CheckpointMeta, AVersionOneMetaGetsWhatItsReleaseLeftOutAndKeepsWhatItHas) {
  const nlohmann::json v1 = {{"next_step", 3},
                             {"model", {{"d_model", 8}}},
                             {"adam_moments", "bf16_stochastic"},
                             {"totals", {{"h2d_bf16", 5}}}};
  const nlohmann::json v2 = migrate_meta_from_v1(v1);
  EXPECT_EQ(v2["version"], kCheckpointMetaVersion);
  EXPECT_EQ(v2["model"]["streaming_unit"], "block");
  EXPECT_TRUE(v2["model"]["nf4_group_size"].is_null());
  EXPECT_EQ(v2["world_size"], 1);
  EXPECT_EQ(v2["data_parallel"], "replicated");
  EXPECT_EQ(v2["nf4_calibration_errors"], nlohmann::json::array());
  for (const char* key : {"h2d_nf4", "nf4_block_steps", "calibration_h2d"}) EXPECT_EQ(v2["totals"][key], 0) << key;
  EXPECT_EQ(v2["totals"]["update_seconds"], 0.0);
  EXPECT_EQ(v2["adam_moments"], "bf16_stochastic");
  EXPECT_EQ(v2["model"]["d_model"], 8);
  EXPECT_EQ(v2["totals"]["h2d_bf16"], 5);
  EXPECT_EQ(v2["next_step"], 3);
}

TEST(CheckpointMeta, ANewerOrMalformedVersionIsRefusedByName) {
  const auto read = [](const nlohmann::json& meta) {
    CheckpointSections sections;
    const std::string text = meta.dump();
    sections.put("meta", text.data(), text.size());
    return read_checkpoint_meta(sections, "run/checkpoint.bin");
  };
  const nlohmann::json base = {{"next_step", 1}, {"model", nlohmann::json::object()}};
  EXPECT_EQ(read(base)["version"], kCheckpointMetaVersion);  // unversioned: version 1, migrated
  nlohmann::json newer = base;
  newer["version"] = kCheckpointMetaVersion + 1;
  try {
    read(newer);
    FAIL() << "a newer meta was read";
  } catch (const ResumeError& e) {
    EXPECT_NE(std::string(e.what()).find("run/checkpoint.bin: section 'meta' is version 3, written by a newer "
                                         "sp-train; this one reads versions 1 to 2"),
              std::string::npos)
        << e.what();
  }
  nlohmann::json malformed = base;
  malformed["version"] = "two";
  try {
    read(malformed);
    FAIL() << "a malformed version was read";
  } catch (const ResumeError& e) {
    EXPECT_NE(std::string(e.what()).find("version is \"two\"; expected an integer >= 1"), std::string::npos)
        << e.what();
  }
}

// The libraries' errors end the run by their kind: a rejected state entry is the user's input,
// though it is also a std::invalid_argument, which would otherwise read as a bug.
TEST(ErrorReport, TheLibrariesErrorsEndTheRunWithTheExitCodeOfTheirKind) {
  const auto report = [](auto&& exception) { return report_error(std::make_exception_ptr(exception)); };
  const struct {
    ErrorReport got;
    ExitCode code;
  } cases[] = {
      {report(sp::ErrorAs<std::invalid_argument>(ErrorKind::bad_input, "restore_state: 'blocks.0': shape [3]")),
       ExitCode::bad_input},
      {report(sp::input_files::FileReadError("data.bin: no such file")), ExitCode::bad_input},
      {report(sp::host::PluginError("cannot load policy plugin x.so")), ExitCode::plugin},
      {report(sp::ErrorAs<std::runtime_error>(ErrorKind::collective, "allreduce: rank 1 left")), ExitCode::distributed},
      {report(sp::ErrorAs<std::runtime_error>(ErrorKind::device, "CUDA error in cudaMalloc")), ExitCode::device},
  };
  for (const auto& [got, code] : cases) {
    EXPECT_EQ(got.exit_code, code) << got.message;
    EXPECT_EQ(got.message.find("internal error"), std::string::npos) << got.message;
  }
  const ErrorReport bug = report(sp::ErrorAs<std::logic_error>(ErrorKind::internal, "slot 3 released twice"));
  EXPECT_EQ(bug.exit_code, ExitCode::internal);
  EXPECT_EQ(bug.message.rfind(kBugReportPrefix, 0), 0u) << bug.message;
}

}  // namespace
}  // namespace sp::train
