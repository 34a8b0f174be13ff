# LibTorch, from the torch of a Python: PyPI's wheel in the project's .venv (README), a GPU
# machine's own PyTorch, or whatever Torch_DIR / CMAKE_PREFIX_PATH name first.
#
# The oldest torch the project builds against is SP_TORCH_MINIMUM. The reason, from the code:
# a streamed block's recompute restores its forward's autocast state per device type
# (at::autocast::is_autocast_enabled(DeviceType), torch_layer/src/forward_state.cpp), which
# torch 2.4 introduced. (Before it, c10d's per-device getBackend, in collectives.h, set 2.0.)
# The C++ standard and ABI are taken from torch itself below, so nothing else pins it.
# PyPI's current release (requirements.txt) is what CI builds and tests against.
#
# Sets SP_HAVE_TORCH, SP_TORCH_VERSION, SP_TORCH_CXX11_ABI (0 or 1), SP_PYTHON (the
# interpreter whose torch this is), SP_PYTHON_TORCH_VERSION_FULL (its torch.__version__),
# SP_TORCH_PYBIND11_ABI (the pybind11 ABI tag a torch before pybind11 3 states;
# python/CMakeLists.txt), SP_WHEEL_CUDA_LIB_DIRS and SP_TORCH_SITE_RPATH (below).
set(SP_TORCH_MINIMUM 2.4)

set(SP_PYTHON "" CACHE FILEPATH
    "The Python whose torch gives LibTorch and hosts the Python module (default: Python3_EXECUTABLE, then the project's .venv, then python3 on the PATH)")
if(NOT SP_PYTHON)
  if(Python3_EXECUTABLE)
    set(sp_python ${Python3_EXECUTABLE})
  elseif(PROJECT_IS_TOP_LEVEL AND EXISTS ${PROJECT_SOURCE_DIR}/.venv/bin/python)
    set(sp_python ${PROJECT_SOURCE_DIR}/.venv/bin/python)
  else()
    find_program(sp_python NAMES python3 python)
  endif()
  set(SP_PYTHON ${sp_python} CACHE FILEPATH "" FORCE)
endif()

# One run gives the version, where its CMake package is, and pybind11's ABI tag where torch
# still publishes it (torch.utils.cpp_extension passed it before pybind11 3 made it implicit).
set(sp_probe [=[
import torch, torch.utils
c = torch._C
tag = [getattr(c, "_PYBIND11_" + k, None) for k in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI")]
print(torch.__version__, torch.utils.cmake_prefix_path, int(c._GLIBCXX_USE_CXX11_ABI), ",".join(tag) if None not in tag else "", sep="\n")
]=])
set(sp_torch_prefix "")
set(SP_TORCH_PYBIND11_ABI "")
if(SP_BUILD_TORCH STREQUAL "ON" OR SP_BUILD_TOOLS)
  set(sp_torch_required REQUIRED)
elseif(SP_BUILD_TORCH STREQUAL "AUTO")
  set(sp_torch_required QUIET)
endif()
if(NOT DEFINED sp_torch_required)
  # Neither the layer nor the tools are built (the fuzzing build): no torch.
elseif(SP_PYTHON)
  execute_process(COMMAND ${SP_PYTHON} -c "${sp_probe}" RESULT_VARIABLE sp_probe_result
                  OUTPUT_VARIABLE sp_probe_output ERROR_VARIABLE sp_probe_error OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(sp_probe_result EQUAL 0)
    string(REPLACE "\n" ";" sp_probe_output "${sp_probe_output}")
    # The full version (2.15.0+cu132) is what the Python module checks at import.
    list(GET sp_probe_output 0 SP_PYTHON_TORCH_VERSION_FULL)
    string(REGEX REPLACE "[+].*" "" sp_python_torch_version "${SP_PYTHON_TORCH_VERSION_FULL}")
    list(GET sp_probe_output 1 sp_torch_prefix)
    list(GET sp_probe_output 2 sp_python_torch_cxx11_abi)
    list(LENGTH sp_probe_output sp_probe_lines)
    if(sp_probe_lines GREATER 3)
      list(GET sp_probe_output 3 SP_TORCH_PYBIND11_ABI)
      string(REPLACE "," ";" SP_TORCH_PYBIND11_ABI "${SP_TORCH_PYBIND11_ABI}")
    endif()
  else()
    string(REGEX REPLACE ".*\n([^\n]+)\n?$" "\\1" sp_probe_error "${sp_probe_error}")
    set(sp_torch_missing "`import torch` fails in ${SP_PYTHON}: ${sp_probe_error}")
  endif()
else()
  set(sp_torch_missing "no Python was found (set SP_PYTHON)")
endif()

set(sp_torch_fix "bash scripts/install-deps.sh (the project's .venv, with requirements.txt's torch), or point SP_PYTHON at a Python whose torch is ${SP_TORCH_MINIMUM} or newer")

# torch's CMake package rewrites the caller's CUDA flags: it adds a -gencode for every
# architecture it was built for, and sets CMAKE_CUDA_ARCHITECTURES to OFF. The project's
# kernels keep their own (SpCuda.cmake), so both are restored after it.
set(sp_cuda_flags "${CMAKE_CUDA_FLAGS}")
set(sp_cuda_architectures "${CMAKE_CUDA_ARCHITECTURES}")
set(SP_HAVE_TORCH OFF)
if(DEFINED sp_torch_required)
  # No version in the call: a torch that is too old gets the message below, not CMake's.
  find_package(Torch CONFIG QUIET HINTS ${sp_torch_prefix})
  set(CMAKE_CUDA_FLAGS "${sp_cuda_flags}")
  set(CMAKE_CUDA_ARCHITECTURES "${sp_cuda_architectures}")
  if(Torch_FOUND)
    # TorchConfigVersion.cmake sets PACKAGE_VERSION, which find_package publishes as Torch_VERSION.
    set(SP_TORCH_VERSION ${Torch_VERSION})
    if(SP_TORCH_VERSION VERSION_LESS SP_TORCH_MINIMUM)
      message(FATAL_ERROR "Selective Precision needs torch ${SP_TORCH_MINIMUM} or newer; found ${SP_TORCH_VERSION} "
                          "(${Torch_DIR}). Fix: ${sp_torch_fix}")
    endif()
    set(SP_HAVE_TORCH ON)
    message(STATUS "Selective Precision: torch ${SP_TORCH_VERSION} from ${Torch_DIR} (Python: ${SP_PYTHON})")
  elseif(sp_torch_required STREQUAL "REQUIRED")
    if(NOT sp_torch_missing)
      set(sp_torch_missing "${SP_PYTHON}'s torch has no CMake package at ${sp_torch_prefix}")
    endif()
    message(FATAL_ERROR "Selective Precision needs LibTorch (torch ${SP_TORCH_MINIMUM} or newer) for sp-train, the "
                        "LibTorch layer and the Python module: ${sp_torch_missing}. Fix: ${sp_torch_fix}")
  endif()
endif()

if(SP_HAVE_TORCH)
  # Every target shares std::string and the containers with the layer's LibTorch code, so all
  # take torch's C++ ABI: TORCH_CXX_FLAGS' -D_GLIBCXX_USE_CXX11_ABI where its CMake package
  # states it (before 2.7, when wheels of either ABI existed), else what its Python reports.
  # Every C++ target also takes its C++ standard (the torch target's cxx_std_NN: C++20 in
  # current releases). The CUDA translation units stay C++17 (CMake 3.25 knows no C++20 flag
  # for nvcc): they share only raw pointers and streams with the rest.
  set(SP_TORCH_CXX11_ABI ${sp_python_torch_cxx11_abi})
  if(TORCH_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=([01])")
    set(SP_TORCH_CXX11_ABI ${CMAKE_MATCH_1})
  endif()
  if(NOT SP_TORCH_CXX11_ABI STREQUAL "")
    add_compile_definitions(_GLIBCXX_USE_CXX11_ABI=${SP_TORCH_CXX11_ABI})
  endif()
  get_target_property(sp_torch_features torch INTERFACE_COMPILE_FEATURES)
  if(sp_torch_features MATCHES "cxx_std_([0-9]+)" AND CMAKE_MATCH_1 GREATER CMAKE_CXX_STANDARD)
    set(CMAKE_CXX_STANDARD ${CMAKE_MATCH_1})
  endif()

  # A torch wheel's libtorch exports the static copy of std::filesystem it was built with. A
  # program that names torch before libstdc++ binds its own filesystem calls to that copy: torch
  # 2.11's remove_all called address 0 (sp_train_e2e_tests on an H100 host, 2026-11-26). So
  # every link names libstdc++ just before torch (SP_TORCH_LINK, in place of torch): a shared
  # libstdc++ then comes before torch in the program's dynamic section, and a static one (that
  # host's g++ links libstdc++.a) resolves the calls of every object and archive before it.
  # Installed consumers get the same through SelectivePrecision::torch.
  set(SP_TORCH_LINK stdc++ torch)

  # A wheel's CUDA libraries are PyPI packages beside torch (site-packages/nvidia/*/lib), which
  # torch's own libraries find through their RUNPATH. The linker looks in the consumer's RPATH
  # first, where the local toolkit's older copies are (libnccl.so.2 lacking symbols
  # libtorch_cuda needs), so it is pointed at the wheel's with -rpath-link. And torch's CMake
  # package links consumers against the local toolkit's libcudart (torch::cudart), which would
  # then load first and serve torch too: point it at the runtime torch was built for. (Not done
  # to a parent project's torch target.) An installed package's consumers get the -rpath-link
  # from the package config, for the torch it finds (cmake/SelectivePrecisionConfig.cmake.in).
  get_filename_component(sp_site_packages ${TORCH_INSTALL_PREFIX}/.. ABSOLUTE)
  file(GLOB SP_WHEEL_CUDA_LIB_DIRS LIST_DIRECTORIES true ${sp_site_packages}/nvidia/*/lib)
  file(GLOB sp_wheel_cudart ${sp_site_packages}/nvidia/*/lib/libcudart.so.[0-9]*)
  # Where an installed package's binaries find torch's libraries and its CUDA runtime, relative
  # to site-packages (python/CMakeLists.txt).
  set(SP_TORCH_SITE_RPATH torch/lib)
  foreach(dir IN LISTS SP_WHEEL_CUDA_LIB_DIRS)
    add_link_options(LINKER:-rpath-link,${dir})
  endforeach()
  if(sp_wheel_cudart AND TARGET torch::cudart AND PROJECT_IS_TOP_LEVEL)
    list(GET sp_wheel_cudart 0 sp_wheel_cudart)
    set_property(TARGET torch::cudart PROPERTY INTERFACE_LINK_LIBRARIES ${sp_wheel_cudart})
    get_filename_component(sp_wheel_cudart_dir ${sp_wheel_cudart} DIRECTORY)
    file(RELATIVE_PATH sp_wheel_cudart_dir ${sp_site_packages} ${sp_wheel_cudart_dir})
    list(APPEND SP_TORCH_SITE_RPATH ${sp_wheel_cudart_dir})
  endif()
  # An installed program finds them where they were linked from. (A wheel's programs look
  # relative to themselves first: python/CMakeLists.txt.) Set whoever configures, so that the
  # tree pip makes its wheel from (scripts/install-package.sh) installs as CMake's own does.
  list(TRANSFORM SP_TORCH_SITE_RPATH PREPEND ${sp_site_packages}/ OUTPUT_VARIABLE CMAKE_INSTALL_RPATH)
endif()

# LibTorch's headers: about 21 of the 50 CPU-seconds of a translation unit that includes
# <torch/torch.h> (GCC 12, -O2 -g). Precompiling them costs about 60 CPU-seconds and a 900 MB
# file, so it pays in a target with several such units (the layer's eight save about 100 s of a
# clean build) and is a loss in one with one or two. A unit whose flags differ from its target's
# (OpenMP, intra_op_pool.cpp) sets SKIP_PRECOMPILE_HEADERS. Off: every unit parses the headers.
option(SP_PRECOMPILE_HEADERS "Precompile LibTorch's headers for the LibTorch layer's translation units" ON)
function(selective_precision_precompile_torch_headers target)
  if(SP_PRECOMPILE_HEADERS)
    target_precompile_headers(${target} PRIVATE <torch/torch.h>)
  endif()
endfunction()
# selective_precision_reuse_torch_headers(<target>): a target whose units spend most of their
# compile in LibTorch's headers (the trainer's library, the layer's tests and reference program,
# the trainer's model test) loads the layer's precompiled headers instead: the flags are the
# same. Measured from a clean clone (docs/performance.md): the trainer's four units 197 -> 124
# CPU-seconds, while sp-train's main and the trainer's end-to-end test, which include less of
# LibTorch, took longer with them (22 -> 33 s, 17 -> 36 s) and do without. GCC only: Clang refuses a precompiled header whose
# macro definitions differ from the unit's at all (the ThreadSanitizer tree parses the headers).
# A program is compiled -fPIC like the layer's archive rather than -fPIE: GCC refuses a
# precompiled header made with the other (PIC code links into a PIE program as well).
function(selective_precision_reuse_torch_headers target)
  if(SP_PRECOMPILE_HEADERS AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    target_precompile_headers(${target} REUSE_FROM selective_precision_torch)
    get_target_property(type ${target} TYPE)
    if(type STREQUAL "EXECUTABLE")
      target_compile_options(${target} PRIVATE -fPIC)
    endif()
  endif()
endfunction()
