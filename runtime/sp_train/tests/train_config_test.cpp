#include <gtest/gtest.h>

#include <filesystem>

#include <yaml-cpp/yaml.h>

#include "train_config.h"

namespace sp::train {
namespace {

std::string error_of(const std::string& yaml, std::vector<Override> overrides = {}) {
  try {
    parse_train_config(yaml, "cfg.yaml", overrides);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "<accepted>";
}

TEST(TrainConfig, ShippedConfigsParse) {
  for (const char* name : {"default.yaml", "lora.yaml"}) {
    const TrainConfig c = load_train_config(std::filesystem::path(SP_CONFIGS_DIR) / name);
    EXPECT_EQ(c.model.d_model % c.model.n_heads, 0u) << name;
    EXPECT_NE(c.resolved_yaml.find("selective_precision"), std::string::npos) << name;
  }
}

TEST(TrainConfig, DefaultsApplyToAnEmptyDocument) {
  const TrainConfig c = parse_train_config("", "empty.yaml");
  EXPECT_EQ(c.model.n_blocks, 6u);
  EXPECT_EQ(c.train.mode, TrainMode::full);
  EXPECT_EQ(c.train.device, ComputeDevice::cpu);
  EXPECT_EQ(c.train.compute_dtype, ComputeDtype::fp32);
  EXPECT_TRUE(c.policy_keys.run_calibration);
}

TEST(TrainConfig, OverridesEditTheDocumentAndReachThePlugin) {
  const TrainConfig c = parse_train_config(
      "train: {steps: 5}\n", "cfg.yaml",
      {parse_override("train.steps=9"), parse_override("memory.stagehand.selective_precision.mode=off"),
       parse_override("memory.stagehand.selective_precision.calibration_samples=2")});
  EXPECT_EQ(c.train.steps, 9);
  EXPECT_EQ(c.policy_keys.calibration_samples, 2u);
  EXPECT_NE(c.resolved_yaml.find("mode: off"), std::string::npos) << c.resolved_yaml;
}

TEST(TrainConfig, EachBadValueNamesItsKeyAndExpectation) {
  EXPECT_EQ(error_of("model: {d_modle: 3}"),
            "cfg.yaml: model.d_modle: unknown key; did you mean 'd_model'? model accepts: d_model, n_heads, n_blocks, "
            "seq_len, mlp_ratio, init_std, outliers, streaming_unit");
  EXPECT_EQ(error_of("model: {width: 3}"),
            "cfg.yaml: model.width: unknown key; model accepts: d_model, n_heads, n_blocks, seq_len, mlp_ratio, "
            "init_std, outliers, streaming_unit");
  EXPECT_EQ(error_of("model: {d_model: -4}"), "cfg.yaml: model.d_model: expected an integer in [8, 65536], found '-4'");
  EXPECT_EQ(error_of("model: {d_model: 130, n_heads: 4}"),
            "cfg.yaml: model.n_heads: expected a divisor of model.d_model (130), found '4'");
  EXPECT_EQ(error_of("train: {mode: partial}"), "cfg.yaml: train.mode: expected one of full, lora, found 'partial'");
  EXPECT_EQ(error_of("model: {streaming_unit: layer}"),
            "cfg.yaml: model.streaming_unit: expected one of block, sublayer, found 'layer'");
  EXPECT_EQ(error_of("train: {recalibrate_every: -1}"),
            "cfg.yaml: train.recalibrate_every: expected an integer in [0, 4294967295], found '-1'");
  EXPECT_EQ(error_of("train: {lr: \"fast\"}"),
            "cfg.yaml: train.lr: expected a number in (0, 10], found the string \"fast\"");
  EXPECT_EQ(error_of("train: {compute_dtype: bf16}"),
            "cfg.yaml: train.compute_dtype: expected fp32 with train.device cpu (bf16 compute needs train.device: "
            "cuda), found 'bf16'");
  EXPECT_EQ(error_of("train: {device: gpu}"), "cfg.yaml: train.device: expected one of cpu, cuda, found 'gpu'");
  EXPECT_EQ(error_of("train: {lora: {rank: 0}}"),
            "cfg.yaml: train.lora.rank: expected an integer in [1, 4096], found '0'");
  EXPECT_EQ(error_of("data: {val_fraction: 0.9}"),
            "cfg.yaml: data.val_fraction: expected a number in (0, 0.5], found '0.9'");
  EXPECT_EQ(error_of("memory: {stagehand: {streaming: {int8_group_size: 48}}}"),
            "cfg.yaml: memory.stagehand.streaming.int8_group_size: expected 0 (one scale per row), 32, 64, 128 or 256, "
            "found '48'");
  EXPECT_EQ(error_of("memory: {stagehand: {selective_precision: {calibration_samples: 0}}}"),
            "cfg.yaml: memory.stagehand.selective_precision.calibration_samples: expected an integer in [1, 4096], "
            "found '0'");
  EXPECT_EQ(error_of("memory: {stagehand: {selective_precision: 3}}"),
            "cfg.yaml: memory.stagehand.selective_precision: expected a mapping, found '3'");
  EXPECT_EQ(
      error_of("trian: {}"),
      "cfg.yaml: trian: unknown top-level key; did you mean 'train'? expected one of: model, data, train, memory");
  EXPECT_EQ(error_of("- a\n- b\n"), "cfg.yaml: expected a mapping at the top level, found a list");
  EXPECT_NE(error_of("model: [unclosed").find("cfg.yaml: not valid YAML"), std::string::npos);
}

TEST(TrainConfig, OutlierBlocksAreDistinctIdsOfTheModel) {
  const TrainConfig c =
      parse_train_config("model: {n_blocks: 4, outliers: {blocks: [3, 1], magnitude: 32}}", "cfg.yaml");
  EXPECT_EQ(c.model.outlier_blocks, (std::vector<std::uint32_t>{3, 1}));
  EXPECT_EQ(c.model.outlier_magnitude, 32.0);
  EXPECT_TRUE(parse_train_config("", "cfg.yaml").model.outlier_blocks.empty());
  const std::string expected =
      "cfg.yaml: model.outliers.blocks: expected a list of distinct block ids in [0, 4) (model.n_blocks), found ";
  EXPECT_EQ(error_of("model: {n_blocks: 4, outliers: {blocks: [4]}}"), expected + "'4'");
  EXPECT_EQ(error_of("model: {n_blocks: 4, outliers: {blocks: [1, -1]}}"), expected + "'-1'");
  EXPECT_EQ(error_of("model: {n_blocks: 4, outliers: {blocks: [\"2\"]}}"), expected + "the string \"2\"");
  EXPECT_EQ(error_of("model: {n_blocks: 4, outliers: {blocks: 2}}"), expected + "'2'");
  EXPECT_EQ(error_of("model: {n_blocks: 4, outliers: {blocks: [2, 2]}}"),
            "cfg.yaml: model.outliers.blocks: expected a list of distinct block ids in [0, 4) (model.n_blocks); 2 is "
            "listed twice, found a list");
  EXPECT_EQ(error_of("model: {outliers: {magnitude: 0.5}}"),
            "cfg.yaml: model.outliers.magnitude: expected a number in [1, 10000], found '0.5'");
  EXPECT_EQ(
      error_of("model: {outliers: {block: [1]}}"),
      "cfg.yaml: model.outliers.block: unknown key; did you mean 'blocks'? model.outliers accepts: blocks, magnitude, "
      "channels");
  EXPECT_EQ(parse_train_config("model: {outliers: {channels: 2}}", "cfg.yaml").model.outlier_channels, 2u);
  EXPECT_EQ(parse_train_config("", "cfg.yaml").model.outlier_channels, 1u);
  EXPECT_EQ(error_of("model: {d_model: 64, n_heads: 4, outliers: {channels: 65}}"),
            "cfg.yaml: model.outliers.channels: expected an integer in [1, 64], found '65'");
  EXPECT_EQ(error_of("", {parse_override("model.outliers.blocks=[9]")}),
            "--set model.outliers.blocks=[9]: model.outliers.blocks: expected a list of distinct block ids in [0, 6) "
            "(model.n_blocks), found '9'");
}

TEST(TrainConfig, Bf16ComputeIsAcceptedOnTheGpu) {
  const TrainConfig c = parse_train_config("train: {device: cuda, compute_dtype: bf16}", "cfg.yaml");
  EXPECT_EQ(c.train.device, ComputeDevice::cuda);
  EXPECT_EQ(c.train.compute_dtype, ComputeDtype::bf16);
}

TEST(TrainConfig, BadOverridesAreNamed) {
  EXPECT_THROW(parse_override("train.steps"), ConfigError);
  EXPECT_EQ(
      error_of("", {parse_override("train.steps=[1")}).rfind("--set train.steps=[1: the value is not valid YAML", 0),
      0u);
  EXPECT_EQ(error_of("train: {steps: 3}", {parse_override("train.steps.x=1")}),
            "--set train.steps.x=1: cfg.yaml: train.steps is '3', not a mapping");
  EXPECT_EQ(error_of("", {parse_override("train..steps=1")}), "--set train..steps=1: empty key in the key path");
  EXPECT_EQ(error_of("", {parse_override("model.=5")}), "--set model.=5: empty key in the key path");
  // A misspelled section that only the override brought in is the override's too.
  EXPECT_EQ(error_of("train: {steps: 3}", {parse_override("trian.steps=3")})
                .rfind("--set trian.steps=3: trian: unknown top-level key", 0),
            0u);
  EXPECT_EQ(error_of("train: {steps: 3}\ntrain: {lr: 0.1}\n", {parse_override("train.steps=3")}),
            "cfg.yaml: train: duplicate key (lines 1 and 2); keep one");
  // A value that came from the command line is blamed on the flag, not on the file.
  EXPECT_EQ(error_of("", {parse_override("train.steps=0")}),
            "--set train.steps=0: train.steps: expected an integer in [1, 1099511627776], found '0'");
  EXPECT_EQ(error_of("", {Override{"train.steps", "0", "--steps"}}),
            "--steps: train.steps: expected an integer in [1, 1099511627776], found '0'");
  EXPECT_EQ(error_of("", {parse_override("train.stpes=3")}).rfind("--set train.stpes=3: train.stpes: unknown key", 0),
            0u);
  EXPECT_EQ(error_of("", {parse_override("train.lora={rank: 0}")}),
            "--set train.lora={rank: 0}: train.lora.rank: expected an integer in [1, 4096], found '0'");
  // Keys the override did not touch are still the file's.
  EXPECT_EQ(error_of("train: {lr: -1}", {parse_override("train.steps=3")}),
            "cfg.yaml: train.lr: expected a number in (0, 10], found '-1'");
}

TEST(TrainConfig, AnEmulatedLinkSlowerThanOneMegabytePerSecondIsRefused) {
  EXPECT_EQ(error_of("memory: {stagehand: {streaming: {bandwidth_cap_gbps: 1.0e-9}}}"),
            "cfg.yaml: memory.stagehand.streaming.bandwidth_cap_gbps: expected 0 (no cap) or a number in [0.001, "
            "1e6], found '1.0e-9'");
  EXPECT_EQ(parse_train_config("memory: {stagehand: {streaming: {bandwidth_cap_gbps: 0.005}}}", "cfg.yaml")
                .streaming.bandwidth_cap_gbps,
            0.005);
}

// The run cuts its logs back when it starts: a log name must not reach any other file.
TEST(TrainConfig, LogsArePlainFileNamesOfTheirOwn) {
  const std::string metrics = "memory.stagehand.streaming.metrics_file=";
  const std::string telemetry = "memory.stagehand.selective_precision.telemetry_file=";
  for (const std::string& bad : {metrics + "config.yaml", metrics + "../notes.txt", metrics + "/etc/passwd",
                                 metrics + "..", metrics + "checkpoint.bin", telemetry + "summary.json",
                                 telemetry + "train_metrics.jsonl", metrics + "selective_precision_telemetry.jsonl"}) {
    EXPECT_NE(error_of("", {parse_override(bad)}).find("expected a plain file name inside the run directory"),
              std::string::npos)
        << bad;
  }
  // Telemetry off: its file name is not the run's concern, and is never cut.
  EXPECT_NO_THROW(parse_train_config("", "cfg.yaml",
                                     {parse_override("memory.stagehand.selective_precision.telemetry_enabled=false"),
                                      parse_override(telemetry + "/tmp/elsewhere.jsonl")}));
  EXPECT_EQ(parse_train_config("", "cfg.yaml", {parse_override(metrics + "transfer.jsonl")}).streaming.metrics_file,
            "transfer.jsonl");
}

TEST(TrainConfig, ALiteralOverrideIsNotReadAsYaml) {
  const TrainConfig c =
      parse_train_config("", "cfg.yaml", {Override{"data.path", "corpus #2: a*b.txt", "--data", /*literal=*/true}});
  EXPECT_EQ(c.data.path, "corpus #2: a*b.txt");
}

// Found by fuzzing (docs/fuzzing.md): yaml-cpp's LoadAll never returned on a stray ',' before
// the first node (empty documents forever, until memory ran out); a NUL after a number read as
// the number, while the resolved config wrote it back quoted, as a string; a d_model that the
// default n_heads does not divide escaped as YAML::InvalidNode.
TEST(TrainConfig, MalformedBytesAreConfigErrors) {
  EXPECT_EQ(error_of(",a: 1\n"), "cfg.yaml: not valid YAML: line 1, column 1: no node can start here");
  EXPECT_EQ(error_of("train:\n  steps: 3\n---\n,b\n"),
            "cfg.yaml: not valid YAML: line 4, column 1: no node can start here");
  EXPECT_EQ(error_of(std::string("train:\n  threads: 1   \0   # cores\n", 34)),
            "cfg.yaml: train.threads: expected an integer in [0, 1024], found '1     '");
  // A d_model that the default n_heads does not divide: describing the absent key threw
  // YAML::InvalidNode (an internal error, exit code 1) instead of a ConfigError.
  EXPECT_EQ(error_of("model:\n  d_model: 63\n"),
            "cfg.yaml: model.n_heads: expected a divisor of model.d_model (63), found the default 4");
  EXPECT_EQ(error_of("", {parse_override("model.d_model=66")}),
            "cfg.yaml: model.n_heads: expected a divisor of model.d_model (66), found the default 4");
}

// yaml-cpp kept "10\r\r" of "interval: 10\r\r\r\n" as the scalar and wrote it back unquoted, so
// the run's config.yaml read back as "10\r" (the fuzzer's finding): such returns are refused,
// by line and column in the text, by key wherever a scalar holds one; CRLF line ends stay fine.
TEST(TrainConfig, ACarriageReturnThatEndsNoLineIsRefused) {
  EXPECT_EQ(error_of("train:\n  steps: 10\r\r\n"),
            "cfg.yaml: line 2, column 12: a carriage return that ends no line (expected \\n or \\r\\n line ends)");
  EXPECT_EQ(error_of("train: {steps: 3}\r"),
            "cfg.yaml: line 1, column 18: a carriage return that ends no line (expected \\n or \\r\\n line ends)");
  EXPECT_EQ(parse_train_config("train:\r\n  steps: 7\r\n", "cfg.yaml").train.steps, 7);
  Override literal = parse_override("train.init_checkpoint=a.bin\r");
  literal.literal = true;
  EXPECT_EQ(error_of("", {literal}),
            "--set train.init_checkpoint=a.bin\r: train.init_checkpoint: holds a carriage return, which the run's "
            "config.yaml could not keep; expected none");
  // Reached by an escape, or by yaml-cpp's reading of a NUL byte before an 'r' (the fuzzer's
  // second input), in a key or a value, also under an alias.
  EXPECT_EQ(error_of("memory: {stagehand: {selective_precision: {note: \"a\\r\"}}}"),
            "cfg.yaml: memory.stagehand.selective_precision.note: holds a carriage return, which the run's config.yaml "
            "could not keep; expected none");
  EXPECT_EQ(error_of(std::string("memory:\n  stagehand:\n    selective_precision:\n      w\0rmup_steps: 10\n", 69)),
            "cfg.yaml: memory.stagehand.selective_precision.w\rmup_steps: holds a carriage return, which the run's "
            "config.yaml could not keep; expected none");
  // A key the emitter would write as an implicit key over YAML's 1024 characters (the fuzzer's
  // third input), or with control characters.
  EXPECT_EQ(error_of("memory: {stagehand: {selective_precision: {" + std::string(300, 'k') + ": 1}}}"),
            "cfg.yaml: memory.stagehand.selective_precision." + std::string(40, 'k') +
                "...: a key of 300 bytes; expected a name of at most 256 bytes without control characters");
  EXPECT_EQ(error_of("memory: {stagehand: {selective_precision: {\"a\\x04b\": 1}}}"),
            "cfg.yaml: memory.stagehand.selective_precision.a\x04" "b: a key of 3 bytes with control characters; expected "
            "a name of at most 256 bytes without control characters");
  // Bytes that are not UTF-8 (the fuzzer's fourth input: read back, each became U+FFFD and its
  // key grew past 256 bytes), in a key or a value; well-formed UTF-8 is kept.
  EXPECT_EQ(error_of("memory: {stagehand: {selective_precision: {\"a\xf5" "b\": 1}}}"),
            "cfg.yaml: memory.stagehand.selective_precision.a\xf5" "b: holds bytes that are not UTF-8, which the run's "
            "config.yaml could not keep");
  for (const char* bad : {"\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe2\x82", "\x80"}) {
    EXPECT_NE(error_of(std::string("memory: {stagehand: {selective_precision: {note: \"") + bad + "\"}}}")
                  .find("not UTF-8"),
              std::string::npos)
        << bad;
  }
  EXPECT_EQ(error_of("memory: {stagehand: {selective_precision: {note: \"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"}}}"),
            "<accepted>");
  EXPECT_EQ(error_of("memory: &m {stagehand: {selective_precision: {a: *m, b: \"\\r\"}}}"),
            "cfg.yaml: memory.stagehand.selective_precision.b: holds a carriage return, which the run's config.yaml "
            "could not keep; expected none");
}

TEST(TrainConfig, ASecondYamlDocumentAndAPluginPathAreRefused) {
  EXPECT_EQ(error_of("train: {steps: 3}\n---\ntrain: {lr: 99}\n"),
            "cfg.yaml: holds 2 YAML documents (separated by ---); expected one");
  EXPECT_EQ(error_of("train: {plugin: ../evil}"),
            "cfg.yaml: train.plugin: expected a plugin name (lib<name>.so is looked up in --plugin-dir), not a path, "
            "found '../evil'");
  // --seed arrives as text, so a value beyond int64 is refused instead of saturated.
  EXPECT_EQ(error_of("", {Override{"train.seed", "99999999999999999999999", "--seed"}}),
            "--seed: train.seed: expected an integer in [0, 9223372036854775807], found '99999999999999999999999'");
}

// Every key is optional, the policy section too: the plugin gets an empty one and its defaults.
TEST(TrainConfig, AConfigWithoutAPolicySectionGivesThePluginAnEmptyOne) {
  for (const char* text : {"", "memory: ~", "memory: {stagehand: {selective_precision: ~}}"}) {
    const YAML::Node resolved = YAML::Load(parse_train_config(text, "cfg.yaml").resolved_yaml);
    EXPECT_TRUE(resolved["memory"]["stagehand"]["selective_precision"].IsMap()) << text;
  }
}

// Found by the smoke fuzzer: the empty section added for the plugin grew inside the node that
// another section aliases, whose config.yaml then named an unknown key. Each is accepted, and
// its config.yaml reads back as the same config.
TEST(TrainConfig, TheAddedPolicySectionLeavesAnAliasedSectionAsItWas) {
  for (const char* text : {"memory: &m\n\ntrain:\n*m\n", "memory: &m {}\ntrain: *m\n",
                           "memory: {stagehand: &s}\ntrain: *s\n", "memory: {stagehand: &s {}}\ntrain: *s\n",
                           "memory: {stagehand: {streaming: &s {}}}\nmodel: {}\ntrain: *s\n"}) {
    const TrainConfig first = parse_train_config(text, "cfg.yaml");
    const YAML::Node resolved = YAML::Load(first.resolved_yaml);
    EXPECT_TRUE(resolved["memory"]["stagehand"]["selective_precision"].IsMap()) << text;
    EXPECT_FALSE(resolved["train"].IsMap() && resolved["train"]["stagehand"].IsDefined()) << first.resolved_yaml;
    // It reads back; the emitter may lay out the empty section otherwise once, then no more.
    const TrainConfig second = parse_train_config(first.resolved_yaml, "config.yaml");
    EXPECT_EQ(parse_train_config(second.resolved_yaml, "config.yaml").resolved_yaml, second.resolved_yaml) << text;
  }
}

TEST(TrainConfig, DuplicateKeysAreRefusedWithBothLines) {
  EXPECT_EQ(error_of("train:\n  steps: 3\n  lr: 0.1\n  steps: 4\n"),
            "cfg.yaml: train.steps: duplicate key (lines 2 and 4); keep one");
  EXPECT_EQ(error_of("model: {}\nmodel: {}\n"), "cfg.yaml: model: duplicate key (lines 1 and 2); keep one");
}

TEST(TrainConfig, MissingFileIsNamed) {
  try {
    load_train_config("/nonexistent/sp-train.yaml");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "/nonexistent/sp-train.yaml: cannot open the config file: No such file or directory");
  }
}

}  // namespace
}  // namespace sp::train
