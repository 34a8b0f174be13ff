#!/usr/bin/env bash
# Issue 31, section 3: every fine-tuning run, one at a time, then the summary.
#
#   bench/pretrained/run_finetune.sh OUT_DIR [SEEDS]      (SEEDS: default "0 1 2 3 4 5 6 7 8 9")
#
# 1. the pairs, frozen once in OUT_DIR/pairs.json (every run of the set reads the same ones);
# 2. v2's thresholds, chosen on the tune split (OUT_DIR/tune-v2.json; finetune.py --tune-v2);
# 3. per seed, the 8 policies in LoRA mode and the 7 of full mode (all-nf4-bnb is LoRA only),
#    one process a seed, one run at a time; a run whose JSON exists is skipped (finetune.py
#    writes each JSON whole, by rename), so the script resumes where it stopped;
# 4. bench/pretrained/summarize_seeds.py OUT_DIR.
# SP_STOP_AT=HH:MM (UTC): no new seed starts after that time (the summary covers what finished).
# Environment: PYTHON (default .venv/bin/python), PYTHONPATH (the package to use), SP_THREADS (1).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:?usage: run_finetune.sh OUT_DIR [SEEDS]}
seeds=${2:-0 1 2 3 4 5 6 7 8 9}
python=${PYTHON:-$root/.venv/bin/python}
threads=${SP_THREADS:-1}
export HF_HUB_OFFLINE=1
mkdir -p "$out"
log() { echo "[$(date -u +%H:%M:%S)] $*"; }

# SP_FINETUNE_ARGS: extra finetune.py arguments, for a smoke run only ("--steps 2 --pool 64").
# shellcheck disable=SC2086
ft() { "$python" "$here/finetune.py" --threads "$threads" --pairs-cache "$out/pairs.json" ${SP_FINETUNE_ARGS:-} "$@"; }

if [ ! -f "$out/tune-v2.json" ]; then
  log "v2's thresholds on the tune split"
  ft --tune-v2 --out "$out/tune-v2.json"
fi
for seed in $seeds; do
  if [ -n "${SP_STOP_AT:-}" ] && [ "$(date -u +%H:%M)" \> "$SP_STOP_AT" ]; then
    log "past $SP_STOP_AT: no new seed (seed $seed and later not run)"
    break
  fi
  log "seed $seed"
  ft --policy all --mode lora,full --seed "$seed" --thresholds "$out/tune-v2.json" --out-dir "$out"
done
log "summary"
"$python" "$here/summarize_seeds.py" "$out"
