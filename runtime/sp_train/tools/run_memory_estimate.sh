#!/usr/bin/env bash
# The host memory estimate (summary.json: estimated_host_bytes, what the process held before it
# built the model plus estimated_host_bytes() of trainer.cpp) against the measured peak RSS, on
# five shapes of the default model, each run three times: with glibc's defaults; with
# MALLOC_MMAP_THRESHOLD_=1048576, under which glibc maps every block of 1 MiB or more on its own
# and returns it when freed (its heap keeps none of them); and with gperftools' tcmalloc
# preloaded (apt install libtcmalloc-minimal4). 8 steps each, one thread. Writes
# bench/results/train-memory-estimate.json.
#
#   bash runtime/sp_train/tools/run_memory_estimate.sh [BUILD_DIR] [WORK_DIR] [--analyze-only]
set -euo pipefail

repo=$(cd "$(dirname "$0")/../../.." && pwd)
build=${1:-$repo/build}
work=${2:-$build/experiments}/memory-estimate
tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
allocators="glibc-default mmap-1mib tcmalloc"
common="--config configs/default.yaml --steps 8 --set train.eval_interval=1000 --set train.eval_batches=2
        --set train.checkpoint_interval=0 --set train.resume=never --set train.threads=1
        --set train.calibration_cache_dir=$work/calibration-cache"
shapes=(
  "d512:--set model.d_model=512 --set model.n_heads=8"
  "d512-lora:--set model.d_model=512 --set model.n_heads=8 --set train.mode=lora"
  "d512-sublayer:--set model.d_model=512 --set model.n_heads=8 --set model.streaming_unit=sublayer"
  "d256-batch32:--set model.d_model=256 --set model.n_heads=4 --set train.batch_size=32"
  "d768-4blocks-batch8:--set model.d_model=768 --set model.n_heads=12 --set model.n_blocks=4 --set train.batch_size=8"
)
if [[ ${3:-} != --analyze-only ]]; then
  [[ -f $tcmalloc ]] || { echo "$tcmalloc is missing: apt install libtcmalloc-minimal4" >&2; exit 1; }
  cd "$repo"
  for entry in "${shapes[@]}"; do
    name=${entry%%:*}
    for allocator in $allocators; do
      rm -rf "${work:?}/$name-$allocator"
      setting=()
      [[ $allocator == mmap-1mib ]] && setting=(MALLOC_MMAP_THRESHOLD_=1048576)
      [[ $allocator == tcmalloc ]] && setting=(LD_PRELOAD="$tcmalloc")
      # shellcheck disable=SC2086
      env "${setting[@]}" "$build/bin/sp-train" $common ${entry#*:} --out "$work/$name-$allocator" >/dev/null
    done
  done
fi

PYTHONPATH="$repo/runtime/sp_train/tools" "$repo/.venv/bin/python" - "$work" "$repo/bench/results/train-memory-estimate.json" \
  "$common" "${shapes[@]}" <<'PY'
import json, os, statistics, sys
from run_records import jsonl, write_json
work, out, common, shapes = sys.argv[1], sys.argv[2], " ".join(sys.argv[3].split()), sys.argv[4:]
result = {"command": f"bash runtime/sp_train/tools/run_memory_estimate.sh (sp-train {common} <shape>, "
                     "with glibc's defaults, with MALLOC_MMAP_THRESHOLD_=1048576, and with "
                     "LD_PRELOAD=libtcmalloc_minimal.so.4)",
          "runs": []}
for entry in shapes:
    name, args = entry.split(":", 1)
    row = {"shape": name, "args": args}
    for allocator in ("glibc-default", "mmap-1mib", "tcmalloc"):
        d = os.path.join(work, f"{name}-{allocator}")
        summary = json.load(open(os.path.join(d, "summary.json")))
        steps = jsonl(os.path.join(d, "train_metrics.jsonl"))
        row[allocator] = {"peak_rss_bytes": summary["peak_rss_bytes"],
                          "estimated_host_bytes": summary["estimated_host_bytes"],
                          "estimate_over_peak": round(summary["estimated_host_bytes"] / summary["peak_rss_bytes"], 3),
                          "median_step_seconds": statistics.median(r["seconds"] for r in steps if r["step"] >= 4)}
    result["runs"].append(row)
    print(f'{name:20s} estimate {row["glibc-default"]["estimated_host_bytes"] / 2**20:6.0f} MiB', end="")
    for allocator in ("glibc-default", "mmap-1mib", "tcmalloc"):
        r = row[allocator]
        print(f' | {allocator}: peak {r["peak_rss_bytes"] / 2**20:5.0f} MiB ({r["estimate_over_peak"]:.2f}), '
              f'step {r["median_step_seconds"]:.3f} s', end="")
    print()
write_json(out, result)
print("wrote", out)
PY
