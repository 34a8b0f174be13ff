#!/usr/bin/env bash
# The experiments of docs/results.md: the same seed and data under BF16-only streaming,
# dynamic Selective Precision and all-INT8, in full mode from a random initialization and in
# LoRA mode on the weights the full-mode BF16-only run ended with. Runs them one after the
# other (they would only compete for the cores), then collects every summary.json into
# bench/results/train-<mode>-<policy>.json, one combined bench/results/train-experiments.json
# with the machine and the commands, and the figures.
#
#   bash runtime/sp_train/tools/run_experiments.sh [BUILD_DIR] [WORK_DIR]
#
# A variant of the set (the outlier stress test of docs/results.md) is named by the
# environment; its files are then train-<NAME>-<mode>-<policy>.json and
# train-<NAME>-experiments.json:
#   SP_EXPERIMENT_NAME  the variant's name (default: none, the main set)
#   SP_EXPERIMENT_ARGS  arguments added to every run, e.g. "--set model.outliers.blocks=[1,3]"
#   SP_MODES            the modes to run (default: "full lora")
#   SP_LORA_BASE        the checkpoint LoRA adapts (default: this set's full-mode BF16-only run)
set -euo pipefail

repo=$(cd "$(dirname "$0")/../../.." && pwd)
build=${1:-$repo/build}
work=${2:-$build/experiments}
results=$repo/bench/results
sp_train=$build/bin/sp-train
[[ -x $sp_train ]] || { echo "$sp_train: not built (ninja -C $build sp-train)" >&2; exit 2; }
mkdir -p "$work" "$results"
name=${SP_EXPERIMENT_NAME:-}
prefix=train${name:+-$name}
extra_args=${SP_EXPERIMENT_ARGS:-}
read -r -a modes <<<"${SP_MODES:-full lora}"
runs=$work/${name:+$name-}  # each run's directory is $runs<mode>-<policy>
lora_base=${SP_LORA_BASE:-${runs}full-bf16-only/checkpoint.bin}

policy_args() {
  case $1 in
    bf16-only) echo "--set memory.stagehand.selective_precision.mode=off" ;;
    dynamic) echo "" ;;
    all-int8) echo "--set memory.stagehand.selective_precision.mode=static --set memory.stagehand.selective_precision.force_int8_blocks=[0,1,2,3,4,5]" ;;
  esac
}

commands=()
for mode in "${modes[@]}"; do
  for policy in bf16-only dynamic all-int8; do
    out=$runs$mode-$policy
    rm -rf "$out"
    # shellcheck disable=SC2046
    cmd="$sp_train --config configs/$( [[ $mode == full ]] && echo default || echo lora ).yaml --out $out --set train.calibration_cache_dir=$work/calibration-cache $(policy_args $policy) $extra_args"
    # LoRA adapts a trained base: by default the final weights of the full-mode BF16-only run.
    [[ $mode == lora ]] && cmd+=" --set train.init_checkpoint=$lora_base"
    echo "== $mode / $policy: $cmd"
    (cd "$repo" && $cmd)
    cp "$out/summary.json" "$results/$prefix-$mode-$policy.json"
    commands+=("$mode-$policy|${cmd//$repo\//}")
  done
  /usr/bin/python3 "$repo/runtime/sp_train/tools/plot_runs.py" --out "$results" --prefix "$prefix-$mode" \
    bf16-only="$runs$mode-bf16-only" dynamic="$runs$mode-dynamic" all-int8="$runs$mode-all-int8"
done

/usr/bin/python3 - "$results" "$prefix" "${commands[@]}" <<'PY'
import json, os, platform, subprocess, sys
results, prefix, *commands = sys.argv[1:]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
runs = {}
for entry in commands:
    name, command = entry.split("|", 1)
    summary = json.load(open(os.path.join(results, f"{prefix}-{name}.json")))
    runs[name] = {"command": command, "summary": summary}
machine = {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
           "load_average_at_end": os.getloadavg()}
doc = {"machine": machine, "runs": runs}
for mode in sorted({name.split("-", 1)[0] for name in runs}):
    base = runs[f"{mode}-bf16-only"]["summary"]
    for policy in ("dynamic", "all-int8"):
        s = runs[f"{mode}-{policy}"]["summary"]
        doc.setdefault("comparison", {})[f"{mode}-{policy}"] = {
            "val_loss_vs_bf16_only": s["final_val_loss"] / base["final_val_loss"] - 1.0,
            "h2d_bytes_vs_bf16_only": s["h2d_bytes"]["total"] / base["h2d_bytes"]["total"] - 1.0}
tmp = os.path.join(results, f"{prefix}-experiments.json.tmp")
with open(tmp, "w") as f:
    json.dump(doc, f, indent=2)
    f.write("\n")
os.replace(tmp, os.path.join(results, f"{prefix}-experiments.json"))
print(json.dumps(doc["comparison"], indent=2))
PY
