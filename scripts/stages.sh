# Sourced by the set-up scripts (main.sh, test.sh): runs each stage under a name and prints how
# long it took, so that a newcomer sees where the minutes go. Not a script to run by itself.
#
#   sp_stage NAME COMMAND...   runs COMMAND, then prints "==> NAME: 42 s"
#   sp_stage_summary           prints every stage's time and the total, in order

sp_stage_names=()
sp_stage_seconds=()
sp_stages_start=$SECONDS

sp_stage() {
  local name=$1
  shift
  local start=$SECONDS
  echo "==> $name"
  "$@"
  local took=$((SECONDS - start))
  sp_stage_names+=("$name")
  sp_stage_seconds+=("$took")
  echo "==> $name: ${took} s"
}

sp_stage_summary() {
  local i
  echo "==> stages:"
  for i in "${!sp_stage_names[@]}"; do
    printf '      %-22s %5d s\n' "${sp_stage_names[$i]}" "${sp_stage_seconds[$i]}"
  done
  printf '      %-22s %5d s\n' total $((SECONDS - sp_stages_start))
}
