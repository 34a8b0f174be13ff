#!/usr/bin/env bash
# Installs what the build needs. Safe to run again: it asks apt only for what is missing, and
# pip only for what the venv does not already hold at the pinned version.
#   - apt: the Debian packages (as root or with sudo): compilers, ccache and the C++ libraries;
#     then (also alone, as `sources`) the sources: Debian's source packages of fmt, spdlog and yaml-cpp, of the versions
#     the installed -dev packages hold, unpacked with Debian's patches into .deps/src/. The build
#     compiles them once, as static position-independent libraries (cmake/SpDependencies.cmake),
#     which neither Debian package ships: so that the wheel, the plugin and the tools carry them
#     hidden inside, and no unit compiles fmt or spdlog header-only;
#   - venv: the project's virtual environment .venv, created with `python3` (SP_VENV_PYTHON to
#     choose another) and filled from requirements.txt, the one file that pins every version:
#     with `--python all` (the default) every package there, those of the tests, examples and
#     benchmarks too; with `--python torch` only PyPI's torch, whose LibTorch the C++ build
#     uses, and what torch needs, at requirements.txt's versions (what the main job needs).
#
#   bash scripts/install-deps.sh [apt|sources|venv|all] [--python all|torch]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

part=all
python_packages=all
while (($#)); do
  case $1 in
    apt | sources | venv | all) part=$1 ;;
    --python)
      [[ $# -ge 2 && ( $2 == all || $2 == torch ) ]] || {
        echo "install-deps: --python takes 'all' or 'torch', got '${2:-}'" >&2
        exit 2
      }
      python_packages=$2
      shift
      ;;
    *)
      echo "install-deps: unknown argument '$1' (expected apt, sources, venv or all, and --python all|torch)" >&2
      exit 2
      ;;
  esac
  shift
done

packages=(
  build-essential cmake ninja-build pkg-config
  libyaml-cpp-dev libspdlog-dev libfmt-dev libboost-dev libcli11-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev
  binutils
  # c10d's ProcessGroupGloo.hpp includes Gloo's headers. The torch wheel has Gloo compiled into
  # libtorch_cpu but ships none of its headers, and PyPI has no package that does: Debian's
  # are used for their declarations only, and nothing links Debian's Gloo (docs/integration.md).
  libgloo-dev
  # For a Debian python3 (a pyenv one brings its own): its venv module and headers.
  python3 python3-venv python3-dev
  # The libFuzzer harnesses (docs/fuzzing.md): Clang, and the package that holds
  # libclang_rt.fuzzer-x86_64.a and the sanitizer runtimes for it.
  clang libclang-rt-14-dev
  # Compiles a translation unit once per content: the build scripts use it when present.
  ccache
)

install_apt() {
  local missing=() as_root=() p
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then
    echo "install-deps: all ${#packages[@]} Debian packages present"
  else
    as_root=()
    [[ $(id -u) -eq 0 ]] || as_root=(sudo)
    echo "install-deps: installing ${missing[*]}"
    "${as_root[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

install_venv() {
  if [[ ! -x .venv/bin/python ]]; then
    echo "install-deps: creating .venv with ${SP_VENV_PYTHON:-python3} ($(command -v "${SP_VENV_PYTHON:-python3}"))"
    "${SP_VENV_PYTHON:-python3}" -m venv .venv
  fi
  local pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
  if [[ $python_packages == torch ]]; then
    # requirements.txt as constraints: torch and what it needs, each at its pinned version.
    "${pip[@]}" -c requirements.txt torch
  else
    "${pip[@]}" -r requirements.txt
  fi
  echo "install-deps: .venv holds $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)' 2>/dev/null)"
}

# The source package of each -dev package, at the version installed, into .deps/src/<name>
# (the name the build looks for). apt reads a source list of its own, in .deps/apt, so that the
# machine's apt configuration is left as it is; nothing is fetched for a tree already there.
fetch_sources() {
  local apt_dir=$PWD/.deps/apt dir=.deps/src name dev source version uri
  local apt=(apt-get -qq -o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$apt_dir/sources"
             -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o APT::Sandbox::User=root)
  # unpack_source <work dir> <source>=<version>: apt-get source into an empty work dir.
  unpack_source() { rm -rf "$1" && mkdir -p "$1" && (cd "$1" && "${apt[@]}" source "$2" >/dev/null); }
  mkdir -p "$dir"
  for name in fmt:libfmt-dev spdlog:libspdlog-dev yaml-cpp:libyaml-cpp-dev; do
    dev=${name#*:} name=${name%%:*}
    read -r source version < <(dpkg-query -W -f='${source:Package} ${source:Version}\n' "$dev")
    if [[ -f $dir/$name/.debian-version && $(cat "$dir/$name/.debian-version") == "$source $version" ]]; then
      continue
    fi
    if [[ ! -f $apt_dir/sources/debian-src.sources ]]; then
      mkdir -p "$apt_dir/sources" "$apt_dir/lists/partial" "$apt_dir/cache"
      uri=$( { sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true; } | head -n 1)
      printf 'Types: deb-src\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        "${uri:-http://deb.debian.org/debian}" "$(. /etc/os-release && echo "$VERSION_CODENAME")" >"$apt_dir/sources/debian-src.sources"
      "${apt[@]}" update
    fi
    # Unpacked beside the old tree, which is replaced only once the new one is there; a version
    # the lists do not know yet (Debian updated the -dev package) refreshes them once.
    if ! unpack_source "$apt_dir/work" "$source=$version" 2>/dev/null; then
      "${apt[@]}" update
      unpack_source "$apt_dir/work" "$source=$version" 2>&1 | { grep -v -e '^W: Download is performed unsandboxed' -e '^dpkg-source: info' || true; }
    fi
    rm -rf "$dir/$name"
    mv "$apt_dir/work"/*/ "$dir/$name"
    echo "$source $version" >"$dir/$name/.debian-version"
    rm -rf "$apt_dir/work"
    echo "install-deps: $name $version's source in $dir/$name"
  done
}

# One statement each: a function run on the left of && would run with set -e off.
case $part in
  apt) install_apt; fetch_sources ;;
  sources) fetch_sources ;;
  venv) install_venv ;;
  all) install_apt; fetch_sources; install_venv ;;
esac
