#!/usr/bin/env bash
# The loss guard in a training run: a policy that scores blocks on their gradients alone (the
# seed's "gradient-only signal", error_weight 0) sends the one sensitive block, the outlier
# block 2 of the wide outlier experiment's trained base, to NF4 at its first decision step;
# the guard is to see the loss rise, blame that move and send the block back to BF16. LoRA
# mode on that base, so that the damage of a 4-bit base block shows at once and lasts (the
# base is frozen); the other five blocks are NF4 from step 0, outside the blame window.
# The same run with the guard off is the control. The base carries its outlier channel already
# (model.outliers is not given again: planting it a second time would scale it by 1024 once
# more), and LoRA's learning rate is 2e-3 instead of lora.yaml's 1e-2, under which this wider
# base's loss jumps to 6 at the end of the warm-up and the guard sees nothing but that.
# Writes bench/results/train-loss-guard.json.
#
#   bash runtime/sp_train/tools/run_loss_guard.sh [BUILD_DIR] [WORK_DIR]
#
# The base is the full-mode BF16-only run of docs/results.md's "nf4-wide-outliers2" set
# (SP_LORA_BASE to use another checkpoint of a d_model 256 model).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../../.." && pwd)
build=${1:-$repo/build}
work=${2:-$build/experiments}
sp_train=$build/bin/sp-train
base=${SP_LORA_BASE:-$work/nf4-wide-outliers2-full-bf16-only/checkpoint.bin}
[[ -x $sp_train ]] || { echo "$sp_train: not built (ninja -C $build sp-train)" >&2; exit 2; }
[[ -f $base ]] || { echo "$base: no base checkpoint (run the nf4-wide-outliers2 set first, docs/results.md)" >&2; exit 2; }
p=memory.stagehand.selective_precision
common="--config configs/lora.yaml --set train.init_checkpoint=$base --set train.calibration_cache_dir=$work/calibration-cache
        --set model.d_model=256 --set train.lr=2e-3
        --set $p.tiers=[bf16,int8,nf4] --set $p.grad_weight=1 --set $p.error_weight=0
        --set $p.grad_sensitivity_threshold=1000 --set $p.force_nf4_blocks=[0,1,3,4,5] --set $p.warmup_steps=30
        --set $p.loss_guard.window=20 --set $p.loss_guard.sigmas=3 --set $p.loss_guard.min_rise=0.05
        --set $p.loss_guard.blame_steps=10 --set $p.loss_guard.penalty_steps=100"
for guard in on off; do
  out=$work/loss-guard-$guard
  rm -rf "$out"
  echo "== guard $guard"
  # shellcheck disable=SC2086
  (cd "$repo" && "$sp_train" $common --set $p.loss_guard.enabled=$([[ $guard == on ]] && echo true || echo false) \
    --out "$out")
done

/usr/bin/python3 - "$work" "$repo/bench/results/train-loss-guard.json" "$common" <<'PY'
import json, os, sys
work, out, common = sys.argv[1], sys.argv[2], " ".join(sys.argv[3].split())
def jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
runs = {}
for guard in ("on", "off"):
    d = os.path.join(work, f"loss-guard-{guard}")
    steps = jsonl(os.path.join(d, "train_metrics.jsonl"))
    telemetry = jsonl(os.path.join(d, "selective_precision_telemetry.jsonl"))
    runs[guard] = {
        "summary": json.load(open(os.path.join(d, "summary.json"))),
        "block2_route_by_step": [s["routes"][2] for s in steps],
        "loss_by_step": [s["loss"] for s in steps],
        "spikes": [{"step": t["step_id"], **t["loss_spike"]} for t in telemetry if t.get("loss_spike")],
        "block2_moves": [],
    }
    previous = None
    for t in telemetry:
        b2 = t["block_details"]["2"]
        if b2["precision"] != previous:
            runs[guard]["block2_moves"].append({"step": t["step_id"], "precision": b2["precision"],
                                                "reason": b2["reason"]})
        previous = b2["precision"]
doc = {"command": f"build/bin/sp-train {common} --set memory.stagehand.selective_precision.loss_guard.enabled="
                  "true|false --out <dir>", "runs": runs}
tmp = out + ".tmp"
with open(tmp, "w") as f:
    json.dump(doc, f, indent=2)
    f.write("\n")
os.replace(tmp, out)
for guard, r in runs.items():
    print(guard, "final val", r["summary"]["final_val_loss"], "spikes", r["spikes"], "block 2 moves", r["block2_moves"])
PY
