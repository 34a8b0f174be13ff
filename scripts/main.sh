#!/usr/bin/env bash
# The main job from a fresh Debian machine: installs packages (apt, and the .venv with PyPI's
# torch), builds, installs the Python package into the .venv, and trains a small GPT
# on /usr/share/common-licenses with every transformer block streamed through the adapters
# while the Selective Precision plugin moves blocks between BF16 and INT8 (docs/training.md).
# The run directory out/main holds the summary, the telemetry, the metrics and a checkpoint;
# running the job again starts a fresh run there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
bash scripts/install-package.sh
build/bin/sp-train --config configs/default.yaml --out out/main --set train.resume=never "$@"
