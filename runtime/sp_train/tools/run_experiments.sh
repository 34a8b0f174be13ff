#!/usr/bin/env bash
# The experiments of docs/results.md: the same seed and data under fixed formats (BF16-only,
# all-INT8, all-NF4, the first-and-last-BF16 heuristic) and the dynamic policy (v1: BF16 and
# INT8; v2: three tiers and the loss guard), in full mode from a random initialization and in
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
#   SP_POLICIES         the policies to run (default: all of policy_args below; bf16-only is
#                       the baseline every comparison divides by, so keep it in the list)
#   SP_REUSE=1          keep a run whose directory holds a summary.json made by the same
#                       command (command.txt), instead of running it again
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

source "$repo/runtime/sp_train/tools/policies.sh"
read -r -a policies <<<"${SP_POLICIES:-bf16-only all-int8 all-nf4 first-last-bf16 dynamic dynamic-v2}"

commands=()
for mode in "${modes[@]}"; do
  for policy in "${policies[@]}"; do
    out=$runs$mode-$policy
    # shellcheck disable=SC2046
    cmd="$sp_train --config configs/$( [[ $mode == full ]] && echo default || echo lora ).yaml --out $out --set train.calibration_cache_dir=$work/calibration-cache $(policy_args $policy) $extra_args"
    # LoRA adapts a trained base: by default the final weights of the full-mode BF16-only run.
    [[ $mode == lora ]] && cmd+=" --set train.init_checkpoint=$lora_base"
    if [[ ${SP_REUSE:-0} == 1 && -f $out/summary.json && $(cat "$out/command.txt" 2>/dev/null) == "$cmd" ]]; then
      echo "== $mode / $policy: reused $out"
    else
      rm -rf "$out"
      echo "== $mode / $policy: $cmd"
      (cd "$repo" && $cmd)
      echo "$cmd" >"$out/command.txt"
    fi
    cp "$out/summary.json" "$results/$prefix-$mode-$policy.json"
    commands+=("$mode-$policy|${cmd//$repo\//}")
  done
  plots=()
  for policy in "${policies[@]}"; do plots+=("$policy=$runs$mode-$policy"); done
  "$repo/.venv/bin/python" "$repo/runtime/sp_train/tools/plot_runs.py" --out "$results" --prefix "$prefix-$mode" "${plots[@]}"
done

"$repo/.venv/bin/python" - "$results" "$prefix" "${commands[@]}" <<'PY'
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
    for name in runs:
        if not name.startswith(mode + "-") or name == f"{mode}-bf16-only":
            continue
        s = runs[name]["summary"]
        doc.setdefault("comparison", {})[name] = {
            "val_loss_vs_bf16_only": s["final_val_loss"] / base["final_val_loss"] - 1.0,
            "h2d_bytes_vs_bf16_only": s["h2d_bytes"]["total"] / base["h2d_bytes"]["total"] - 1.0}
tmp = os.path.join(results, f"{prefix}-experiments.json.tmp")
with open(tmp, "w") as f:
    json.dump(doc, f, indent=2)
    f.write("\n")
os.replace(tmp, os.path.join(results, f"{prefix}-experiments.json"))
print(json.dumps(doc["comparison"], indent=2))

# The Pareto picture: final validation loss against H2D bytes (relative to BF16-only), per mode.
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
modes = sorted({name.split("-", 1)[0] for name in runs})
fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
for ax, mode in zip(axes[0], modes):
    base = runs[f"{mode}-bf16-only"]["summary"]
    for name, run in sorted(runs.items()):
        if not name.startswith(mode + "-"):
            continue
        s = run["summary"]
        x = s["h2d_bytes"]["total"] / base["h2d_bytes"]["total"]
        ax.plot(x, s["final_val_loss"], "o")
        ax.annotate(name.split("-", 1)[1], (x, s["final_val_loss"]), fontsize=8, xytext=(4, 4),
                    textcoords="offset points")
    ax.axhline(base["final_val_loss"] * 1.01, color="grey", linestyle=":", label="BF16-only + 1%")
    ax.axvline(0.5, color="grey", linestyle="--", label="50% fewer bytes")
    ax.set_xlabel("H2D bytes / BF16-only")
    ax.set_ylabel("final validation loss")
    ax.set_title(f"{mode} mode")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(results, f"{prefix}-pareto.png"), dpi=120)
PY
