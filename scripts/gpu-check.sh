#!/usr/bin/env bash
# The checks a lent GPU machine is for (../shared/gpu/README.md), in two calls that each fit the
# device tool's 10 minutes. That machine has nvcc, CMake, ninja and its own PyTorch (the
# python3 on its PATH, with pytest), and no registry. First, here:
#
#   ../shared/gpu/fetch-debs.sh libgloo-dev
#
# (the C++ libraries as Debian packages, and Gloo's headers, which c10d's ProcessGroupGloo.hpp
# includes and no torch wheel ships), then on the device, carrying .deps:
#
#   source .deps/device-env.sh && bash scripts/gpu-check.sh suite   # build, whole suite, GPU required
#   source .deps/device-env.sh && bash scripts/gpu-check.sh bench   # every benchmark (after suite)
#   source .deps/device-env.sh && bash scripts/gpu-check.sh claim   # issue 41's GPU claim (after suite)
#
# Builds once into build-gpu/ (kept on the machine between calls), Hopper only, against the
# machine's torch (SP_PYTHON: its python3; the project's .venv does not travel). Writes the logs
# and the benchmarks' JSON under $OUT (the device tool's folder that comes back; default
# gpu-out/), each JSON with the commit; copy the JSON to bench/results/ and commit it. A step
# that fails is logged and the next one still runs; the exit status counts the failures.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-$PWD/gpu-out}
build=build-gpu
jobs=$(nproc 2>/dev/null || echo 8)
# The device's copy of the tree has no .git: the caller passes the commit it sent (SP_COMMIT).
commit=${SP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$out"
failures=0

# A lease is short: each step is stopped after SP_STEP_SECONDS (default 300), so that one that
# hangs costs its own result and not the others'.
step() {  # step NAME COMMAND...: runs it, its output to $out/NAME.log, and says how it ended
  local name=$1
  shift
  local start=$SECONDS
  timeout --kill-after=10 "${SP_STEP_SECONDS:-300}" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  printf '%-28s rc %-3d %4ds\n' "$name" "$rc" $((SECONDS - start)) | tee -a "$out/steps.txt"
  if [[ $rc != 0 ]]; then
    failures=$((failures + 1))
    tail -n 40 "$out/$name.log"
  fi
  return $rc
}

case ${1:-} in
  suite)
    {
      nvidia-smi || true
      echo "commit $commit"
    } >"$out/machine.txt" 2>&1
    # The packages from .deps, by the CMake variable (a ';' list). device-env.sh exports the
    # environment variable with ';', which CMake reads as one path: on 2026-11-26 the machine's
    # own GTest 1.14, yaml-cpp 0.8 and spdlog 1.12 were linked while CPATH gave the carried
    # 1.12, 0.7 and 1.10 headers, the likely cause of the death tests' crashes and a hot-swap
    # test's heap growth there, which only that machine showed.
    prefix_path=${CMAKE_PREFIX_PATH:-}
    step configure cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_PREFIX_PATH="${prefix_path//:/;}" \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DSP_ENABLE_CUDA=ON -DSP_WARNINGS_AS_ERRORS=OFF -DSP_PYTHON="$(command -v python3)" || exit 1
    # The Python packages the Hugging Face tests import, from wheels carried in .deps/wheels
    # (docs: ../shared/gpu/README.md), into the user site of the machine's python3.
    if [[ -d .deps/wheels ]]; then
      step wheels python3 -m pip install --user --no-index --find-links .deps/wheels transformers
    fi
    # configure.log says which torch was found and whether the NCCL group is built. Every target
    # that compiles is built (ninja -k 0), and the suite runs even when one did not: a lease is
    # too short to spend a second on a build error in one test program, which then costs only
    # that program's tests (ctest reports them "Not Run").
    step build cmake --build "$build" -j "$jobs" -- -k 0
    # The suite with GPU tests required: a skip for want of a device fails.
    SP_REQUIRE_GPU=1 step ctest ctest --test-dir "$build" --output-on-failure -j "$jobs" \
      --output-junit "$out/ctest-junit.xml"
    grep -E "tests passed|tests failed|Failed|\*\*\*" "$out/ctest.log" | tail -n 40
    ;;
  bench)
    [[ -x $build/bin/sp-bench-kernels-gpu ]] || { echo "build-gpu/ is not built: run 'suite' first" >&2; exit 1; }
    step kernels-gpu "$build/bin/sp-bench-kernels-gpu" --commit "$commit" --output "$out/kernels-gpu.json"
    step adapters-gpu "$build/bin/sp-bench-adapters" --backend cuda --commit "$commit" --out "$out/adapters-gpu.json"
    step transfer-report "$build/bin/sp-bench" transfer --backend cuda --max-kib 131072 --repeats 5 --gpt-d-model 2048 4096 \
      --out "$out/transfer-report-gpu.json"
    step transfer-policy "$build/bin/sp-bench" merge-policy --reports "$out/transfer-report-gpu.json" \
      --output "$out/transfer-policy-gpu.json"
    # The host-side benchmarks again, on this machine's CPU (its figures are the GPU host's).
    step optimizer "$build/bin/sp-bench-optimizer" --commit "$commit" --output "$out/optimizer-gpu-host.json"
    step plugin "$build/bin/sp-bench-plugin" --commit "$commit" --out "$out/plugin-gpu-host.json"
    # The trainer on the device: the default job, BF16-only against the default policy and v2.
    source runtime/sp_train/tools/policies.sh
    for policy in bf16-only dynamic dynamic-v2; do
      # shellcheck disable=SC2046
      step "train-cuda-$policy" "$build/bin/sp-train" --config configs/default.yaml --set train.device=cuda \
        --set train.resume=never --out "$out/train-cuda-$policy" $(policy_args "$policy") &&
        cp "$out/train-cuda-$policy/summary.json" "$out/train-cuda-$policy.json"
    done
    ;;
  claim)
    # Issue 41's GPU claim: a 1.9 B-parameter Llama-style model streamed on the device, against
    # resident and a musubi-style block swap, LoRA and full (bench/peers/gpu_claim.py, about 6
    # minutes on an H100). Needs build-gpu/'s Python module (run 'suite' first).
    [[ -d $build/python/selective_precision ]] || { echo "build-gpu/ is not built: run 'suite' first" >&2; exit 1; }
    PYTHONPATH="$PWD/$build/python" SP_PLUGIN_DIR="$PWD/$build/plugins" SP_STEP_SECONDS=${SP_STEP_SECONDS:-540} \
      step gpu-claim python3 bench/peers/gpu_claim.py --out "$out/gpu-claim.json" --commit "$commit"
    ;;
  *)
    echo "usage: bash scripts/gpu-check.sh suite|bench|claim   (after: source .deps/device-env.sh)" >&2
    exit 2
    ;;
esac
echo "$failures step(s) failed; logs and JSON in $out"
exit $((failures > 0))
