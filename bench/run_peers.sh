#!/usr/bin/env bash
# Our paths against the peers' own, side by side in one run (issue 32): one JSON per comparison
# in OUT_DIR, and OUT_DIR/peers.json, every comparison's rows together ({name, peer, ours,
# theirs, unit, ours_over_peer, goal, threads, command}; ours_over_peer > 1: ours is faster;
# goal null: a row for information).
# Built so far: the host optimizer (bench/peers/optimizer.py: torch's fused and foreach AdamW,
# DeepSpeed's CPU Adam, whose op it builds on first use, about 2 minutes), the NF4 and INT8
# formats (bench/peers/formats.py), and the cost of streaming (bench/peers/streaming.py: a
# LlamaForCausalLM's training step resident in fp32 and bf16, with a hand-written block swap, and
# through sp.stream() with BF16, INT8 and NF4 routes; about 4 minutes on 2 cores). Needs the
# installed package (scripts/install-package.sh) and the .venv's bitsandbytes, torchao, deepspeed
# and transformers.
#
#   bash bench/run_peers.sh OUT_DIR
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:?usage: bash bench/run_peers.sh OUT_DIR}
mkdir -p "$out"
python=.venv/bin/python
"$python" bench/peers/optimizer.py --out "$out/optimizer.json"
"$python" bench/peers/formats.py --out "$out/formats.json"
# SP_BENCH_COMPUTE=fp32 on a CPU without native bf16 matmuls (streaming.py --compute).
HF_HUB_OFFLINE=1 "$python" bench/peers/streaming.py --out "$out/streaming.json" --compute "${SP_BENCH_COMPUTE:-bf16}"
HF_HUB_OFFLINE=1 "$python" bench/peers/activation_memory.py --out "$out/activation-memory.json" \
  --compute "${SP_BENCH_COMPUTE:-bf16}"
"$python" - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = []
for name in sorted(os.listdir(out)):
    if name.endswith(".json") and name != "peers.json":
        with open(os.path.join(out, name), encoding="utf-8") as f:
            rows += json.load(f)["rows"]
with open(os.path.join(out, "peers.json.tmp"), "w", encoding="utf-8") as f:
    json.dump({"rows": rows}, f, indent=1)
os.replace(os.path.join(out, "peers.json.tmp"), os.path.join(out, "peers.json"))
print("%d rows in %s" % (len(rows), os.path.join(out, "peers.json")))
PY
