// Helpers shared by the sp-train tests: scratch directories, a small deterministic corpus and
// a tiny training config whose policy decides within a few steps.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <fmt/format.h>

namespace sp::train::testing {

// A fresh private directory (mode 0700, so the plugin trust check accepts plugins in it).
inline std::filesystem::path make_scratch_dir(const std::string& tag) {
  std::string pattern = (std::filesystem::temp_directory_path() / ("sp-train-" + tag + "-XXXXXX")).string();
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
  return pattern;
}

inline void write_text(const std::filesystem::path& file, const std::string& text) {
  std::ofstream out(file, std::ios::binary);
  out << text;
}

inline std::string read_text(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// About 40 kB of English-like text with a learnable structure.
inline std::filesystem::path write_corpus(const std::filesystem::path& dir) {
  const char* subjects[] = {"the licensee", "the author", "a contributor", "the program", "this license"};
  const char* verbs[] = {"may copy", "shall distribute", "must not modify", "can share", "will publish"};
  const char* objects[] = {"the work", "any copy", "the source code", "such software", "a derivative"};
  std::string text;
  unsigned state = 7;
  for (int i = 0; i < 1400; ++i) {
    state = state * 1103515245u + 12345u;
    text += fmt::format("{} {} {}. ", subjects[(state >> 8) % 5], verbs[(state >> 12) % 5], objects[(state >> 16) % 5]);
    if (i % 7 == 6) text += "\n";
  }
  const std::filesystem::path file = dir / "corpus.txt";
  write_text(file, text);
  return file;
}

// A tiny model and a policy with short windows, so that it decides from step 2 on; the
// error score is made small so the decisions follow the gradients.
inline std::string tiny_config(const std::filesystem::path& corpus, const std::filesystem::path& cache_dir) {
  return fmt::format(R"(model: {{d_model: 32, n_heads: 2, n_blocks: 4, seq_len: 32, mlp_ratio: 2}}
data: {{path: "{}", val_fraction: 0.1, chunk_bytes: 1024}}
train:
  steps: 24
  batch_size: 8
  lr: 1.0e-2
  lr_warmup_steps: 2
  eval_interval: 8
  eval_batches: 2
  checkpoint_interval: 0
  seed: 7
  threads: 1
  calibration_cache_dir: "{}"
memory:
  stagehand:
    streaming: {{prefetch_window: 2, int8_group_size: 32}}
    selective_precision:
      mode: dynamic
      warmup_steps: 2
      update_interval_steps: 2
      history_window: 2
      min_steps_between_switches: 4
      int8_threshold: 0.5
      bf16_threshold: 0.7
      hysteresis_margin: 0.05
      quant_error_threshold: 1.0
      calibration_samples: 2
      log_decisions: false
)",
                     corpus.string(), cache_dir.string());
}

}  // namespace sp::train::testing
