#!/usr/bin/env bash
# The host optimizer after the backward (train.host_optimizer: fused) against the same sweep
# run during the backward (overlapped), in two settings:
#   small-batch: d_model 1024, 16 heads, one sequence of 16 tokens per step: the AdamW sweep
#     over 75 M fp32 masters is the largest share of the step this CPU-only machine can give
#     it (about 15%: the streaming of the blocks' images, which computes on the same cores,
#     takes most of the rest);
#   default-batch: the default config at d_model 512 (docs/performance.md's figure), where the
#     update is about 1% of the step.
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
  [small-batch]="--set model.d_model=1024 --set model.n_heads=16 --set model.seq_len=16 --set train.batch_size=1"
  [default-batch]="--set model.d_model=512 --set model.n_heads=8"
)
for setting in small-batch default-batch; do
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

"$repo/.venv/bin/python" - "$work" "$repo/bench/results/train-overlap.json" "$common" "${settings[small-batch]}" \
  "${settings[default-batch]}" <<'PY'
import json, os, statistics, sys
work, out, common, small_batch, default_batch = sys.argv[1:]
def steps(d):
    with open(os.path.join(d, "train_metrics.jsonl")) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if 2 <= r["step"] < 12]
doc = {"machine": {"cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                                if l.startswith("model name")), "?"), "cores": os.cpu_count()},
       "command": "build/bin/sp-train " + " ".join(common.split()) +
                  " <setting> --set train.host_optimizer=fused|overlapped --out <dir>",
       "settings": {"small-batch": small_batch, "default-batch": default_batch}, "results": {}}
for setting in ("small-batch", "default-batch"):
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
