#!/usr/bin/env bash
# The live upgrade of docs/results.md: a full-mode run starts on policy 1.0.0 (the 1.0.0
# edition built from the same sources, build/test-fixtures/libsp_selective_precision_v1.so),
# and at step SWAP_STEP the plugin file is replaced by 2.0.0 the way a deployment would do it
# (written aside, renamed in). sp-train sees the new file at the next step boundary and
# hot-swaps, migrating the policy state through export/import. A second run stays on 1.0.0
# throughout. Writes bench/results/train-live-upgrade.json and train-live-upgrade-loss.png.
#
#   bash runtime/sp_train/tools/run_live_upgrade.sh [BUILD_DIR] [WORK_DIR] [SWAP_STEP]
set -euo pipefail

repo=$(cd "$(dirname "$0")/../../.." && pwd)
build=${1:-$repo/build}
work=${2:-$build/experiments}
swap_step=${3:-80}
sp_train=$build/bin/sp-train
v1=$build/test-fixtures/libsp_selective_precision_v1.so
v2=$build/plugins/libsp_selective_precision.so
for f in "$sp_train" "$v1" "$v2"; do [[ -e $f ]] || { echo "$f: not built" >&2; exit 2; }; done
common="--config configs/default.yaml --set train.calibration_cache_dir=$work/calibration-cache"

for run in stay upgrade; do
  plugins=$work/live-$run-plugins
  rm -rf "$plugins" "$work/live-$run"
  mkdir -p "$plugins"
  cp "$v1" "$plugins/libsp_selective_precision.so"
  # shellcheck disable=SC2086
  (cd "$repo" && exec "$sp_train" $common --plugin-dir "$plugins" --out "$work/live-$run") &
  pid=$!
  if [[ $run == upgrade ]]; then
    metrics=$work/live-$run/train_metrics.jsonl
    until [[ -f $metrics ]] && (($(wc -l <"$metrics") >= swap_step)); do
      kill -0 "$pid" 2>/dev/null || { echo "sp-train ended before step $swap_step" >&2; exit 1; }
      sleep 0.2
    done
    cp "$v2" "$plugins/incoming.so"
    mv "$plugins/incoming.so" "$plugins/libsp_selective_precision.so"
  fi
  wait "$pid"
done

"$repo/.venv/bin/python" - "$work" "$repo/bench/results" "$common" <<'PY'
import json, os, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
work, results, common = sys.argv[1], sys.argv[2], " ".join(sys.argv[3].split())
def records(run):
    with open(os.path.join(work, f"live-{run}", "train_metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
stay, upgrade = records("stay"), records("upgrade")
swaps = [r for r in upgrade if "plugin_swap" in r]
same_decisions = all(a["decisions"] == b["decisions"] for a, b in zip(stay, upgrade))
same_loss = all(a["loss"] == b["loss"] for a, b in zip(stay, upgrade))
summary = lambda run: json.load(open(os.path.join(work, f"live-{run}", "summary.json")))
doc = {"command": f"bash runtime/sp_train/tools/run_live_upgrade.sh (sp-train {common})",
       "steps": [len(stay), len(upgrade)],
       "swap": swaps[0] if swaps else None,
       "versions_after": sorted({r["plugin_version"] for r in upgrade[-10:]}),
       "decisions_identical_every_step": same_decisions,
       "train_loss_identical_every_step": same_loss,
       "final_val_loss": {"stay_on_1.0.0": summary("stay")["final_val_loss"],
                          "upgraded_to_2.0.0": summary("upgrade")["final_val_loss"]}}
with open(os.path.join(results, "train-live-upgrade.json.tmp"), "w") as f:
    json.dump(doc, f, indent=2)
    f.write("\n")
os.replace(os.path.join(results, "train-live-upgrade.json.tmp"), os.path.join(results, "train-live-upgrade.json"))
fig, ax = plt.subplots(figsize=(8, 4))
ax.plot([r["step"] for r in stay], [r["loss"] for r in stay], label="stays on 1.0.0", alpha=0.8)
ax.plot([r["step"] for r in upgrade], [r["loss"] for r in upgrade], "--", label="upgraded live to 2.0.0", alpha=0.8)
for s in swaps:
    ax.axvline(s["step"], color="grey", linestyle=":", label=f"swap at step {s['step']}: {s['plugin_swap']}")
ax.set_xlabel("step")
ax.set_ylabel("train loss")
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(results, "train-live-upgrade-loss.png"), dpi=120)
print(json.dumps(doc, indent=2))
PY
