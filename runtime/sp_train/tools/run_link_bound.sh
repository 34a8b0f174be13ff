#!/usr/bin/env bash
# Step time when the link, not the compute, is the bottleneck: the host backend paces every
# copy to 5 MB/s, so one all-BF16 step's 4.3 MB of transfers take longer than its compute.
# BF16-only against dynamic Selective Precision (v1: BF16/INT8; v2: three tiers and the loss
# guard), 40 steps each; steps 20-39 (after the policy's first decision at step 10 has settled)
# are compared. Writes bench/results/train-link-bound.json.
#
#   bash runtime/sp_train/tools/run_link_bound.sh [BUILD_DIR] [WORK_DIR] [--analyze-only]
set -euo pipefail

repo=$(cd "$(dirname "$0")/../../.." && pwd)
build=${1:-$repo/build}
work=${2:-$build/experiments}
sp_train=$build/bin/sp-train
source "$repo/runtime/sp_train/tools/policies.sh"
common="--config configs/default.yaml --steps 40 --set train.eval_interval=1000
        --set memory.stagehand.streaming.bandwidth_cap_gbps=0.005
        --set train.calibration_cache_dir=$work/calibration-cache"
if [[ ${3:-} != --analyze-only ]]; then
  for policy in bf16-only dynamic dynamic-v2; do
    extra=$(policy_args "$policy")
    rm -rf "$work/link-$policy"
    # shellcheck disable=SC2086
    (cd "$repo" && "$sp_train" $common --out "$work/link-$policy" $extra)
  done
fi

PYTHONPATH="$repo/runtime/sp_train/tools" "$repo/.venv/bin/python" - "$work" "$repo/bench/results/train-link-bound.json" "$common" <<'PY'
import json, os, sys
from run_records import jsonl, write_json
work, out, common = sys.argv[1], sys.argv[2], " ".join(sys.argv[3].split())
runs = {}
for policy in ("bf16-only", "dynamic", "dynamic-v2"):
    d = os.path.join(work, f"link-{policy}")
    steps = [r for r in jsonl(os.path.join(d, "train_metrics.jsonl")) if 20 <= r["step"] < 40]
    transfer = [r for r in jsonl(os.path.join(d, "transfer_metrics.jsonl")) if 20 <= r["step"] < 40]
    n = len(steps)
    runs[policy] = {
        "steps_compared": n,
        "mean_step_seconds": sum(r["seconds"] for r in steps) / n,
        "mean_h2d_bytes_per_step": sum(v for r in steps for k, v in r.items() if k.startswith("h2d_bytes_") and k != "h2d_bytes_all_bf16") / n,
        "mean_copy_seconds_per_step": sum(r["copy_seconds"] for r in transfer) / n,
        "mean_dequant_seconds_per_step": sum(r["dequant_seconds"] for r in transfer) / n,
        "prefetch_hits": sum(r["prefetch"]["hits"] for r in transfer),
        "prefetch_misses": sum(r["prefetch"]["misses"] for r in transfer),
        "stalls": sum(r["stalls"]["count"] for r in transfer),
        "summary": json.load(open(os.path.join(d, "summary.json"))),
    }
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
doc = {"machine": {"cpu": cpu, "cores": os.cpu_count()},
       "command": f"build/bin/sp-train {common} --out <dir> $(policy_args bf16-only|dynamic|dynamic-v2), "
                  "policy_args from runtime/sp_train/tools/policies.sh",
       "link_bytes_per_second": 0.005e9, "runs": runs}
base = runs["bf16-only"]
for policy in ("dynamic", "dynamic-v2"):
    doc[f"{policy}_step_time_vs_bf16_only"] = runs[policy]["mean_step_seconds"] / base["mean_step_seconds"] - 1
    doc[f"{policy}_bytes_vs_bf16_only"] = runs[policy]["mean_h2d_bytes_per_step"] / base["mean_h2d_bytes_per_step"] - 1
write_json(out, doc)
print(json.dumps({k: {m: v for m, v in r.items() if m != "summary"} for k, r in runs.items()}, indent=2))
print("dynamic step time vs bf16-only:", doc["dynamic_step_time_vs_bf16_only"])
PY
