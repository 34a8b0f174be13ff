#!/usr/bin/env bash
# The main job from a fresh Debian machine: installs what it needs (apt, and the .venv with
# PyPI's torch alone), builds what it runs (sp-train and the policy plugin, in build/), and
# trains a small GPT on /usr/share/common-licenses with every transformer block streamed
# through the adapters while the Selective Precision plugin moves blocks between BF16 and INT8
# (docs/training.md). Each stage prints its duration. The run directory out/main holds the
# summary, the telemetry, the metrics and a checkpoint; running the job again starts a fresh
# run there. Arguments go to sp-train.
#
# The Python package is not needed here and is not installed: `bash scripts/install-package.sh`
# installs it into .venv from the same build/ (the test command does), and
# `bash scripts/install-deps.sh venv` adds the Python packages of the tests and examples.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/stages.sh
sp_stage apt bash scripts/install-deps.sh apt
sp_stage venv bash scripts/install-deps.sh venv --python torch
sp_stage configure bash scripts/build.sh --configure
sp_stage build bash scripts/build.sh --target sp-train --target selective_precision_policy_plugin
sp_stage train build/bin/sp-train --config configs/default.yaml --out out/main --set train.resume=never "$@"
sp_stage_summary
echo "main: the Python package is not installed by this job: bash scripts/install-package.sh installs it into .venv"
