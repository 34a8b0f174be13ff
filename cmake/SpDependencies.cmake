# fmt, spdlog and yaml-cpp, compiled once from Debian's source packages (the versions of the
# installed libfmt-dev, libspdlog-dev and libyaml-cpp-dev, with Debian's patches, which
# `scripts/install-deps.sh sources` unpacks into .deps/src) as static position-independent
# libraries:
#   selective_precision_fmt        fmt (format.cc, os.cc)
#   selective_precision_spdlog     spdlog's compiled library (SPDLOG_COMPILED_LIB) over that fmt
#   selective_precision_yaml_cpp   yaml-cpp
# Why from source: Debian ships libfmt and libspdlog as shared libraries only and its
# libyaml-cpp.a is not position-independent (no shared object can take it in). Static and
# position-independent, they go inside every binary the project ships (the Python extension,
# the policy plugin, the tools) and the archives of the installed C++ package, hidden (the
# extension exports only its PyInit, the plugin only its entry symbol): the wheel needs no
# library of theirs at run time, torch keeps its own fmt inside libtorch, and another library
# in the process with its own fmt, spdlog or yaml-cpp cannot bind to ours, nor ours to theirs.
# Compiled once rather than header-only: header-only fmt and spdlog doubled the compile of
# every unit that logs (docs/performance.md, "How long the set-up takes").
set(SP_DEPENDENCY_SOURCE_DIR "${PROJECT_SOURCE_DIR}/.deps/src" CACHE PATH
    "Where the sources of fmt, spdlog and yaml-cpp are (scripts/install-deps.sh sources puts Debian's there)")
foreach(sp_dependency IN ITEMS fmt spdlog yaml-cpp)
  if(NOT EXISTS "${SP_DEPENDENCY_SOURCE_DIR}/${sp_dependency}/CMakeLists.txt")
    message(FATAL_ERROR "SP_DEPENDENCY_SOURCE_DIR (${SP_DEPENDENCY_SOURCE_DIR}) holds no source of ${sp_dependency}: "
            "run `bash scripts/install-deps.sh sources`, which unpacks Debian's fmt, spdlog and yaml-cpp there, "
            "or set SP_DEPENDENCY_SOURCE_DIR to a folder holding fmt/, spdlog/ and yaml-cpp/")
  endif()
endforeach()
set(sp_fmt_source ${SP_DEPENDENCY_SOURCE_DIR}/fmt)
set(sp_spdlog_source ${SP_DEPENDENCY_SOURCE_DIR}/spdlog)
set(sp_yaml_cpp_source ${SP_DEPENDENCY_SOURCE_DIR}/yaml-cpp)

# torch's include directory holds the fmt headers torch was built with (fmt 12 in 2.15), as a
# system directory that can come before ours. A directory holding only a link to our fmt, given
# with -I (searched before every system directory), keeps the project's code, spdlog's sources
# and torch's own <fmt/...> includes on one fmt in every translation unit. torch's library keeps
# its fmt inside, under fmt's versioned namespace.
if(SP_HAVE_TORCH AND EXISTS ${TORCH_INSTALL_PREFIX}/include/fmt)
  set(sp_fmt_link_dir ${PROJECT_BINARY_DIR}/fmt-before-torch)
  file(MAKE_DIRECTORY ${sp_fmt_link_dir})
  file(REMOVE ${sp_fmt_link_dir}/fmt)
  file(CREATE_LINK ${sp_fmt_source}/include/fmt ${sp_fmt_link_dir}/fmt SYMBOLIC)
  include_directories(BEFORE ${sp_fmt_link_dir})
endif()

# The third-party headers the installed package carries (SpPackage.cmake installs them):
# nlohmann_json's, which the adapters' metrics.h includes, and fmt's and spdlog's, for a host
# that gives the layer or the plugin host a spdlog logger of its own: it links
# SelectivePrecision::spdlog, the compiled spdlog the libraries use. Each in a folder of its own,
# and no other target passes fmt's and spdlog's on (torch's include directory carries another fmt).
set(SP_INSTALL_THIRD_PARTY_INCLUDEDIR ${CMAKE_INSTALL_INCLUDEDIR}/selective_precision/third_party)
set(SP_INSTALL_JSON_INCLUDEDIR ${SP_INSTALL_THIRD_PARTY_INCLUDEDIR}/nlohmann_json)
set(SP_INSTALL_LOGGING_INCLUDEDIR ${SP_INSTALL_THIRD_PARTY_INCLUDEDIR}/spdlog)

add_library(selective_precision_fmt STATIC ${sp_fmt_source}/src/format.cc ${sp_fmt_source}/src/os.cc)
target_include_directories(selective_precision_fmt SYSTEM PUBLIC
  $<BUILD_INTERFACE:${sp_fmt_source}/include> $<INSTALL_INTERFACE:${SP_INSTALL_LOGGING_INCLUDEDIR}>)

set(sp_spdlog_sources spdlog.cpp stdout_sinks.cpp color_sinks.cpp file_sinks.cpp async.cpp cfg.cpp)
list(TRANSFORM sp_spdlog_sources PREPEND ${sp_spdlog_source}/src/)
add_library(selective_precision_spdlog STATIC ${sp_spdlog_sources})
target_include_directories(selective_precision_spdlog SYSTEM PUBLIC
  $<BUILD_INTERFACE:${sp_spdlog_source}/include> $<INSTALL_INTERFACE:${SP_INSTALL_LOGGING_INCLUDEDIR}>)
target_compile_definitions(selective_precision_spdlog PUBLIC SPDLOG_COMPILED_LIB SPDLOG_FMT_EXTERNAL)
target_link_libraries(selective_precision_spdlog PUBLIC selective_precision_fmt Threads::Threads)

file(GLOB sp_yaml_cpp_sources ${sp_yaml_cpp_source}/src/*.cpp ${sp_yaml_cpp_source}/src/contrib/*.cpp)
add_library(selective_precision_yaml_cpp STATIC ${sp_yaml_cpp_sources})
target_include_directories(selective_precision_yaml_cpp SYSTEM PUBLIC $<BUILD_INTERFACE:${sp_yaml_cpp_source}/include>)
target_include_directories(selective_precision_yaml_cpp PRIVATE ${sp_yaml_cpp_source}/src)
# Its static destructors (an iostreams initializer per unit, the scanner's function-local
# regular expressions) are registered through atexit(), which the policy plugin defines for
# itself and runs at its unload (plugin/selective_precision/src/unload_handlers.cpp); everywhere
# else atexit() is the C library's, as __cxa_atexit would have been.
target_compile_options(selective_precision_yaml_cpp PRIVATE -fno-use-cxa-atexit)

set_target_properties(selective_precision_fmt selective_precision_spdlog selective_precision_yaml_cpp PROPERTIES
  POSITION_INDEPENDENT_CODE ON
  CXX_VISIBILITY_PRESET hidden
  VISIBILITY_INLINES_HIDDEN ON)
set_target_properties(selective_precision_fmt PROPERTIES EXPORT_NAME fmt)
set_target_properties(selective_precision_spdlog PROPERTIES EXPORT_NAME spdlog)
set_target_properties(selective_precision_yaml_cpp PROPERTIES EXPORT_NAME yaml_cpp)

# nlohmann_json is header-only and named by the adapters' public headers (metrics.h): the
# installed package carries its headers beside fmt's and spdlog's, so that a consumer needs no
# Debian package of it.
find_package(nlohmann_json 3 REQUIRED)
add_library(selective_precision_json INTERFACE)
target_link_libraries(selective_precision_json INTERFACE $<BUILD_INTERFACE:nlohmann_json::nlohmann_json>)
target_include_directories(selective_precision_json SYSTEM INTERFACE $<INSTALL_INTERFACE:${SP_INSTALL_JSON_INCLUDEDIR}>)
set_target_properties(selective_precision_json PROPERTIES EXPORT_NAME json)

# Binaries that others load or run (the extension, the plugins, the tools): the code of the
# static archives they link (the project's libraries, fmt, spdlog and yaml-cpp) exports nothing.
set(SELECTIVE_PRECISION_HIDE_ARCHIVES "LINKER:--exclude-libs,ALL")
