# Sourced by install-package.sh and check-wheel.sh: the shared libraries that torch's wheel and
# the NVIDIA wheels hold in a venv's site-packages ($1). They belong to the torch the user
# installs: the wheel never carries them, and they are the only outside libraries it may need.

# Their directories, one per line.
torch_library_dirs() {
  local dir
  for dir in "$1"/torch/lib "$1"/nvidia/*/lib; do
    [[ -d $dir ]] && echo "$dir"
  done
  return 0
}

# Their file names (their sonames), one per line.
torch_library_names() {
  local dir lib
  while read -r dir; do
    for lib in "$dir"/*.so*; do
      [[ -f $lib ]] && basename "$lib"
    done
  done < <(torch_library_dirs "$1")
  return 0
}
