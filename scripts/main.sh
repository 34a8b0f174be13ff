#!/usr/bin/env bash
# The main job from a fresh Debian machine: installs packages, builds, and replays the
# bundled 48-block gradient trace through the Selective Precision plugin. The decisions go
# to out/replay/decisions.jsonl, the plugin's telemetry to out/replay/telemetry.jsonl.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
examples=runtime/sp_replay/examples
mkdir -p out/replay
rm -f out/replay/telemetry.jsonl
build/bin/sp-replay \
  --config "$examples/policy.yaml" \
  --blocks 48 \
  --trace "$examples/trace-48-blocks.jsonl" \
  --calibration "$examples/calibration-48-blocks.json" \
  --out out/replay/decisions.jsonl \
  --telemetry out/replay/telemetry.jsonl
