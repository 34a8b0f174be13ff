#!/usr/bin/env bash
# The tests of the code that runs on more than one thread, under ThreadSanitizer
# (docs/sanitizers.md): Clang, everything instrumented, in build-tsan/. No CUDA (nvcc's host
# compiler is GCC) and no Python module (the interpreter is not instrumented). A TSan report
# fails its test: a gtest binary, or an sp-train that a test runs, exits 66.
#
# Only the suites labelled `threads` are built and run (their gtest_discover_tests calls say
# so): the CPU kernels' parallel loops, the engines and host backend, the plugin host's
# watchdog and directory poll, the torch layer in both backward modes, sp-train end to end
# and on two ranks, the transfer gate and the hot-swap integration. The others (the policy,
# the YAML diagnostics, sp-replay, the CLIs, the model, the install test) run one thread and
# are covered by the normal suite; SP_TSAN_ALL=1 builds and runs everything, as before.
#
#   bash scripts/tsan.sh [--build-only | --test-only] [ctest arguments...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/compiler-cache.sh
jobs=$(nproc 2>/dev/null || echo 2)
build=true
test=true
# The test programs of the suites labelled `threads`; each brings the plugins, fixtures and
# tools its tests run (add_dependencies).
threaded_targets=()
for target in sp_kernels_cpu_tests sp_adapters_tests sp_host_tests sp_torch_layer_tests sp_train_e2e_tests \
  sp_train_data_parallel_tests sp_transfer_gate_e2e_tests sp_integration_tests; do
  threaded_targets+=(--target "$target")
done
labels=(-L threads)
[[ ${SP_TSAN_ALL:-0} == 1 ]] && labels=()
case ${1:-} in
  --build-only) test=false && shift ;;
  --test-only) build=false && shift ;;
esac
if [[ $build == true ]]; then
  CC=clang CXX=clang++ cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSP_SANITIZE_THREAD=ON \
    -DSP_ENABLE_CUDA=OFF -DSP_BUILD_PYTHON=OFF -DSP_BUILD_BENCH=OFF "${sp_compiler_launcher[@]}"
  if [[ ${SP_TSAN_ALL:-0} == 1 ]]; then
    cmake --build build-tsan -j "$jobs"
  else
    cmake --build build-tsan -j "$jobs" "${threaded_targets[@]}"
  fi
fi
# LibTorch, OpenBLAS and Gloo are not instrumented: their threads synchronize through atomics
# and spinning TSan cannot see, so the memory functions they call (free, memset, memcpy) would
# be reported against our accesses. Interceptors called from uninstrumented libraries are
# therefore ignored; every access of the project's own code is still checked.
if [[ $test == true ]]; then
  TSAN_OPTIONS="ignore_noninstrumented_modules=1 ${TSAN_OPTIONS:-}" \
    ctest --test-dir build-tsan --output-on-failure -j "$jobs" "${labels[@]}" "$@"
fi
