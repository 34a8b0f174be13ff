#!/usr/bin/env bash
# Host memory and step time per rank: one process against two data-parallel ranks (torchrun,
# Gloo over the loopback) keeping every block's masters (replicated) or each rank those of
# every other block (sharded: train.data_parallel=sharded). The model is the default one
# widened to d_model 512, so that the fp32 masters, their gradients and AdamW's moments
# (16 bytes per streamed weight, 302 MB here) outweigh LibTorch's own resident memory.
# Global batch 16 in every setup (2 ranks x 8). Writes
# bench/results/train-data-parallel-sharded.json.
#
#   bash runtime/sp_train/tools/run_sharded_memory.sh [BUILD_DIR] [WORK_DIR] [--analyze-only]
set -euo pipefail

repo=$(cd "$(dirname "$0")/../../.." && pwd)
build=${1:-$repo/build}
work=${2:-$build/experiments}
sp_train=$build/bin/sp-train
common="--config configs/default.yaml --steps 24 --set model.d_model=512 --set model.n_heads=8
        --set train.eval_interval=1000 --set train.eval_batches=2 --set train.checkpoint_interval=0
        --set train.resume=never --set train.threads=1
        --set train.calibration_cache_dir=$work/calibration-cache-sharded"
if [[ ${3:-} != --analyze-only ]]; then
  cd "$repo"
  rm -rf "$work/dp-one" "$work/dp-replicated" "$work/dp-sharded"
  # The calibration is measured once, by the first run, and read from the cache by the others.
  # shellcheck disable=SC2086
  "$sp_train" $common --out "$work/dp-one"
  for mode in replicated sharded; do
    # shellcheck disable=SC2086
    "$repo/.venv/bin/torchrun" --no-python --nproc-per-node 2 --master-port 29533 "$sp_train" $common --out "$work/dp-$mode" \
      --set train.batch_size=8 --set train.data_parallel=$mode
  done
fi

PYTHONPATH="$repo/runtime/sp_train/tools" "$repo/.venv/bin/python" - "$work" "$repo/bench/results/train-data-parallel-sharded.json" "$common" <<'PY'
import json, os, statistics, sys
from run_records import jsonl, write_json
work, out, common = sys.argv[1], sys.argv[2], " ".join(sys.argv[3].split())
setups = {"one": ["dp-one"], "replicated": ["dp-replicated", "dp-replicated/rank1"],
          "sharded": ["dp-sharded", "dp-sharded/rank1"]}
result = {"command": f"bash runtime/sp_train/tools/run_sharded_memory.sh (sp-train {common}; "
                     "two ranks: torchrun --no-python --nproc-per-node 2 ... --set train.batch_size=8 "
                     "--set train.data_parallel=replicated|sharded)",
          "setups": {}}
for name, dirs in setups.items():
    ranks = []
    for d in dirs:
        summary = json.load(open(os.path.join(work, d, "summary.json")))
        steps = jsonl(os.path.join(work, d, "train_metrics.jsonl"))
        # Steps 4-23: after the first steps' allocations and the policy's warm-up.
        seconds = [r["seconds"] for r in steps if r["step"] >= 4]
        updates = [r["update_seconds"] for r in steps if r["step"] >= 4]
        ranks.append({"dir": d, "peak_rss_bytes": summary["peak_rss_bytes"],
                      "estimated_host_bytes": summary["estimated_host_bytes"],
                      "median_step_seconds": statistics.median(seconds),
                      "median_update_seconds": statistics.median(updates),
                      "final_val_loss": summary["final_val_loss"],
                      "losses": [r["loss"] for r in steps]})
    result["setups"][name] = {"ranks": ranks}
one = result["setups"]["one"]["ranks"][0]
for name in ("replicated", "sharded"):
    ranks = result["setups"][name]["ranks"]
    result["setups"][name]["losses_equal_to_replicated"] = (
        ranks[0]["losses"] == result["setups"]["replicated"]["ranks"][0]["losses"])
for name, setup in result["setups"].items():
    for r in setup["ranks"]:
        print(f'{name:10s} {r["dir"]:22s} peak RSS {r["peak_rss_bytes"] / 2**20:7.1f} MiB  estimate '
              f'{r["estimated_host_bytes"] / 2**20:7.1f} MiB  step {r["median_step_seconds"]:.3f} s (update {r["median_update_seconds"]:.3f} s)  '
              f'val {r["final_val_loss"]:.4f}')
        del r["losses"]
write_json(out, result)
print("wrote", out)
PY
