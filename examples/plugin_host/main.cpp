// Drives the installed Selective Precision policy plugin for a few steps on made-up gradient
// moments: a host without LibTorch or CUDA. Usage: plugin_host [plugin.so]
#include <cstdio>
#include <vector>

#include "sp/host/policy_host.h"

int main(int argc, char** argv) {
  const char* plugin = argc > 1 ? argv[1] : SP_PLUGIN_DIR "/libsp_selective_precision.so";
  std::vector<sp::host::BlockDescription> blocks(4);
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    blocks[b].id = b;
    blocks[b].num_params = 1 << 20;
    blocks[b].bytes[sp::Precision::bf16] = 2u << 20;
    blocks[b].bytes[sp::Precision::int8] = 1u << 20;
    blocks[b].name = "block" + std::to_string(b);
  }
  const sp::host::PolicyConfig config{
      "selective_precision:\n  mode: static\n  force_int8_blocks: [1, 2]\n"
      "  telemetry_enabled: false\n",
      "plugin_host example"};
  try {
    sp::host::PolicyHost host(plugin, config, blocks);
    for (std::int64_t step = 0; step < 3; ++step) {
      std::vector<sp_grad_moments_v1> moments(blocks.size());
      for (std::uint32_t b = 0; b < moments.size(); ++b) {
        moments[b].block_id = b;
        moments[b].count = 1000;
        moments[b].sum_sq = 1.0 + b;
      }
      host.begin_step(step);
      host.post_backward(step, moments);
      std::printf("step %lld:", static_cast<long long>(step));
      for (const sp_hint_v1& hint : host.compute_hints(step)) std::printf(" %d", static_cast<int>(hint.precision));
      std::printf("\n");
      host.end_step(step, nullptr);
    }
    std::printf("plugin %s %s\n", std::string(host.plugin_name()).c_str(), std::string(host.plugin_version()).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "plugin_host: %s\n", e.what());
    return 1;
  }
  return 0;
}
