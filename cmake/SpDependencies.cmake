# fmt and spdlog, compiled into every binary that uses them (header-only), so that what the
# project builds (the Python extension, the policy plugin, sp-train, sp-replay, sp-bench) needs
# neither libfmt nor libspdlog at run time (docs/packaging.md):
#   selective_precision_fmt       fmt, header-only (FMT_HEADER_ONLY)
#   selective_precision_spdlog    spdlog, header-only, over that fmt
# Compiled in and hidden (the extension exports only its PyInit, the plugin only its entry
# symbol) rather than bundled as shared libraries: torch keeps its own fmt inside libtorch, and
# a copy that exports nothing cannot meet another library's fmt or spdlog in the same process.
# The plugin links no spdlog (its messages reach the host through the ABI), so one registry per
# binary changes no logging.
# yaml-cpp stays a shared library: Debian's libyaml-cpp.a is not position-independent, so no
# shared object can link it. The wheel carries it instead, renamed by auditwheel
# (scripts/install-package.sh), one copy that the extension and the plugin share.
find_package(yaml-cpp REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)

function(sp_interface_includes out target)
  get_target_property(dirs ${target} INTERFACE_INCLUDE_DIRECTORIES)
  if(NOT dirs)
    set(dirs "")
  endif()
  set(${out} ${dirs} PARENT_SCOPE)
endfunction()

add_library(selective_precision_fmt INTERFACE)
sp_interface_includes(sp_fmt_dirs fmt::fmt)
target_include_directories(selective_precision_fmt SYSTEM INTERFACE ${sp_fmt_dirs})
target_compile_definitions(selective_precision_fmt INTERFACE FMT_HEADER_ONLY=1)

add_library(selective_precision_spdlog INTERFACE)
sp_interface_includes(sp_spdlog_dirs spdlog::spdlog)
target_include_directories(selective_precision_spdlog SYSTEM INTERFACE ${sp_spdlog_dirs})
# Without SPDLOG_COMPILED_LIB spdlog is header-only; its fmt is the one above.
target_compile_definitions(selective_precision_spdlog INTERFACE SPDLOG_FMT_EXTERNAL)
target_link_libraries(selective_precision_spdlog INTERFACE selective_precision_fmt Threads::Threads)

set_target_properties(selective_precision_fmt PROPERTIES EXPORT_NAME fmt)
set_target_properties(selective_precision_spdlog PROPERTIES EXPORT_NAME spdlog)

# Binaries that others load or run (the extension, the plugins, the tools): the code of the
# static archives they link (the project's libraries, with the fmt and spdlog compiled into them)
# exports nothing.
set(SELECTIVE_PRECISION_HIDE_ARCHIVES "LINKER:--exclude-libs,ALL")
