#!/usr/bin/env bash
# The wheel as a stranger meets it (docs/packaging.md), after scripts/install-package.sh made it
# in build/wheel/:
#   1. `auditwheel show`: the tag is manylinux, and the only shared libraries it needs from
#      outside the wheel are torch's and the NVIDIA wheels' (the torch the user installs) and
#      the C and C++ runtimes that every manylinux system has;
#   2. a fresh virtual environment holding only the wheel's requirements (the pinned torch,
#      pyyaml, numpy) and pytest, as `pip install` leaves them (scripts/stranger_venv.py), into
#      which pip installs the wheel; `pip check` confirms its metadata is met;
#   3. the tools through their console entry points, then the package's pytest, run from /tmp in
#      a mount namespace where Debian's yaml-cpp, spdlog and fmt cannot be loaded: every one of
#      their files is covered by /dev/null, which the dynamic loader refuses ("file too short").
#      A first step proves the hiding works by loading each library by name and expecting the
#      refusal;
#   4. in the same namespace, with Debian's headers and CMake files of fmt, spdlog, yaml-cpp and
#      nlohmann_json hidden too (an empty tmpfs over each folder), an outside CMake project,
#      examples/plugin_host, builds against the wheel's C++ package through
#      selective_precision.cmake_prefix_path, and runs the wheel's policy plugin. Before that,
#      the package's CMake files are read for any path of the machine that built them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
python=$root/.venv/bin/python
wheel=$(ls "$root"/build/wheel/selective_precision-*manylinux*.whl 2>/dev/null || true)
[[ -n $wheel ]] || { echo "check-wheel: no manylinux wheel in build/wheel: run scripts/install-package.sh first" >&2; exit 1; }

site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
"$python" -m auditwheel show --json "$wheel" >build/wheel/auditwheel-show.json
source scripts/torch-libraries.sh
torch_library_names "$site" >build/wheel/torch-libraries.txt
"$python" - "$wheel" build/wheel/torch-libraries.txt build/wheel/auditwheel-show.json <<'PY'
import glob, json, os, re, sys
wheel, report = sys.argv[1], json.load(open(sys.argv[3]))
torchs = set(open(sys.argv[2]).read().split())
foreign = sorted(set(report["external_libs"]) - torchs)
# The tag its symbol versions admit; the overall one is linux_x86_64 only because torch's
# libraries are outside any policy, and those are left to the user's torch on purpose.
tag = report["sym_tag"]
glibcxx = max((tuple(map(int, v.split("_")[1].split("."))) for v in report["versioned_symbols"].get("libstdc++.so.6", []) if v.startswith("GLIBCXX_")), default=None)
glibc = max((tuple(map(int, v.split("_")[1].split("."))) for v in report["versioned_symbols"].get("libc.so.6", []) if v.startswith("GLIBC_")), default=None)
print("check-wheel: %s: tag %s, needs glibc %s and libstdc++ GLIBCXX_%s; from torch's wheels: %s" % (os.path.basename(wheel), tag,
      ".".join(map(str, glibc)) if glibc else "?", ".".join(map(str, glibcxx)) if glibcxx else "?",
      ", ".join(sorted(set(report["external_libs"]) & torchs))))
if not tag.startswith("manylinux_") or tag.replace("manylinux_", "").split("_x86_64")[0] not in os.path.basename(wheel):
    sys.exit("check-wheel: the wheel is not tagged for its policy %s" % tag)
if foreign:
    sys.exit("check-wheel: the wheel needs libraries neither it nor torch carries: %s" % ", ".join(foreign))
import zipfile
with zipfile.ZipFile(wheel) as archive:
    carried = sorted(os.path.basename(n) for n in archive.namelist() if ".libs/" in n)
print("check-wheel: libraries auditwheel copied in: %s" % (", ".join(carried) or "none"))

# What each binary exports: the extension its PyInit alone, the plugin its entry symbol alone,
# the tools nothing of fmt, spdlog, yaml-cpp or the project.
import io, zipfile
from elftools.elf.elffile import ELFFile
allowed = {"_selective_precision": lambda n: n.startswith("PyInit_"), "libsp_selective_precision": lambda n: n == "sp_policy_plugin_v1"}
leaks = []
with zipfile.ZipFile(wheel) as archive:
    for name in archive.namelist():
        data = archive.read(name)
        if not data.startswith(b"\x7fELF"):
            continue
        dynsym = ELFFile(io.BytesIO(data)).get_section_by_name(".dynsym")
        exported = {s.name for s in dynsym.iter_symbols() if s["st_shndx"] != "SHN_UNDEF" and s.name
                    and s["st_info"]["bind"] in ("STB_GLOBAL", "STB_WEAK") and s["st_info"]["type"] in ("STT_FUNC", "STT_OBJECT")
                    and s["st_other"]["visibility"] == "STV_DEFAULT"}
        rule = next((r for key, r in allowed.items() if os.path.basename(name).startswith(key)), None)
        if rule is not None:
            extra = sorted(n for n in exported if not rule(n))
        else:
            extra = sorted(n for n in exported if any(k in n for k in ("fmt", "spdlog", "YAML", "_ZN2sp")))
        if extra:
            leaks.append("%s exports %d symbols it should not, e.g. %s" % (name, len(extra), ", ".join(extra[:3])))
        else:
            print("check-wheel: %s exports %s" % (name, ", ".join(sorted(exported)) if rule else "nothing of fmt, spdlog or the project"))
if leaks:
    sys.exit("check-wheel: " + "; ".join(leaks))
PY

# The C++ package inside the wheel names no file of this machine: its archives and headers are
# its own, and torch is found where the consumer's CMAKE_PREFIX_PATH says (the one path of this
# machine it keeps is a HINTS of last resort for torch, the torch it was built against).
"$python" - "$wheel" "$root" <<'PY'
import os, sys, zipfile
wheel, root = sys.argv[1], sys.argv[2]
site = os.path.dirname(os.path.dirname(__import__("torch").__file__))
with zipfile.ZipFile(wheel) as archive:
    cmake_files = [n for n in archive.namelist() if "/lib/cmake/SelectivePrecision/" in n]
    if not any(n.endswith("/SelectivePrecisionConfig.cmake") for n in cmake_files):
        sys.exit("check-wheel: the wheel holds no C++ package (lib/cmake/SelectivePrecision/SelectivePrecisionConfig.cmake)")
    for name in cmake_files:
        for number, line in enumerate(archive.read(name).decode().splitlines(), 1):
            if "HINTS" in line and "Torch" in line:
                continue
            for machine_path in (root, site, "/usr/include", "/usr/lib"):
                if machine_path in line:
                    sys.exit("check-wheel: %s:%d names %s, a path of the machine that built it: %s" % (name, number, machine_path, line.strip()))
print("check-wheel: the C++ package's %d CMake files name no path of this machine" % len(cmake_files))
PY

venv=$root/build/wheel/stranger-venv
"$python" scripts/stranger_venv.py "$venv" "torch==$("$python" -c 'import torch; print(torch.__version__.split("+")[0])')" \
  pyyaml numpy pytest | cut -c1-200
"$python" -m pip --python "$venv/bin/python" install --quiet --disable-pip-version-check --no-index --no-deps "$wheel"
"$python" -m pip --python "$venv/bin/python" check

# Every file of Debian's yaml-cpp, spdlog and fmt (the links resolve to them).
hidden=()
for lib in /usr/lib/x86_64-linux-gnu/lib{yaml-cpp,spdlog,fmt}.so*; do
  [[ -e $lib ]] && hidden+=("$(readlink -f "$lib")")
done
mapfile -t hidden < <(printf '%s\n' "${hidden[@]}" | sort -u)
namespace=(unshare --mount --propagation private)
[[ $(id -u) -eq 0 ]] || namespace=(unshare --map-root-user --mount --propagation private)
echo "check-wheel: hiding ${hidden[*]}"
# Their headers and CMake packages, and nlohmann_json's, for the outside CMake project.
hidden_dirs=()
for dir in /usr/include/{fmt,spdlog,yaml-cpp,nlohmann} /usr/lib/x86_64-linux-gnu/cmake/{fmt,spdlog,yaml-cpp} \
           /usr/share/cmake/nlohmann_json /usr/lib/cmake/nlohmann_json; do
  [[ -d $dir ]] && hidden_dirs+=("$dir")
done
# The one test that compares with the C++ layer's own run (SP_TORCH_LAYER_REFERENCE) skips here:
# that program is the build tree's, not the wheel's; ctest runs it.
OMP_NUM_THREADS=1 "${namespace[@]}" bash -c '
  set -euo pipefail
  venv=$1 tests=$2 examples=$3 hidden_dirs=$4
  shift 4
  for file in "$@"; do mount --bind /dev/null "$file"; done
  "$venv/bin/python" - <<PY
import ctypes
for name in ("libyaml-cpp.so.0.7", "libspdlog.so.1.10", "libfmt.so.9"):
    try:
        ctypes.CDLL(name)
    except OSError as refused:
        print("check-wheel: %s cannot be loaded here (%s)" % (name, refused))
    else:
        raise SystemExit("check-wheel: %s still loads: the namespace hides nothing" % name)
PY
  cd /tmp
  # The tools, through the console entry points pip put in the venv (bin/).
  for tool in sp-train sp-replay sp-bench; do
    "$venv/bin/$tool" --help >/dev/null || { echo "check-wheel: $tool --help failed" >&2; exit 1; }
  done
  echo "check-wheel: sp-train, sp-replay and sp-bench run from $venv/bin"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "$tests"

  IFS=: read -r -a dirs <<<"$hidden_dirs"
  for dir in "${dirs[@]}"; do mount -t tmpfs -o ro,size=4k none "$dir"; done
  echo "check-wheel: hiding ${dirs[*]}"
  prefix=$("$venv/bin/python" -c "import selective_precision as sp, torch; print(sp.cmake_prefix_path + \";\" + torch.utils.cmake_prefix_path)")
  work=$(mktemp -d)
  trap "rm -rf $work" EXIT
  cp -r "$examples/plugin_host" "$work/src"
  if ! { cmake -S "$work/src" -B "$work/build" -DCMAKE_PREFIX_PATH="$prefix" && cmake --build "$work/build"; } >"$work/log" 2>&1; then
    cat "$work/log"
    echo "check-wheel: examples/plugin_host did not build against the C++ package in the wheel ($prefix)" >&2
    exit 1
  fi
  "$work/build/plugin_host" >/dev/null
  echo "check-wheel: examples/plugin_host built against the C++ package in the wheel ($prefix) and ran its plugin"
' check-wheel "$venv" "$root/python/tests" "$root/examples" "$(IFS=:; echo "${hidden_dirs[*]}")" "${hidden[@]}"
