# The policies the experiment scripts compare, as sp-train arguments: policy_args NAME.
# Sourced by run_experiments.sh and run_link_bound.sh so that every table of docs/results.md
# means the same thing by the same name.
# The fixed formats list every block: SP_BLOCKS of them (default 6, the default config's
# model.n_blocks; set it with a run that changes model.n_blocks).
policy_args() {
  local p=memory.stagehand.selective_precision
  local n=${SP_BLOCKS:-6}
  local all inner
  all=$(seq -s, 0 $((n - 1)))
  inner=$(seq -s, 1 $((n - 2)))
  case $1 in
    bf16-only) echo "--set $p.mode=off" ;;
    all-int8) echo "--set $p.mode=static --set $p.force_int8_blocks=[$all]" ;;
    all-nf4) echo "--set $p.mode=static --set $p.force_nf4_blocks=[$all]" ;;
    first-last-bf16) echo "--set $p.mode=static --set $p.force_nf4_blocks=[$inner]" ;;
    dynamic) echo "" ;;
    # v2 with the experiment's thresholds (configs/policy/dynamic_v2.yaml, docs/results.md):
    # with v1's int8_threshold 0.3 and grad_sensitivity_threshold 2, an average block scores
    # 0.35 from its gradient alone and NF4 (which must sit below INT8) is out of reach.
    dynamic-v2) echo "--set $p.tiers=[bf16,int8,nf4] --set $p.loss_guard.enabled=true" \
                     "--set $p.grad_sensitivity_threshold=4 --set $p.int8_threshold=0.45" \
                     "--set $p.nf4_threshold=0.3 --set $p.nf4_quant_error_threshold=0.25" ;;
    *) echo "unknown policy $1" >&2; exit 2 ;;
  esac
}
