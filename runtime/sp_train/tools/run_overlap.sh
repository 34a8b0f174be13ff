#!/usr/bin/env bash
# The host optimizer after the backward (train.host_optimizer: fused) against the same sweep
# run during the backward (overlapped), in two settings:
#   optimizer-bound: d_model 1024, 16 heads, a batch of 1 x 16 tokens, so that each step's
#     AdamW over 75 M fp32 masters (about 2 GB through host memory) outweighs the compute, the
#     regime of a large model with a small batch;
#   compute-bound: the default config at d_model 512 (docs/performance.md's figure).
# Each setting runs fused, overlapped, fused, overlapped (this VM's speed drifts), 12 steps each
# with no evaluation and no checkpoint; steps 2-11 are compared (step 0 of the overlapped mode
# updates after the backward: it has no previous norm to clip by). The figure of merit is the
# share of the fused update that the overlap hid, (fused step - overlapped step) / fused
# update, taken in the same run. Writes bench/results/train-overlap.json.
#
#   bash runtime/sp_train/tools/run_overlap.sh [BUILD_DIR] [WORK_DIR]
set -euo pipefail

repo=$(cd "$(dirname "$0")/../../.." && pwd)
build=${1:-$repo/build}
work=${2:-$build/experiments}
sp_train=$build/bin/sp-train
[[ -x $sp_train ]] || { echo "$sp_train: not built (ninja -C $build sp-train)" >&2; exit 2; }
common="--config configs/default.yaml --steps 12 --set train.eval_interval=1000 --set train.checkpoint_interval=0
        --set train.resume=never --set memory.stagehand.selective_precision.mode=off"
declare -A settings=(
  [optimizer-bound]="--set model.d_model=1024 --set model.n_heads=16 --set model.seq_len=16 --set train.batch_size=1"
  [compute-bound]="--set model.d_model=512 --set model.n_heads=8"
)
for setting in optimizer-bound compute-bound; do
  for round in 1 2; do
    for optimizer in fused overlapped; do
      out=$work/overlap-$setting-$optimizer-$round
      rm -rf "$out"
      echo "== $setting / $optimizer / round $round"
      # shellcheck disable=SC2086
      (cd "$repo" && "$sp_train" $common ${settings[$setting]} --set train.host_optimizer=$optimizer --out "$out" \
        >"$out.log" 2>&1) || { tail -20 "$out.log" >&2; exit 1; }
    done
  done
done

/usr/bin/python3 - "$work" "$repo/bench/results/train-overlap.json" "$common" "${settings[optimizer-bound]}" \
  "${settings[compute-bound]}" <<'PY'
import json, os, statistics, sys
work, out, common, optimizer_bound, compute_bound = sys.argv[1:]
def steps(d):
    with open(os.path.join(d, "train_metrics.jsonl")) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if 2 <= r["step"] < 12]
doc = {"machine": {"cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                                if l.startswith("model name")), "?"), "cores": os.cpu_count()},
       "command": "build/bin/sp-train " + " ".join(common.split()) +
                  " <setting> --set train.host_optimizer=fused|overlapped --out <dir>",
       "settings": {"optimizer-bound": optimizer_bound, "compute-bound": compute_bound}, "results": {}}
for setting in ("optimizer-bound", "compute-bound"):
    r = {}
    for optimizer in ("fused", "overlapped"):
        records = [s for n in (1, 2) for s in steps(os.path.join(work, f"overlap-{setting}-{optimizer}-{n}"))]
        r[optimizer] = {"median_step_seconds": statistics.median(s["seconds"] for s in records),
                        "median_update_seconds": statistics.median(s["update_seconds"] for s in records),
                        "steps": len(records)}
    fused, overlapped = r["fused"], r["overlapped"]
    r["step_time_vs_fused"] = overlapped["median_step_seconds"] / fused["median_step_seconds"] - 1
    r["share_of_fused_update_hidden"] = ((fused["median_step_seconds"] - overlapped["median_step_seconds"]) /
                                         fused["median_update_seconds"])
    doc["results"][setting] = r
tmp = out + ".tmp"
with open(tmp, "w") as f:
    json.dump(doc, f, indent=2)
    f.write("\n")
os.replace(tmp, out)
print(json.dumps(doc["results"], indent=2))
PY
