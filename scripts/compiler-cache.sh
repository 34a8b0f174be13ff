# Sourced by the build scripts (build.sh, tsan.sh, test.sh's fuzz build). Where ccache is
# installed (scripts/install-deps.sh installs it), every compile goes through it: a translation
# unit whose preprocessed text and flags were compiled before, in this tree or in another clone
# of the same commit, is not compiled again. Sets sp_compiler_launcher, the CMake arguments
# that say so; empty without ccache, and then the build is as it was.
#
# The settings travel in the launcher itself, so a later `ninja -C build` uses them too:
#   - base_dir = the checkout and hash_dir off: paths inside the tree are hashed relative to
#     it, so a clean clone elsewhere hits the cache. The cost: a cached object's debug
#     information names the directory of the clone that compiled it first;
#   - sloppiness pch_defines,time_macros (and the include times): what ccache needs to cache
#     a translation unit that uses a precompiled header (CMake's, SP_PRECOMPILE_HEADERS).
sp_compiler_launcher=()
if command -v ccache >/dev/null 2>&1; then
  sp_ccache=(/usr/bin/env "CCACHE_BASEDIR=$PWD" CCACHE_NOHASHDIR=true
             CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
             "$(command -v ccache)")
  sp_ccache_list=$(IFS=';' && echo "${sp_ccache[*]}")
  sp_compiler_launcher=("-DCMAKE_C_COMPILER_LAUNCHER=$sp_ccache_list"
                        "-DCMAKE_CXX_COMPILER_LAUNCHER=$sp_ccache_list"
                        "-DCMAKE_CUDA_COMPILER_LAUNCHER=$sp_ccache_list")
fi
