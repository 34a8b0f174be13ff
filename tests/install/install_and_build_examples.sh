#!/usr/bin/env bash
# The package as a stranger uses it: builds and runs the examples from copies outside the source
# tree against an installed package alone:
#   - examples/plugin_host with LibTorch and CUDA hidden from CMake (the host component must
#     not need them);
#   - examples/llama_streamed (SelectivePrecision::torch), trained for a few steps, finding
#     LibTorch through the package (the torch it was built against), or through
#     torch.utils.cmake_prefix_path.
# Two installed packages:
#   - without <python>: the build installed to a temporary prefix by `cmake --install`, whose
#     layout is checked first;
#   - with <python>: the C++ package inside the Python wheel that <python>'s environment holds
#     (scripts/install-package.sh installs it into .venv), found through
#     CMAKE_PREFIX_PATH="selective_precision.cmake_prefix_path;torch.utils.cmake_prefix_path",
#     as docs/integration.md tells a pip user. Exits 77 (skipped) where that environment holds
#     no installed package (a build tree's package has no C++ package inside); with
#     SP_REQUIRE_WHEEL=1 (the test command sets it) that is a failure.
# Usage: install_and_build_examples.sh <build dir> <source dir> [<python>]
set -euo pipefail
build=$1
src=$2
python=${3:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ -n $python ]]; then
  prefix=$(cd "$work" && "$python" -c 'import selective_precision as sp, torch
print(sp.cmake_prefix_path + ";" + torch.utils.cmake_prefix_path if sp.cmake_prefix_path else "")' 2>/dev/null || true)
  if [[ -z $prefix ]]; then
    echo "no installed selective_precision in $python's environment (scripts/install-package.sh installs the wheel)"
    [[ ${SP_REQUIRE_WHEEL:-0} == 1 ]] && exit 1
    exit 77
  fi
  echo "the wheel's C++ package: CMAKE_PREFIX_PATH=$prefix"
  package=${prefix%%;*}
  layout=(lib/cmake/SelectivePrecision/SelectivePrecisionConfig.cmake plugins/libsp_selective_precision.so
          include/sp/plugin_abi_v1.h include/sp/torch_layer/streamed_model.h bin/sp-train)
else
  prefix=$work/prefix
  package=$prefix
  cmake --install "$build" --prefix "$prefix" >"$work/install.log"
  layout=(lib/cmake/SelectivePrecision/SelectivePrecisionConfig.cmake
          lib/cmake/SelectivePrecision/SelectivePrecisionConfigVersion.cmake
          lib/selective_precision/plugins/libsp_selective_precision.so
          include/sp/plugin_abi_v1.h include/sp/host/policy_session.h include/sp/adapters/streaming_engine.h
          include/sp/kernels/nf4.h include/sp/torch_layer/streamed_model.h
          bin/sp-train bin/sp-replay bin/sp-bench share/doc/selective_precision/integration.md)
fi
# The examples build with the build's compilers: a sanitized package's libraries bring their
# sanitizer's link option with them, which needs that compiler's runtime.
cache_value() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
consumer=(-DCMAKE_C_COMPILER="$(cache_value CMAKE_C_COMPILER)" -DCMAKE_CXX_COMPILER="$(cache_value CMAKE_CXX_COMPILER)")
for f in "${layout[@]}"; do
  [ -e "$package/$f" ] || { echo "not installed: $f (in $package)"; exit 1; }
done
# An installed sp-train finds the installed plugin by itself.
"$package/bin/sp-train" --help >/dev/null

cp -r "$src/examples/plugin_host" "$work/plugin_host-src"
cmake -S "$work/plugin_host-src" -B "$work/plugin_host" -DCMAKE_PREFIX_PATH="$prefix" "${consumer[@]}" \
  -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON --no-warn-unused-cli >"$work/plugin_host.log" 2>&1 || { cat "$work/plugin_host.log"; exit 1; }
cmake --build "$work/plugin_host" >>"$work/plugin_host.log" || { cat "$work/plugin_host.log"; exit 1; }
"$work/plugin_host/plugin_host"

cp -r "$src/examples/llama_streamed" "$work/llama-src"
sp_lines=$(grep -c '// \[sp\]' "$work/llama-src/main.cpp")
echo "llama_streamed: $sp_lines lines concern Selective Precision"
[ "$sp_lines" -le 30 ] || { echo "more than 30 Selective Precision lines"; exit 1; }
cmake -S "$work/llama-src" -B "$work/llama" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" "${consumer[@]}" \
  >"$work/llama.log" 2>&1 || { cat "$work/llama.log"; exit 1; }
cmake --build "$work/llama" >>"$work/llama.log" || { cat "$work/llama.log"; exit 1; }
# SelectivePrecision::torch names libstdc++ just before torch, so that the consumer's
# std::filesystem calls bind to it and not to the copy torch's library exports
# (cmake/SpTorch.cmake): a shared libstdc++ comes before libtorch in the dynamic section; a
# static one leaves no filesystem symbol for torch to serve.
if ! command -v readelf >/dev/null || ! command -v nm >/dev/null; then
  echo "readelf or nm not found (binutils): the link-order check of llama_streamed is not made here"
  needed=""
else
  needed=$(readelf -d "$work/llama/llama_streamed" | awk '/NEEDED/ {print $NF}')
fi
# (grep finds nothing where libstdc++ is linked statically: not a failure.)
stdcxx_at=$(echo "$needed" | { grep -n 'libstdc++' || true; } | head -n 1 | cut -d: -f1)
torch_at=$(echo "$needed" | { grep -n 'libtorch' || true; } | head -n 1 | cut -d: -f1)
if [ -z "$needed" ]; then
  :
elif [ -n "$stdcxx_at" ]; then
  [ "$stdcxx_at" -lt "$torch_at" ] || { echo "llama_streamed needs libtorch before libstdc++:" $needed; exit 1; }
elif nm -D --undefined-only "$work/llama/llama_streamed" | grep -q filesystem; then
  echo "llama_streamed links libstdc++ statically but imports std::filesystem, which torch would serve"
  exit 1
fi
"$work/llama/llama_streamed" 4
