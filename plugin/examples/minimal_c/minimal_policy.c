/*
 * A complete policy plugin in plain C11, meant to be copied. docs/plugin-abi.md walks
 * through it.
 *
 * Policy: a block streams as INT8 while the mean L2 norm of its gradients, over every
 * finite sample seen so far, stays below `int8_max_l2`; otherwise as BF16. Until a block
 * has `min_samples` samples it stays BF16. A non-finite gradient sends the block to BF16
 * at the next compute_hints, whatever its mean.
 *
 * Configuration (a flat subset of YAML: one `key: value` per line, `#` starts a comment
 * line):
 *   int8_max_l2: 1.0   # > 0
 *   min_samples: 1     # integer >= 1
 *
 * ABI version: this plugin implements ABI 1.0 and says so. It predates 1.1 and shows that
 * a 1.0 plugin keeps working, unchanged, under a 1.1 host: it defines
 * SP_PLUGIN_ABI_TARGET_MINOR 0 before the include, so it compiles exactly the 1.0 layouts
 * (a ten-function table of SP_PLUGIN_TABLE_V1_0_SIZE bytes) and reports abi_minor 0. The
 * host then passes it 1.0 struct sizes, never calls a 1.1 function and never lets it name
 * NF4. A plugin that wants NF4 targets 1.1 instead (leave the macro undefined) and fills in
 * set_transfer_bytes and set_precision_calibration_errors (docs/plugin-abi.md).
 * The #ifndef only lets the host's test fixture, which wraps this file, build it as 1.1 too.
 */
#ifndef SP_PLUGIN_ABI_TARGET_MINOR
#define SP_PLUGIN_ABI_TARGET_MINOR 0
#endif
#include <sp/plugin_abi_v1.h>

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PLUGIN_NAME "minimal_c"
#define PLUGIN_VERSION "1.0.0"
#define ERROR_CAPACITY 512

/* State blob layout (native byte order: a blob only travels between plugins loaded in
 * one process). Bump STATE_FORMAT_VERSION whenever the layout changes, and keep
 * accepting the older formats a previous release could have exported. */
#define STATE_MAGIC "SPMC"
#define STATE_FORMAT_VERSION 1u
#define STATE_HEADER_BYTES 16u /* magic[4], format_version u32, n_blocks u32, reserved u32 */
#define STATE_BLOCK_BYTES 24u  /* samples u64, l2_sum f64, unsafe u32, reserved u32 */

typedef struct block_state {
  uint64_t samples; /* finite gradient samples seen */
  double l2_sum;    /* sum of their L2 norms */
  uint32_t unsafe;  /* a non-finite sample arrived since the last compute_hints */
} block_state;

struct sp_policy_ctx {
  double int8_max_l2;
  uint64_t min_samples;
  uint32_t n_blocks;
  block_state *blocks;
  sp_log_fn log;
  void *log_user_data;
  sp_log_level min_log_level;
  char error[ERROR_CAPACITY];
};

/* A plain char array has no destructor, so this thread_local cannot pin the library. */
static _Thread_local char create_error[ERROR_CAPACITY];

static sp_status fail(char *buffer, sp_status status, const char *format, ...) {
  va_list args;
  va_start(args, format);
  vsnprintf(buffer, ERROR_CAPACITY, format, args);
  va_end(args);
  return status;
}

static void log_message(const sp_policy_ctx *ctx, sp_log_level level, const char *format, ...) {
  char message[ERROR_CAPACITY];
  va_list args;
  if (ctx->log == NULL || level < ctx->min_log_level) return;
  va_start(args, format);
  vsnprintf(message, sizeof message, format, args);
  va_end(args);
  ctx->log(ctx->log_user_data, level, message);
}

/* ---- configuration ---------------------------------------------------------------- */

static const char *skip_spaces(const char *text, const char *end) {
  while (text < end && (*text == ' ' || *text == '\t' || *text == '\r')) ++text;
  return text;
}

static const char *trim_end(const char *begin, const char *end) {
  while (end > begin && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\r')) --end;
  return end;
}

/* Parses one `key: value` line into ctx; returns SP_OK or SP_ERR_CONFIG with a message. */
static sp_status parse_config_line(sp_policy_ctx *ctx, unsigned line_number, const char *begin, const char *end) {
  const char *colon = memchr(begin, ':', (size_t)(end - begin));
  char key[64];
  char value[64];
  char *value_end = NULL;
  size_t key_length;
  size_t value_length;
  const char *value_begin;

  if (colon == NULL) {
    return fail(create_error, SP_ERR_CONFIG, "config line %u: expected `key: value`", line_number);
  }
  key_length = (size_t)(trim_end(begin, colon) - begin);
  value_begin = skip_spaces(colon + 1, end);
  value_length = (size_t)(trim_end(value_begin, end) - value_begin);
  if (key_length >= sizeof key || value_length >= sizeof value) {
    return fail(create_error, SP_ERR_CONFIG, "config line %u: key or value too long", line_number);
  }
  memcpy(key, begin, key_length);
  key[key_length] = '\0';
  memcpy(value, value_begin, value_length);
  value[value_length] = '\0';

  errno = 0;
  if (strcmp(key, "int8_max_l2") == 0) {
    const double parsed = strtod(value, &value_end);
    if (value_length == 0 || *value_end != '\0' || errno != 0 || !isfinite(parsed) || parsed <= 0.0) {
      return fail(create_error, SP_ERR_CONFIG, "config line %u: int8_max_l2 is '%s', expected a finite number > 0",
                  line_number, value);
    }
    ctx->int8_max_l2 = parsed;
  } else if (strcmp(key, "min_samples") == 0) {
    const long long parsed = strtoll(value, &value_end, 10);
    if (value_length == 0 || *value_end != '\0' || errno != 0 || parsed < 1) {
      return fail(create_error, SP_ERR_CONFIG, "config line %u: min_samples is '%s', expected an integer >= 1",
                  line_number, value);
    }
    ctx->min_samples = (uint64_t)parsed;
  } else {
    return fail(create_error, SP_ERR_CONFIG, "config line %u: unknown key '%s'; expected int8_max_l2 or min_samples",
                line_number, key);
  }
  return SP_OK;
}

static sp_status parse_config(sp_policy_ctx *ctx, const char *text) {
  unsigned line_number = 0;
  while (*text != '\0') {
    const char *newline = strchr(text, '\n');
    const char *end = newline != NULL ? newline : text + strlen(text);
    const char *begin = skip_spaces(text, end);
    ++line_number;
    if (begin < end && *begin != '#' && trim_end(begin, end) > begin) {
      const sp_status status = parse_config_line(ctx, line_number, begin, trim_end(begin, end));
      if (status != SP_OK) return status;
    }
    text = newline != NULL ? newline + 1 : end;
  }
  return SP_OK;
}

/* ---- lifecycle ---------------------------------------------------------------------- */

static sp_status policy_create(const sp_host_api_v1 *host, const char *config_yaml, const sp_block_desc_v1 *blocks,
                               uint32_t n_blocks, sp_policy_ctx **out_ctx) {
  sp_policy_ctx *ctx;
  sp_status status;

  if (out_ctx == NULL) return fail(create_error, SP_ERR_INVALID_ARGUMENT, "out_ctx is NULL");
  *out_ctx = NULL;
  if (host == NULL || config_yaml == NULL || (blocks == NULL && n_blocks > 0)) {
    return fail(create_error, SP_ERR_INVALID_ARGUMENT, "host, config_yaml or blocks is NULL");
  }
  /* Read only fields the host's struct_size covers; a later minor may append more. */
  if (host->struct_size < offsetof(sp_host_api_v1, min_log_level) + sizeof host->min_log_level) {
    return fail(create_error, SP_ERR_INVALID_ARGUMENT, "sp_host_api_v1 is only %u bytes", host->struct_size);
  }
  ctx = calloc(1, sizeof *ctx);
  if (ctx == NULL) return fail(create_error, SP_ERR_INTERNAL, "out of memory");
  ctx->int8_max_l2 = 1.0;
  ctx->min_samples = 1;
  ctx->n_blocks = n_blocks;
  ctx->blocks = calloc(n_blocks > 0 ? n_blocks : 1, sizeof *ctx->blocks);
  ctx->log = host->log;
  ctx->log_user_data = host->log_user_data;
  ctx->min_log_level = host->min_log_level;
  if (ctx->blocks == NULL) {
    free(ctx);
    return fail(create_error, SP_ERR_INTERNAL, "out of memory");
  }
  status = parse_config(ctx, config_yaml);
  if (status != SP_OK) {
    free(ctx->blocks);
    free(ctx);
    return status;
  }
  log_message(ctx, SP_LOG_INFO, PLUGIN_NAME " " PLUGIN_VERSION ": %u blocks, int8_max_l2=%g, min_samples=%llu",
              n_blocks, ctx->int8_max_l2, (unsigned long long)ctx->min_samples);
  *out_ctx = ctx;
  return SP_OK;
}

static sp_status policy_destroy(sp_policy_ctx *ctx) {
  if (ctx != NULL) {
    free(ctx->blocks);
    free(ctx);
  }
  return SP_OK;
}

static sp_status policy_begin_step(sp_policy_ctx *ctx, int64_t step) {
  if (ctx == NULL) return SP_ERR_INVALID_ARGUMENT;
  (void)step;
  return SP_OK;
}

static sp_status policy_post_backward(sp_policy_ctx *ctx, int64_t step, const sp_grad_moments_v1 *moments, uint32_t n) {
  uint32_t i;
  if (ctx == NULL) return SP_ERR_INVALID_ARGUMENT;
  if (moments == NULL && n > 0) return fail(ctx->error, SP_ERR_INVALID_ARGUMENT, "moments is NULL");
  /* Check everything before changing anything, so a rejected call leaves no trace. */
  for (i = 0; i < n; ++i) {
    if (moments[i].block_id >= ctx->n_blocks) {
      return fail(ctx->error, SP_ERR_INVALID_ARGUMENT, "step %lld: moments[%u].block_id is %u, but there are %u blocks",
                  (long long)step, i, moments[i].block_id, ctx->n_blocks);
    }
  }
  for (i = 0; i < n; ++i) {
    const sp_grad_moments_v1 *sample = &moments[i];
    block_state *block = &ctx->blocks[sample->block_id];
    if (sample->nonfinite > 0 || !isfinite(sample->sum_sq)) {
      block->unsafe = 1;
      continue;
    }
    block->samples += 1;
    block->l2_sum += sqrt(sample->sum_sq);
  }
  return SP_OK;
}

static sp_status policy_compute_hints(sp_policy_ctx *ctx, int64_t step, sp_hint_v1 *hints_out, uint32_t n) {
  uint32_t id;
  (void)step;
  if (ctx == NULL) return SP_ERR_INVALID_ARGUMENT;
  if (hints_out == NULL || n != ctx->n_blocks) {
    return fail(ctx->error, SP_ERR_INVALID_ARGUMENT, "compute_hints needs %u hints, got %u%s", ctx->n_blocks, n,
                hints_out == NULL ? " and a NULL buffer" : "");
  }
  for (id = 0; id < n; ++id) {
    block_state *block = &ctx->blocks[id];
    sp_hint_v1 *hint = &hints_out[id];
    memset(hint, 0, sizeof *hint);
    hint->block_id = id;
    hint->precision = SP_PRECISION_BF16;
    hint->sensitivity = NAN;
    if (block->unsafe) {
      hint->reason = SP_REASON_UNSAFE;
      block->unsafe = 0;
      log_message(ctx, SP_LOG_WARN, "block %u saw a non-finite gradient: BF16", id);
    } else if (block->samples < ctx->min_samples) {
      hint->reason = SP_REASON_NO_DATA;
    } else {
      const double mean_l2 = block->l2_sum / (double)block->samples;
      /* 0.5 exactly at the threshold, towards 1 for large gradients. */
      hint->sensitivity = mean_l2 / (mean_l2 + ctx->int8_max_l2);
      hint->precision = mean_l2 < ctx->int8_max_l2 ? SP_PRECISION_INT8 : SP_PRECISION_BF16;
      hint->reason = SP_REASON_THRESHOLD;
    }
  }
  return SP_OK;
}

static sp_status policy_end_step(sp_policy_ctx *ctx, int64_t step, const sp_step_feedback_v1 *feedback) {
  (void)step;
  (void)feedback; /* this policy does not use loss or byte counts */
  return ctx != NULL ? SP_OK : SP_ERR_INVALID_ARGUMENT;
}

static sp_status policy_set_calibration_errors(sp_policy_ctx *ctx, const uint32_t *block_ids, const double *errors,
                                               uint32_t n) {
  uint32_t i;
  if (ctx == NULL) return SP_ERR_INVALID_ARGUMENT;
  if ((block_ids == NULL || errors == NULL) && n > 0) {
    return fail(ctx->error, SP_ERR_INVALID_ARGUMENT, "block_ids or errors is NULL");
  }
  /* The policy ignores calibration errors but still rejects ids that do not exist. */
  for (i = 0; i < n; ++i) {
    if (block_ids[i] >= ctx->n_blocks) {
      return fail(ctx->error, SP_ERR_INVALID_ARGUMENT, "block_ids[%u] is %u, but there are %u blocks", i, block_ids[i],
                  ctx->n_blocks);
    }
  }
  return SP_OK;
}

/* ---- state migration ---------------------------------------------------------------- */

static void put_u32(uint8_t **cursor, uint32_t value) {
  memcpy(*cursor, &value, 4);
  *cursor += 4;
}
static void put_u64(uint8_t **cursor, uint64_t value) {
  memcpy(*cursor, &value, 8);
  *cursor += 8;
}
static void put_f64(uint8_t **cursor, double value) {
  memcpy(*cursor, &value, 8);
  *cursor += 8;
}
static uint32_t get_u32(const uint8_t **cursor) {
  uint32_t v;
  memcpy(&v, *cursor, 4);
  *cursor += 4;
  return v;
}
static uint64_t get_u64(const uint8_t **cursor) {
  uint64_t v;
  memcpy(&v, *cursor, 8);
  *cursor += 8;
  return v;
}
static double get_f64(const uint8_t **cursor) {
  double v;
  memcpy(&v, *cursor, 8);
  *cursor += 8;
  return v;
}

static sp_status policy_export_state(sp_policy_ctx *ctx, uint8_t *buffer, uint64_t capacity, uint64_t *size_out) {
  const uint64_t size = STATE_HEADER_BYTES + (uint64_t)STATE_BLOCK_BYTES * (ctx != NULL ? ctx->n_blocks : 0);
  uint8_t *cursor = buffer;
  uint32_t id;
  if (ctx == NULL || size_out == NULL) return SP_ERR_INVALID_ARGUMENT;
  *size_out = size;
  if (capacity < size || buffer == NULL) {
    return fail(ctx->error, SP_ERR_BUFFER_TOO_SMALL, "the state needs %llu bytes", (unsigned long long)size);
  }
  memcpy(cursor, STATE_MAGIC, 4);
  cursor += 4;
  put_u32(&cursor, STATE_FORMAT_VERSION);
  put_u32(&cursor, ctx->n_blocks);
  put_u32(&cursor, 0);
  for (id = 0; id < ctx->n_blocks; ++id) {
    put_u64(&cursor, ctx->blocks[id].samples);
    put_f64(&cursor, ctx->blocks[id].l2_sum);
    put_u32(&cursor, ctx->blocks[id].unsafe);
    put_u32(&cursor, 0);
  }
  return SP_OK;
}

static sp_status policy_import_state(sp_policy_ctx *ctx, const uint8_t *blob, uint64_t size) {
  const uint8_t *cursor = blob;
  uint32_t format_version;
  uint32_t n_blocks;
  uint32_t id;
  if (ctx == NULL) return SP_ERR_INVALID_ARGUMENT;
  if (blob == NULL || size < STATE_HEADER_BYTES || memcmp(blob, STATE_MAGIC, 4) != 0) {
    return fail(ctx->error, SP_ERR_STATE,
                "the state blob (%llu bytes) does not start with the " PLUGIN_NAME " header '" STATE_MAGIC "'",
                (unsigned long long)size);
  }
  cursor += 4;
  format_version = get_u32(&cursor);
  n_blocks = get_u32(&cursor);
  cursor += 4;
  if (format_version != STATE_FORMAT_VERSION) {
    return fail(ctx->error, SP_ERR_STATE, "state format version %u is not supported; expected %u", format_version,
                STATE_FORMAT_VERSION);
  }
  if (n_blocks != ctx->n_blocks) {
    return fail(ctx->error, SP_ERR_STATE, "the state describes %u blocks, but this instance has %u", n_blocks,
                ctx->n_blocks);
  }
  if (size != STATE_HEADER_BYTES + (uint64_t)STATE_BLOCK_BYTES * n_blocks) {
    return fail(ctx->error, SP_ERR_STATE, "the state blob is %llu bytes, expected %llu for %u blocks",
                (unsigned long long)size,
                (unsigned long long)(STATE_HEADER_BYTES + (uint64_t)STATE_BLOCK_BYTES * n_blocks), n_blocks);
  }
  /* First pass validates, second applies: a rejected blob leaves the context untouched. */
  for (id = 0; id < n_blocks; ++id) {
    const uint8_t *record = cursor + (size_t)id * STATE_BLOCK_BYTES;
    const uint64_t samples = get_u64(&record);
    const double l2_sum = get_f64(&record);
    const uint32_t unsafe = get_u32(&record);
    if (!isfinite(l2_sum) || l2_sum < 0.0 || (samples == 0 && l2_sum != 0.0) || unsafe > 1) {
      return fail(ctx->error, SP_ERR_STATE, "block %u in the state blob is corrupt", id);
    }
  }
  for (id = 0; id < n_blocks; ++id) {
    ctx->blocks[id].samples = get_u64(&cursor);
    ctx->blocks[id].l2_sum = get_f64(&cursor);
    ctx->blocks[id].unsafe = get_u32(&cursor);
    cursor += 4;
  }
  return SP_OK;
}

static const char *policy_last_error(const sp_policy_ctx *ctx) { return ctx != NULL ? ctx->error : create_error; }

static const sp_policy_plugin_v1_table plugin_table = {
    .struct_size = sizeof(sp_policy_plugin_v1_table),
    .abi_major = SP_PLUGIN_ABI_MAJOR,
    .abi_minor = SP_PLUGIN_ABI_MINOR,
    .plugin_name = PLUGIN_NAME,
    .plugin_version = PLUGIN_VERSION,
    .create = policy_create,
    .destroy = policy_destroy,
    .begin_step = policy_begin_step,
    .post_backward = policy_post_backward,
    .compute_hints = policy_compute_hints,
    .end_step = policy_end_step,
    .set_calibration_errors = policy_set_calibration_errors,
    .export_state = policy_export_state,
    .import_state = policy_import_state,
    .last_error = policy_last_error,
};

/* The only exported symbol (the build's version script hides everything else). */
SP_PLUGIN_EXPORT const sp_policy_plugin_v1_table *sp_policy_plugin_v1(void) { return &plugin_table; }
