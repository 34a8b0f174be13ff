// The C boundary of the Selective Precision policy plugin: the ABI v1 function table.
// Every exported body runs inside guarded(), so no exception crosses into the host and
// every failure leaves a message for last_error().
#include "sp/policy/budget.h"
#include "sp/policy/config.h"
#include "sp/policy/engine.h"
#include "sp/policy/errors.h"

#include <sp/plugin_abi_v1.h>

#include <fmt/format.h>

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>

#ifndef SP_POLICY_PLUGIN_VERSION
#if SP_POLICY_EDITION >= 3
#define SP_POLICY_PLUGIN_VERSION "4.0.0"
#elif SP_POLICY_EDITION >= 2
#define SP_POLICY_PLUGIN_VERSION "2.0.0"
#else
#define SP_POLICY_PLUGIN_VERSION "1.0.0"
#endif
#endif

namespace {

using sp::policy::PolicyEngine;
using sp::policy::PolicyError;

class HostLogSink final : public sp::policy::LogSink {
 public:
  HostLogSink(sp_log_fn fn, void *user_data, sp_log_level min_level)
      : fn_(fn), user_data_(user_data), min_level_(min_level) {}
  bool wants(sp_log_level level) const override { return fn_ != nullptr && level >= min_level_; }
  void write(sp_log_level level, std::string_view message) noexcept override {
    if (!wants(level)) return;
    try {
      fn_(user_data_, level, std::string(message).c_str());
    } catch (...) {
      // The host's sink must not throw; if it does, the message is lost rather than the process.
    }
  }

 private:
  sp_log_fn fn_;
  void *user_data_;
  sp_log_level min_level_;
};

}  // namespace

struct sp_policy_ctx {
  sp_policy_ctx(const sp_host_api_v1 &host, sp::policy::PolicySettings config,
                std::vector<sp::policy::BlockBytes> block_bytes)
      : log(host.log, host.log_user_data, host.min_log_level),
        engine(std::move(config), std::move(block_bytes), &log, host.output_dir ? host.output_dir : "") {}

  HostLogSink log;  // declared before the engine, which logs until it is destroyed
  PolicyEngine engine;
  std::string last_error;
};

namespace {

// create() has no context to hold its error; a fixed buffer needs no destructor at unload.
char g_create_error[1024] = "no error";

void set_create_error(const char *message) {
  std::strncpy(g_create_error, message, sizeof g_create_error - 1);
  g_create_error[sizeof g_create_error - 1] = '\0';
}

template <typename Body>
sp_status guarded(std::string *error_out, Body &&body) noexcept {
  const auto fail = [error_out](sp_status status, const char *message) {
    if (error_out == nullptr) {
      set_create_error(message);
      return status;
    }
    try {
      *error_out = message;
    } catch (...) {
      // Out of memory while recording the message: the status still tells the host.
    }
    return status;
  };
  try {
    body();
    return SP_OK;
  } catch (const PolicyError &error) {
    return fail(error.status(), error.what());
  } catch (const std::bad_alloc &) {
    return fail(SP_ERR_INTERNAL, "out of memory");
  } catch (const std::exception &error) {
    return fail(SP_ERR_INTERNAL, error.what());
  } catch (...) {
    return fail(SP_ERR_INTERNAL, "unknown internal error");
  }
}

// Every hook but create and destroy goes through here. A null context has no error slot
// of its own, so its message lands where create's does.
template <typename Body>
sp_status on_context(sp_policy_ctx *ctx, const char *hook, Body &&body) noexcept {
  if (ctx == nullptr) {
    std::snprintf(g_create_error, sizeof g_create_error, "%s: ctx is null", hook);
    return SP_ERR_INVALID_ARGUMENT;
  }
  return guarded(&ctx->last_error, std::forward<Body>(body));
}

std::vector<sp::policy::BlockBytes> read_block_descs(const sp_block_desc_v1 *blocks, std::uint32_t n_blocks) {
  using sp::policy::InvalidArgument;
  if (n_blocks == 0) throw InvalidArgument("create: n_blocks is 0; the policy needs at least one block");
  if (blocks == nullptr) throw InvalidArgument(fmt::format("create: blocks is null but n_blocks = {}", n_blocks));
  // A host built against a later minor has larger descs; its struct_size is the stride.
  const std::uint32_t stride = blocks[0].struct_size;
  if (stride < sizeof(sp_block_desc_v1)) {
    throw InvalidArgument(fmt::format("create: blocks[0].struct_size is {}, smaller than the {} bytes of ABI v1.0",
                                      stride, sizeof(sp_block_desc_v1)));
  }
  std::vector<sp::policy::BlockBytes> bytes(n_blocks);
  const auto *base = reinterpret_cast<const unsigned char *>(blocks);
  for (std::uint32_t i = 0; i < n_blocks; ++i) {
    const auto &desc = *reinterpret_cast<const sp_block_desc_v1 *>(base + static_cast<std::size_t>(i) * stride);
    if (desc.struct_size != stride) {
      throw InvalidArgument(
          fmt::format("create: blocks[{}].struct_size is {}, blocks[0] says {}", i, desc.struct_size, stride));
    }
    if (desc.block_id != i) {
      throw InvalidArgument(
          fmt::format("create: blocks[{}].block_id is {}; descs must arrive sorted by id from 0", i, desc.block_id));
    }
    bytes[i][SP_PRECISION_BF16] = desc.bf16_bytes;
    bytes[i][SP_PRECISION_INT8] = desc.int8_bytes;
  }
  return bytes;
}

sp_status sp_create(const sp_host_api_v1 *host, const char *config_yaml, const sp_block_desc_v1 *blocks,
                    uint32_t n_blocks, sp_policy_ctx **out_ctx) {
  if (out_ctx == nullptr) {
    set_create_error("create: out_ctx is null");
    return SP_ERR_INVALID_ARGUMENT;
  }
  *out_ctx = nullptr;
  return guarded(nullptr, [&] {
    using sp::policy::InvalidArgument;
    if (host == nullptr) throw InvalidArgument("create: host is null");
    if (host->struct_size < SP_HOST_API_V1_0_SIZE) {
      throw InvalidArgument(fmt::format("create: host struct_size is {}, smaller than the {} bytes of ABI v1.0",
                                        host->struct_size, SP_HOST_API_V1_0_SIZE));
    }
    if (host->abi_major != SP_PLUGIN_ABI_MAJOR) {
      throw InvalidArgument(fmt::format("create: the host speaks ABI {}.{}, this plugin ABI {}.{}", host->abi_major,
                                        host->abi_minor, SP_PLUGIN_ABI_MAJOR, SP_PLUGIN_ABI_MINOR));
    }
    if (config_yaml == nullptr) throw InvalidArgument("create: config_yaml is null");
    std::vector<sp::policy::BlockBytes> block_bytes = read_block_descs(blocks, n_blocks);
    sp::policy::ParsedConfig parsed = sp::policy::parse_policy_config(config_yaml, n_blocks);
    // A 1.0 host (or a 1.1 host's struct without the field) transfers BF16 and INT8 only.
    sp_precision_mask supported = SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8);
#if SP_PLUGIN_ABI_TARGET_MINOR >= 1
    if (host->struct_size >= offsetof(sp_host_api_v1, supported_precisions) + sizeof(host->supported_precisions)) {
      supported = host->supported_precisions | SP_PRECISION_BIT(SP_PRECISION_BF16);
    }
#endif
    sp::policy::check_host_precisions(parsed, supported);
    sp::policy::check_budget_feasible(parsed, block_bytes);
    auto ctx = std::make_unique<sp_policy_ctx>(*host, std::move(parsed.config), std::move(block_bytes));
    for (const std::string &warning : parsed.warnings) ctx->log.write(SP_LOG_WARN, warning);
    const sp::policy::PolicySettings &config = ctx->engine.config();
    if (ctx->log.wants(SP_LOG_INFO)) {
      ctx->log.write(
          SP_LOG_INFO,
          fmt::format("policy v{} created from '{}': mode {}, {} blocks, thresholds int8 < {} / bf16 >= {}",
                      SP_POLICY_PLUGIN_VERSION, parsed.section_path, sp::policy::mode_name(config.effective_mode()),
                      n_blocks, config.int8_threshold, config.bf16_threshold));
    }
    *out_ctx = ctx.release();
  });
}

sp_status sp_destroy(sp_policy_ctx *ctx) {
  delete ctx;
  return SP_OK;
}

sp_status sp_begin_step(sp_policy_ctx *ctx, int64_t step) {
  return on_context(ctx, "begin_step", [&] { ctx->engine.begin_step(step); });
}

sp_status sp_post_backward(sp_policy_ctx *ctx, int64_t step, const sp_grad_moments_v1 *moments, uint32_t n) {
  return on_context(ctx, "post_backward", [&] { ctx->engine.post_backward(step, moments, n); });
}

sp_status sp_compute_hints(sp_policy_ctx *ctx, int64_t step, sp_hint_v1 *hints_out, uint32_t n) {
  return on_context(ctx, "compute_hints", [&] { ctx->engine.compute_hints(step, hints_out, n); });
}

sp_status sp_end_step(sp_policy_ctx *ctx, int64_t step, const sp_step_feedback_v1 *feedback) {
  return on_context(ctx, "end_step", [&] { ctx->engine.end_step(step, feedback); });
}

sp_status sp_set_calibration_errors(sp_policy_ctx *ctx, const uint32_t *block_ids, const double *errors, uint32_t n) {
  return on_context(ctx, "set_calibration_errors", [&] { ctx->engine.set_calibration_errors(block_ids, errors, n); });
}

sp_status sp_export_state(sp_policy_ctx *ctx, uint8_t *buffer, uint64_t capacity, uint64_t *size_out) {
  return on_context(ctx, "export_state", [&] {
    if (size_out == nullptr) throw sp::policy::InvalidArgument("export_state: size_out is null");
    const std::vector<std::uint8_t> blob = ctx->engine.export_state();
    *size_out = blob.size();
    if (blob.size() > capacity) {
      throw PolicyError(SP_ERR_BUFFER_TOO_SMALL, sp::ErrorKind::bad_input,
                        fmt::format("export_state: the blob needs {} bytes, the buffer holds {}", blob.size(), capacity));
    }
    if (buffer == nullptr) throw sp::policy::InvalidArgument("export_state: buffer is null but capacity > 0");
    std::memcpy(buffer, blob.data(), blob.size());
  });
}

sp_status sp_import_state(sp_policy_ctx *ctx, const uint8_t *blob, uint64_t size) {
  return on_context(ctx, "import_state", [&] {
    if (blob == nullptr && size > 0) throw sp::policy::StateError("import_state: blob is null but size > 0");
    ctx->engine.import_state(blob, static_cast<std::size_t>(size));
  });
}

#if SP_PLUGIN_ABI_TARGET_MINOR >= 1
sp_status sp_set_transfer_bytes(sp_policy_ctx *ctx, sp_precision precision, const uint64_t *bytes, uint32_t n) {
  return on_context(ctx, "set_transfer_bytes", [&] { ctx->engine.set_transfer_bytes(precision, bytes, n); });
}

sp_status sp_set_precision_calibration_errors(sp_policy_ctx *ctx, sp_precision precision, const uint32_t *block_ids,
                                              const double *errors, uint32_t n) {
  return on_context(ctx, "set_precision_calibration_errors",
                    [&] { ctx->engine.set_precision_calibration_errors(precision, block_ids, errors, n); });
}
#endif

#if SP_PLUGIN_ABI_TARGET_MINOR >= 2
sp_status sp_set_unit_signals(sp_policy_ctx *ctx, int64_t step, const sp_unit_signals_v1 *signals) {
  return on_context(ctx, "set_unit_signals", [&] { ctx->engine.set_unit_signals(step, signals); });
}

sp_status sp_get_unit_costs(sp_policy_ctx *ctx, sp_precision precision, double *costs_out, uint32_t n) {
  return on_context(ctx, "get_unit_costs", [&] { ctx->engine.unit_costs(precision, costs_out, n); });
}

sp_status sp_get_budget_status(sp_policy_ctx *ctx, sp_budget_status_v1 *status_out) {
  return on_context(ctx, "get_budget_status", [&] { ctx->engine.budget_status(status_out); });
}
#endif

#if SP_PLUGIN_ABI_TARGET_MINOR >= 3
sp_status sp_initial_hints(sp_policy_ctx *ctx, sp_hint_v1 *hints_out, uint32_t n) {
  return on_context(ctx, "initial_hints", [&] { ctx->engine.initial_hints(hints_out, n); });
}
#endif

#if SP_PLUGIN_ABI_TARGET_MINOR >= 4
sp_status sp_propose_allocations(sp_policy_ctx *ctx, sp_precision *routes_out, uint32_t n, uint32_t capacity,
                                 uint32_t *count_out) {
  return on_context(ctx, "propose_allocations", [&] {
    if (count_out == nullptr) throw sp::policy::InvalidArgument("propose_allocations: count_out is null");
    const std::vector<std::vector<sp_precision>> &rows = ctx->engine.propose_allocations(n);
    *count_out = static_cast<uint32_t>(rows.size());
    if (rows.size() > capacity) {
      throw PolicyError(SP_ERR_BUFFER_TOO_SMALL, sp::ErrorKind::bad_input,
                        fmt::format("propose_allocations: {} allocations, room for {}", rows.size(), capacity));
    }
    if (!rows.empty() && routes_out == nullptr) {
      throw sp::policy::InvalidArgument("propose_allocations: routes_out is null but capacity > 0");
    }
    for (std::size_t k = 0; k < rows.size(); ++k) {
      std::memcpy(routes_out + k * n, rows[k].data(), n * sizeof(sp_precision));
    }
  });
}

sp_status sp_set_allocation_measurements(sp_policy_ctx *ctx, int64_t step,
                                         const sp_allocation_measurements_v1 *measurements) {
  return on_context(ctx, "set_allocation_measurements",
                    [&] { ctx->engine.set_allocation_measurements(step, measurements); });
}
#endif

const char *sp_last_error(const sp_policy_ctx *ctx) {
  return ctx == nullptr ? g_create_error : ctx->last_error.c_str();
}

constexpr sp_policy_plugin_v1_table kTable = {
    sizeof(sp_policy_plugin_v1_table),
    SP_PLUGIN_ABI_MAJOR,
    SP_PLUGIN_ABI_MINOR,
    0,
    "selective_precision",
    SP_POLICY_PLUGIN_VERSION,
    sp_create,
    sp_destroy,
    sp_begin_step,
    sp_post_backward,
    sp_compute_hints,
    sp_end_step,
    sp_set_calibration_errors,
    sp_export_state,
    sp_import_state,
    sp_last_error,
#if SP_PLUGIN_ABI_TARGET_MINOR >= 1
    sp_set_transfer_bytes,
    sp_set_precision_calibration_errors,
#endif
#if SP_PLUGIN_ABI_TARGET_MINOR >= 2
    sp_set_unit_signals,
    sp_get_unit_costs,
    sp_get_budget_status,
#endif
#if SP_PLUGIN_ABI_TARGET_MINOR >= 3
    sp_initial_hints,
#endif
#if SP_PLUGIN_ABI_TARGET_MINOR >= 4
    sp_propose_allocations,
    sp_set_allocation_measurements,
#endif
};

}  // namespace

extern "C" SP_PLUGIN_EXPORT const sp_policy_plugin_v1_table *sp_policy_plugin_v1(void) { return &kTable; }
