/*
 * Selective Precision policy plugin ABI, version 1.
 *
 * FROZEN per minor. This header describes a binary contract between a host runtime
 * and a policy plugin (.so). Minor 0 (1.0) is frozen; minors 1 (1.1) to 4 (1.4) only
 * appended to it, and every addition is marked "1.1", "1.2", "1.3" or "1.4". Once released, nothing
 * in it changes meaning:
 *   - structs passed one at a time (sp_host_api_v1, sp_step_feedback_v1 and the
 *     function table) only grow by appending fields. Their first field is struct_size,
 *     so a reader checks offsetof(field) + sizeof(field) <= struct_size before it reads
 *     an appended field, and treats a field beyond struct_size as absent;
 *   - the three structs passed as arrays, sp_block_desc_v1, sp_grad_moments_v1 and
 *     sp_hint_v1, never change for the whole major version. A C array's stride is the
 *     element size both sides compiled, so a grown element would shift every element
 *     after the first for a plugin of an older minor. Their sizes are asserted at the
 *     end of this file. sp_block_desc_v1 carries a struct_size, but it is always
 *     sizeof(sp_block_desc_v1) (40 bytes): a host never sends another value, and a
 *     plugin may refuse another value. New per-block data arrives through new table
 *     functions that take plain arrays indexed by block id (set_transfer_bytes in 1.1),
 *     or through a self-describing table whose columns are named (sp_unit_signals_v1 in
 *     1.2), never through these structs;
 *   - enums only gain values;
 *   - a changed signature becomes a new table in plugin_abi_v2.h.
 * Adding an appended field or an enum value bumps SP_PLUGIN_ABI_MINOR. Anything
 * else is a new major version with its own header and entry symbol.
 *
 * Minors on both sides: a host never hands a plugin anything from a newer minor than
 * the plugin's own table reports. To a 1.0 plugin a 1.1 host passes struct_size values
 * of the 1.0 layouts, never calls a 1.1 function, and refuses a hint whose precision
 * 1.0 does not define. Likewise a 1.2 host never calls a 1.2 function on a 1.0 or 1.1
 * plugin (1.2 appends only functions, new structs and enum values), nor a 1.3 host a 1.3
 * function on an older plugin (1.3 appends one function); a 1.4 host hands an older plugin the
 * 1.2 size of sp_budget_status_v1 (1.4 appends a field to it, a struct and two functions). A plugin of a newer minor than the host is never loaded (the
 * version rule below), so a plugin always meets a host of its own minor or a newer one;
 * it still reads an appended field only where struct_size covers it.
 *
 * Version rule (as in Triton's backend API): the host accepts a plugin when the
 * major versions are equal and the host's minor is >= the plugin's minor.
 *
 * Boundary rules (as in PyTorch's stable C shim):
 *   - every function returns sp_status; no C++ exception ever crosses the boundary;
 *   - only integers, doubles, plain structs and pointers appear in signatures;
 *   - every pointer states who owns it and for how long it is valid;
 *   - the plugin never touches host memory after the call that lent it returns,
 *     owns no threads or streams, and logs only through the host's callback.
 *
 * Threading: the host calls a context's functions from one thread at a time.
 * Distinct contexts are independent.
 */
#ifndef SP_PLUGIN_ABI_V1_H
#define SP_PLUGIN_ABI_V1_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SP_PLUGIN_ABI_MAJOR 1
/* The newest minor this header describes. */
#define SP_PLUGIN_ABI_LATEST_MINOR 4

/* A plugin that implements an older minor defines SP_PLUGIN_ABI_TARGET_MINOR before
 * including this header (e.g. 0 for 1.0): it then compiles exactly that minor's layouts,
 * and SP_PLUGIN_ABI_MINOR, which it puts in its table, says so. Hosts compile the latest. */
#ifndef SP_PLUGIN_ABI_TARGET_MINOR
#define SP_PLUGIN_ABI_TARGET_MINOR SP_PLUGIN_ABI_LATEST_MINOR
#endif
#if SP_PLUGIN_ABI_TARGET_MINOR < 0 || SP_PLUGIN_ABI_TARGET_MINOR > SP_PLUGIN_ABI_LATEST_MINOR
#error "SP_PLUGIN_ABI_TARGET_MINOR must be 0, 1, 2, 3 or 4"
#endif
#define SP_PLUGIN_ABI_MINOR SP_PLUGIN_ABI_TARGET_MINOR

/* The one symbol a v1 plugin exports. Its type is sp_policy_plugin_entry_v1_fn. */
#define SP_PLUGIN_ENTRY_SYMBOL_V1 "sp_policy_plugin_v1"

#if defined(__GNUC__)
#define SP_PLUGIN_EXPORT __attribute__((visibility("default")))
#else
#define SP_PLUGIN_EXPORT
#endif

/* Status codes. 0 is success; everything else is a failure whose details the
 * plugin makes available through last_error(). */
typedef int32_t sp_status;
#define SP_OK 0
#define SP_ERR_INVALID_ARGUMENT 1 /* a null pointer, a bad count or an unknown block id */
#define SP_ERR_CONFIG 2           /* the configuration text was rejected */
#define SP_ERR_STATE 3            /* an imported state blob was rejected */
#define SP_ERR_BUFFER_TOO_SMALL 4 /* export_state: *size_out holds the size needed */
#define SP_ERR_INTERNAL 5         /* anything else; the plugin stays usable */
#define SP_ERR_ORDER 6            /* a hook was called out of lifecycle order */

/* Transfer precision of a block. */
typedef int32_t sp_precision;
#define SP_PRECISION_BF16 0
#define SP_PRECISION_INT8 1
/* 1.1: 4-bit NormalFloat codes (QLoRA's 16 levels), two per byte, one absmax scale per
 * group of elements along a row; about 0.27x the BF16 bytes (0.2666x at group 64). */
#define SP_PRECISION_NF4 2

/* 1.1: a bit mask of precisions, bit (1u << p) for sp_precision p. */
typedef uint32_t sp_precision_mask;
#define SP_PRECISION_BIT(p) ((sp_precision_mask)1u << (p))

/* Why a hint says what it says. */
typedef int32_t sp_reason;
#define SP_REASON_NO_DATA 0         /* no gradient sample yet: the block keeps what it has */
#define SP_REASON_THRESHOLD 1       /* the score crossed a threshold at this decision step */
#define SP_REASON_HYSTERESIS_HOLD 2 /* the score sits between the switch points: keep */
#define SP_REASON_COOLDOWN 3        /* a switch was due but the cooldown has not passed */
#define SP_REASON_UNSAFE 4          /* a non-finite gradient sent the block to BF16 */
#define SP_REASON_FORCED 5          /* a force list decided */
#define SP_REASON_MODE 6            /* the mode (off, static) decided */
#define SP_REASON_NOT_DECISION_STEP 7 /* not a decision step: the previous decision stands */
#define SP_REASON_HOST_FALLBACK 8   /* set by the host, never by a plugin: the plugin failed and
                                       the host substituted a safe hint */
#define SP_REASON_LOSS_GUARD 9      /* 1.1: a loss spike after the block's last move down sent it
                                       back to the precision it had before */
#define SP_REASON_PENALTY 10        /* 1.1: a move down was due, but the block is under a loss-guard
                                       penalty */
#define SP_REASON_BUDGET 11         /* 1.2: the allocation under the user's budget decided */

/* 1.2: what a policy's budget limits (sp_budget_status_v1). */
typedef int32_t sp_budget_kind;
#define SP_BUDGET_NONE 0  /* the policy has no budget */
#define SP_BUDGET_BYTES 1 /* a step moves at most `limit` times the bytes of all-BF16 */
#define SP_BUDGET_LOSS 2  /* the predicted loss increase stays at most `limit` times the current loss */

/* Log levels, in increasing severity. */
typedef int32_t sp_log_level;
#define SP_LOG_DEBUG 0
#define SP_LOG_INFO 1
#define SP_LOG_WARN 2
#define SP_LOG_ERROR 3

/* Host log sink. `message` is borrowed: valid only during the call, NUL-terminated.
 * Must not throw and must be callable from the thread that calls the plugin. */
typedef void (*sp_log_fn)(void *user_data, sp_log_level level, const char *message);

/* What the host gives the plugin at create(). The plugin copies whatever it
 * wants to keep: the struct and every string in it are borrowed for the
 * duration of create() only, except `log` and `log_user_data`, which stay valid
 * until destroy() returns. */
typedef struct sp_host_api_v1 {
  uint32_t struct_size;    /* sizeof(sp_host_api_v1) of the plugin's minor: a 1.1 host passes
                              SP_HOST_API_V1_0_SIZE to a 1.0 plugin */
  uint32_t abi_major;      /* the host's SP_PLUGIN_ABI_MAJOR */
  uint32_t abi_minor;      /* the host's SP_PLUGIN_ABI_MINOR (may be newer than the plugin's;
                              struct_size, not this, says which fields are present) */
  uint32_t reserved0;      /* zero */
  const char *host_name;    /* borrowed; e.g. "sp-train" */
  const char *host_version; /* borrowed; e.g. "0.1.0" */
  const char *output_dir;   /* borrowed; directory for relative output files (telemetry); may be NULL = cwd */
  sp_log_fn log;            /* may be NULL: the plugin then stays silent */
  void *log_user_data;      /* opaque to the plugin; passed back to log */
  sp_log_level min_log_level; /* messages below this level need not be formatted */
  uint32_t reserved1;         /* zero */
#if SP_PLUGIN_ABI_TARGET_MINOR >= 1
  /* 1.1 (read only when struct_size covers it; a 1.0 host transfers BF16 and INT8): */
  sp_precision_mask supported_precisions; /* the precisions this host can transfer; BF16 always */
  uint32_t reserved2;                     /* zero */
#endif
} sp_host_api_v1;

/* One streamed block, as the host describes it at create(). An array element: frozen for
 * the whole major version (see the top of the file). */
typedef struct sp_block_desc_v1 {
  uint32_t struct_size;  /* always sizeof(sp_block_desc_v1) == 40 */
  uint32_t block_id;     /* 0..n_blocks-1, in execution order; descs arrive sorted by id */
  uint64_t num_params;   /* elements in the block's streamed weights */
  uint64_t bf16_bytes;   /* bytes one BF16 transfer of the block puts on the wire */
  uint64_t int8_bytes;   /* bytes one INT8 transfer puts on the wire (data + scales + header) */
  const char *name;      /* borrowed for create() only; may be NULL */
} sp_block_desc_v1;

/* Gradient moments of one block over all its gradient tensors, one backward pass. */
typedef struct sp_grad_moments_v1 {
  uint32_t block_id;
  uint32_t reserved0;  /* zero */
  double sum_sq;       /* sum of g^2 over finite elements */
  double sum;          /* sum of g over finite elements */
  double max_abs;      /* max |g| over finite elements */
  uint64_t count;      /* number of elements (finite or not) */
  uint64_t nonfinite;  /* elements that were NaN or +-Inf */
} sp_grad_moments_v1;

/* The plugin's answer for one block. */
typedef struct sp_hint_v1 {
  uint32_t block_id;
  sp_precision precision; /* effective precision for the next transfers */
  double sensitivity;     /* last computed score in [0,1]; NaN when never scored */
  sp_reason reason;
  uint32_t reserved0;     /* zero */
} sp_hint_v1;

/* What the host reports at the end of a step. */
typedef struct sp_step_feedback_v1 {
  uint32_t struct_size;      /* sizeof(sp_step_feedback_v1) of the plugin's minor: a 1.1 host
                                passes SP_STEP_FEEDBACK_V1_0_SIZE to a 1.0 plugin */
  uint32_t reserved0;        /* zero */
  double loss;               /* training loss of the step; NaN when unknown */
  uint64_t h2d_bytes_bf16;   /* bytes moved host-to-device on the BF16 path this step */
  uint64_t h2d_bytes_int8;   /* bytes moved on the INT8 path this step */
  uint64_t h2d_bytes_all_bf16; /* what the same fetches would have moved as BF16; 0 = unknown */
  double step_seconds;       /* wall time of the step; NaN when unknown */
#if SP_PLUGIN_ABI_TARGET_MINOR >= 1
  /* 1.1 (read only when struct_size covers it): */
  uint64_t h2d_bytes_nf4;    /* bytes moved on the NF4 path this step */
#endif
} sp_step_feedback_v1;

/* 1.2: a self-describing table of per-unit signals the host measured, a units x signals matrix
 * of doubles with named columns. A unit is a streamed block: row u is block id u. The host can
 * add a column without a new minor; a plugin reads the columns it knows by name and ignores the
 * rest. Appendable: a reader checks struct_size before it reads a field a later minor appends.
 *
 * Column names a host may send (the plugin's documentation says which it reads), per tier
 * <tier> in bf16, int8, nf4:
 *   loss_cost.<tier>     the predicted increase of the loss if the unit computed with that
 *                        tier's image instead of its full-precision master weights: the first-
 *                        plus the second-order Taylor term, with delta = image - master, the
 *                        gradient g and the diagonal F of the per-example Fisher (the mean of
 *                        each example's squared gradient):  sum g*delta + 1/2 sum F*delta^2
 *   first_order.<tier>   the first term alone,  sum g*delta
 *   second_order.<tier>  the second term alone, 1/2 sum F*delta^2 */
typedef struct sp_unit_signals_v1 {
  uint32_t struct_size;  /* sizeof(sp_unit_signals_v1) as the host compiled it; at least
                            SP_UNIT_SIGNALS_V1_2_SIZE */
  uint32_t n_units;      /* rows: the n_blocks of create() */
  uint32_t n_signals;    /* columns; may be 0 */
  uint32_t reserved0;    /* zero */
  const char *const *signal_names; /* borrowed for the call: n_signals NUL-terminated names,
                                      distinct; may be NULL when n_signals is 0 */
  const double *values;  /* borrowed for the call: n_units * n_signals values, row-major (value
                            of unit u, column c at values[u * n_signals + c]); NaN = not measured;
                            may be NULL when the product is 0 */
  double loss;           /* the loss of the batches measured; NaN when unknown */
  uint64_t samples;      /* the examples behind the estimate; 0 when unknown */
} sp_unit_signals_v1;

/* 1.2: where a budget policy's current allocation stands. Appendable; the caller owns it and
 * sets struct_size to the size of the plugin's minor (SP_BUDGET_STATUS_V1_2_SIZE for 1.2 and 1.3,
 * SP_BUDGET_STATUS_V1_4_SIZE from 1.4 on); the plugin fills the fields that struct_size covers
 * and leaves struct_size as it is. */
typedef struct sp_budget_status_v1 {
  uint32_t struct_size;
  sp_budget_kind kind;             /* SP_BUDGET_NONE, _BYTES or _LOSS */
  double limit;                    /* the stated limit (a fraction); NaN with SP_BUDGET_NONE */
  double planned_bytes_fraction;   /* bytes of the current allocation over all-BF16 bytes; NaN
                                      before the first allocation */
  double planned_cost;             /* predicted loss increase of the current allocation; NaN
                                      when unmeasured */
  double planned_loss_fraction;    /* planned_cost over reference_loss; NaN when either is unknown */
  double reference_loss;           /* the loss a loss budget is a fraction of; NaN when unknown */
  int64_t decided_at_step;         /* the step whose hints first carried the allocation; -1 = none */
  uint32_t met;                    /* 1 when the allocation keeps the budget, 0 otherwise (0 also
                                      without a budget or an allocation) */
  uint32_t reserved0;              /* zero */
#if SP_PLUGIN_ABI_TARGET_MINOR >= 4
  /* 1.4 (written only when struct_size covers it): */
  uint32_t reads_step_signals;     /* 1 when the policy decides with the signal table a host
                                      measures from each step's gradients (the loss_cost,
                                      first_order and second_order columns above), 0 when it
                                      reads none of them: the host may then skip measuring them,
                                      and the gradients only they need. A host treats a plugin
                                      older than 1.4 as reading them. Any budget kind. */
  uint32_t reserved1;              /* zero */
#endif
} sp_budget_status_v1;

/* 1.4: what the host measured of the allocations a policy proposed (propose_allocations), each
 * against one reference (all-BF16), on the same examples. Appendable; the caller owns it and
 * every array it points to, borrowed for the call. Allocation 0 is the one the policy holds;
 * each other one is compared with it example by example. */
typedef struct sp_allocation_measurements_v1 {
  uint32_t struct_size;          /* sizeof(sp_allocation_measurements_v1) as the host compiled it;
                                    at least SP_ALLOCATION_MEASUREMENTS_V1_4_SIZE */
  uint32_t n_allocations;        /* as many as propose_allocations gave, in its order */
  uint32_t n_blocks;             /* the n_blocks of create() */
  uint32_t reserved0;            /* zero */
  const sp_precision *routes;    /* n_allocations * n_blocks: the allocations measured (row k,
                                    block b at routes[k * n_blocks + b]), as proposed */
  const double *cost;            /* n_allocations: the mean cost against the reference (the KL
                                    of the outputs per example, or the loss difference) */
  const double *cost_upper;      /* n_allocations: the upper bound of its confidence interval */
  const double *difference;      /* n_allocations: the mean paired difference, allocation k's
                                    cost minus allocation 0's (0 for k = 0) */
  const double *difference_upper; /* n_allocations: its upper confidence bound */
  uint64_t samples;              /* the examples (or batches) the intervals pair over */
  double confidence;             /* of every interval, in (0, 1) */
} sp_allocation_measurements_v1;

/* Opaque per-instance state, created and freed by the plugin. */
typedef struct sp_policy_ctx sp_policy_ctx;

/* The function table. A plugin returns a pointer to a static const instance. */
typedef struct sp_policy_plugin_v1_table {
  uint32_t struct_size; /* sizeof(sp_policy_plugin_v1_table) as the plugin compiled it */
  uint32_t abi_major;   /* SP_PLUGIN_ABI_MAJOR the plugin was built against */
  uint32_t abi_minor;   /* SP_PLUGIN_ABI_MINOR the plugin was built against */
  uint32_t reserved0;   /* zero */
  const char *plugin_name;    /* static storage of the plugin; valid while it is loaded */
  const char *plugin_version; /* static storage of the plugin; e.g. "1.0.0" */

  /* Creates an instance. `host`, `config_yaml` (NUL-terminated YAML text) and
   * `blocks` (n_blocks entries) are borrowed for this call only. On SP_OK,
   * *out_ctx receives a new context owned by the caller, to be released with
   * destroy(). On failure *out_ctx is set to NULL and the message is available
   * through last_error(NULL). */
  sp_status (*create)(const sp_host_api_v1 *host, const char *config_yaml,
                      const sp_block_desc_v1 *blocks, uint32_t n_blocks,
                      sp_policy_ctx **out_ctx);

  /* Frees the context and everything the plugin allocated for it (open files
   * included). `ctx` may be NULL. After it returns the plugin holds no resource
   * for that context. */
  sp_status (*destroy)(sp_policy_ctx *ctx);

  /* A step begins. Step numbers are strictly increasing; they may skip (a host that
   * resumes from a checkpoint, or drops a step, continues with a larger number). */
  sp_status (*begin_step)(sp_policy_ctx *ctx, int64_t step);

  /* Gradient moments after the step's backward pass. `moments` (n entries,
   * distinct block ids) is borrowed for this call only. A block with no
   * gradient this step is absent. */
  sp_status (*post_backward)(sp_policy_ctx *ctx, int64_t step,
                             const sp_grad_moments_v1 *moments, uint32_t n);

  /* Fills hints_out[0..n) with one hint per block, hints_out[i].block_id == i.
   * `hints_out` is owned by the caller; n must equal the n_blocks of create().
   * Called once per step, after post_backward. */
  sp_status (*compute_hints)(sp_policy_ctx *ctx, int64_t step,
                             sp_hint_v1 *hints_out, uint32_t n);

  /* The step ended. `feedback` is borrowed for this call only; may be NULL. */
  sp_status (*end_step)(sp_policy_ctx *ctx, int64_t step,
                        const sp_step_feedback_v1 *feedback);

  /* Per-block relative output error of INT8 against BF16 from a calibration
   * pass. Both arrays (n entries) are borrowed for this call only. Replaces the
   * errors of the listed blocks; other blocks keep theirs. */
  sp_status (*set_calibration_errors)(sp_policy_ctx *ctx, const uint32_t *block_ids,
                                      const double *errors, uint32_t n);

  /* Serialises the policy state into a versioned, self-describing blob.
   * `buffer` (capacity bytes) is owned by the caller and may be NULL when
   * capacity is 0. *size_out receives the blob size; if it exceeds capacity
   * the call returns SP_ERR_BUFFER_TOO_SMALL and writes nothing to buffer. */
  sp_status (*export_state)(sp_policy_ctx *ctx, uint8_t *buffer, uint64_t capacity,
                            uint64_t *size_out);

  /* Replaces the policy state with a blob from export_state (of this or an
   * earlier version of the plugin). `blob` is borrowed for this call only. The
   * blob is validated completely first; on any failure the context is left
   * exactly as it was and SP_ERR_STATE is returned (SP_ERR_INTERNAL when the
   * plugin ran out of a resource such as memory while decoding). */
  sp_status (*import_state)(sp_policy_ctx *ctx, const uint8_t *blob, uint64_t size);

  /* Message of the last failed call on `ctx` (or of the last failed create()
   * when ctx is NULL). Returns a NUL-terminated string owned by the plugin,
   * valid until the next call on the same ctx (or the next create()), never NULL.
   * The create() message is one per plugin, not per thread: a host that creates
   * contexts from several threads reads it before another create() may fail. */
  const char *(*last_error)(const sp_policy_ctx *ctx);

#if SP_PLUGIN_ABI_TARGET_MINOR >= 1
  /* ---- 1.1. A host calls these only when the table's abi_minor >= 1 and its
   * struct_size covers the pointer; a 1.1 plugin sets every one (none is NULL). ---- */

  /* Bytes one transfer of each block at `precision` puts on the wire (data + scales +
   * header), bytes[i] for block i; n must equal the n_blocks of create(). `bytes` is
   * borrowed for this call only. The host calls it after create() and before the first
   * begin_step for every precision other than BF16 and INT8 (whose bytes the block descs
   * carry) that it can transfer; it may call it again to replace the values. A precision
   * the host never described has no known size: a plugin that cannot work without it
   * fails with SP_ERR_INVALID_ARGUMENT where it needs it. */
  sp_status (*set_transfer_bytes)(sp_policy_ctx *ctx, sp_precision precision,
                                  const uint64_t *bytes, uint32_t n);

  /* Per-block relative output error of `precision` against BF16 from a calibration pass,
   * as set_calibration_errors (which is this function with SP_PRECISION_INT8). Both
   * arrays (n entries) are borrowed for this call only. Replaces the errors of the listed
   * blocks at that precision; other blocks and other precisions keep theirs.
   * SP_ERR_INVALID_ARGUMENT for SP_PRECISION_BF16 or a precision the plugin does not know. */
  sp_status (*set_precision_calibration_errors)(sp_policy_ctx *ctx, sp_precision precision,
                                                const uint32_t *block_ids, const double *errors,
                                                uint32_t n);
#endif

#if SP_PLUGIN_ABI_TARGET_MINOR >= 2
  /* ---- 1.2. A host calls these only when the table's abi_minor >= 2 and its
   * struct_size covers the pointer; a 1.2 plugin sets every one (none is NULL). ---- */

  /* Per-unit signals the host measured (sp_unit_signals_v1 above). `signals`, and the names
   * and values it points to, are borrowed for this call only. `step` is the step whose
   * weights and batches were measured, -1 for a calibration pass before the first
   * begin_step; it is at most the current step. May be called before the first begin_step
   * (the policy can then decide step 0's hints) and at any point between or within steps.
   * A table the plugin rejects changes nothing. */
  sp_status (*set_unit_signals)(sp_policy_ctx *ctx, int64_t step, const sp_unit_signals_v1 *signals);

  /* The predicted cost of each unit at `precision` that the policy decides with (its smoothed
   * loss_cost.<tier>), costs_out[i] for unit i, NaN where it has none. `costs_out` (n entries)
   * is owned by the caller and borrowed for this call; n must equal the n_blocks of create(). */
  sp_status (*get_unit_costs)(sp_policy_ctx *ctx, sp_precision precision, double *costs_out, uint32_t n);

  /* Where the policy's budget stands (sp_budget_status_v1 above). `status_out` is owned by
   * the caller and borrowed for this call; the plugin writes within its struct_size. */
  sp_status (*get_budget_status)(sp_policy_ctx *ctx, sp_budget_status_v1 *status_out);
#endif

#if SP_PLUGIN_ABI_TARGET_MINOR >= 3
  /* ---- 1.3. A host calls this only when the table's abi_minor >= 3 and its struct_size
   * covers the pointer; a 1.3 plugin sets it (not NULL). ---- */

  /* Fills hints_out[0..n) with the hints the policy gives before any step, from its
   * configuration alone: a route it forces (a static policy's, or any mode's force lists) and
   * otherwise its starting route. The host applies them to the first step's fetches and to
   * passes outside any step (inference), so that a forced route holds from the first fetch.
   * hints_out[i].block_id == i; `hints_out` is owned by the caller and borrowed for this call;
   * n must equal the n_blocks of create(). Called after create() and set_transfer_bytes(),
   * before the first begin_step; SP_ERR_ORDER once a step began (compute_hints decides
   * from then on). The policy then counts these as its current hints: step 0's compute_hints
   * switches nothing it returned here. */
  sp_status (*initial_hints)(sp_policy_ctx *ctx, sp_hint_v1 *hints_out, uint32_t n);
#endif

#if SP_PLUGIN_ABI_TARGET_MINOR >= 4
  /* ---- 1.4. A host calls these only when the table's abi_minor >= 4 and its struct_size
   * covers the pointer; a 1.4 plugin sets both (not NULL). ---- */

  /* The allocations the policy wants measured jointly, each a route per block: row 0 is the
   * allocation it holds, the others its alternatives (a policy that decides by measurement
   * proposes the swaps at its allocation's boundary). `routes_out` (capacity rows of n blocks)
   * is owned by the caller and borrowed for this call, and may be NULL when capacity is 0.
   * *count_out receives the number of rows; 0 means nothing to measure. If it exceeds
   * capacity the call returns SP_ERR_BUFFER_TOO_SMALL and writes no row. Between steps. */
  sp_status (*propose_allocations)(sp_policy_ctx *ctx, sp_precision *routes_out, uint32_t n, uint32_t capacity,
                                   uint32_t *count_out);

  /* What the host measured of the last proposal (sp_allocation_measurements_v1 above),
   * borrowed for this call. `step` as in set_unit_signals. The policy may move to an
   * alternative that measured better than allocation 0; measurements of another proposal than
   * its latest are refused with SP_ERR_INVALID_ARGUMENT and change nothing. Between steps. */
  sp_status (*set_allocation_measurements)(sp_policy_ctx *ctx, int64_t step,
                                           const sp_allocation_measurements_v1 *measurements);
#endif
} sp_policy_plugin_v1_table;

/* The array element layouts are part of the major version (see the top of the file). */
#ifdef __cplusplus
#define SP_ABI_STATIC_ASSERT static_assert
#else
#define SP_ABI_STATIC_ASSERT _Static_assert
#endif
SP_ABI_STATIC_ASSERT(sizeof(sp_block_desc_v1) == 40, "sp_block_desc_v1 is frozen for ABI major 1");
SP_ABI_STATIC_ASSERT(sizeof(sp_grad_moments_v1) == 48, "sp_grad_moments_v1 is frozen for ABI major 1");
SP_ABI_STATIC_ASSERT(sizeof(sp_hint_v1) == 24, "sp_hint_v1 is frozen for ABI major 1");

/* Sizes of the 1.0 layouts of the appendable structs, on LP64 (x86-64, aarch64). A 1.1 host
 * passes these struct_size values to a 1.0 plugin; a 1.1 plugin accepts them and treats the
 * 1.1 fields as absent. */
#define SP_HOST_API_V1_0_SIZE 64u
#define SP_STEP_FEEDBACK_V1_0_SIZE 48u
#define SP_PLUGIN_TABLE_V1_0_SIZE 112u
/* 1.2: where a 1.1 function table ends (1.2 appends to it), and the first layouts of the two
 * structs 1.2 introduces. */
#define SP_PLUGIN_TABLE_V1_1_SIZE 128u
#define SP_PLUGIN_TABLE_V1_2_SIZE 152u
#define SP_UNIT_SIGNALS_V1_2_SIZE 48u
#define SP_BUDGET_STATUS_V1_2_SIZE 64u
/* 1.4: the layout of sp_budget_status_v1 with the field 1.4 appends, where a 1.3 table ends (1.4
 * appends to it), and the first layout of the struct 1.4 introduces. */
#define SP_BUDGET_STATUS_V1_4_SIZE 72u
#define SP_PLUGIN_TABLE_V1_3_SIZE 160u
#define SP_ALLOCATION_MEASUREMENTS_V1_4_SIZE 72u
#if UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu
SP_ABI_STATIC_ASSERT(sizeof(sp_unit_signals_v1) == SP_UNIT_SIGNALS_V1_2_SIZE, "1.2 layout of sp_unit_signals_v1");
SP_ABI_STATIC_ASSERT(sizeof(sp_allocation_measurements_v1) == SP_ALLOCATION_MEASUREMENTS_V1_4_SIZE,
                     "1.4 layout of sp_allocation_measurements_v1");
#endif
#if UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu && SP_PLUGIN_ABI_TARGET_MINOR < 4
SP_ABI_STATIC_ASSERT(sizeof(sp_budget_status_v1) == SP_BUDGET_STATUS_V1_2_SIZE, "1.2 layout of sp_budget_status_v1");
#elif UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu
SP_ABI_STATIC_ASSERT(offsetof(sp_budget_status_v1, reads_step_signals) == SP_BUDGET_STATUS_V1_2_SIZE,
                     "1.4 fields of sp_budget_status_v1 start where 1.2 ended");
SP_ABI_STATIC_ASSERT(sizeof(sp_budget_status_v1) == SP_BUDGET_STATUS_V1_4_SIZE, "1.4 layout of sp_budget_status_v1");
#endif
#if UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu && SP_PLUGIN_ABI_TARGET_MINOR == 0
SP_ABI_STATIC_ASSERT(sizeof(sp_host_api_v1) == SP_HOST_API_V1_0_SIZE, "1.0 layout of sp_host_api_v1");
SP_ABI_STATIC_ASSERT(sizeof(sp_step_feedback_v1) == SP_STEP_FEEDBACK_V1_0_SIZE, "1.0 layout of sp_step_feedback_v1");
SP_ABI_STATIC_ASSERT(sizeof(sp_policy_plugin_v1_table) == SP_PLUGIN_TABLE_V1_0_SIZE, "1.0 layout of the table");
#elif UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu
SP_ABI_STATIC_ASSERT(offsetof(sp_host_api_v1, supported_precisions) == SP_HOST_API_V1_0_SIZE,
                     "1.1 fields of sp_host_api_v1 start where 1.0 ended");
SP_ABI_STATIC_ASSERT(offsetof(sp_step_feedback_v1, h2d_bytes_nf4) == SP_STEP_FEEDBACK_V1_0_SIZE,
                     "1.1 fields of sp_step_feedback_v1 start where 1.0 ended");
SP_ABI_STATIC_ASSERT(offsetof(sp_policy_plugin_v1_table, set_transfer_bytes) == SP_PLUGIN_TABLE_V1_0_SIZE,
                     "1.1 functions of the table start where 1.0 ended");
#endif
#if UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu && SP_PLUGIN_ABI_TARGET_MINOR == 1
SP_ABI_STATIC_ASSERT(sizeof(sp_policy_plugin_v1_table) == SP_PLUGIN_TABLE_V1_1_SIZE, "1.1 layout of the table");
#elif UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu && SP_PLUGIN_ABI_TARGET_MINOR >= 2
SP_ABI_STATIC_ASSERT(offsetof(sp_policy_plugin_v1_table, set_unit_signals) == SP_PLUGIN_TABLE_V1_1_SIZE,
                     "1.2 functions of the table start where 1.1 ended");
#endif
#if UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu && SP_PLUGIN_ABI_TARGET_MINOR == 2
SP_ABI_STATIC_ASSERT(sizeof(sp_policy_plugin_v1_table) == SP_PLUGIN_TABLE_V1_2_SIZE, "1.2 layout of the table");
#elif UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu && SP_PLUGIN_ABI_TARGET_MINOR >= 3
SP_ABI_STATIC_ASSERT(offsetof(sp_policy_plugin_v1_table, initial_hints) == SP_PLUGIN_TABLE_V1_2_SIZE,
                     "1.3 functions of the table start where 1.2 ended");
#endif
#if UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu && SP_PLUGIN_ABI_TARGET_MINOR == 3
SP_ABI_STATIC_ASSERT(sizeof(sp_policy_plugin_v1_table) == SP_PLUGIN_TABLE_V1_3_SIZE, "1.3 layout of the table");
#elif UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu && SP_PLUGIN_ABI_TARGET_MINOR >= 4
SP_ABI_STATIC_ASSERT(offsetof(sp_policy_plugin_v1_table, propose_allocations) == SP_PLUGIN_TABLE_V1_3_SIZE,
                     "1.4 functions of the table start where 1.3 ended");
#endif
#undef SP_ABI_STATIC_ASSERT

/* The exported entry point. Returns a pointer to static storage of the plugin,
 * valid while the plugin is loaded; never NULL. Takes no lock, allocates nothing. */
typedef const sp_policy_plugin_v1_table *(*sp_policy_plugin_entry_v1_fn)(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SP_PLUGIN_ABI_V1_H */
