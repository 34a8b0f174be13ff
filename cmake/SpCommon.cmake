# Compile rules shared by every target of the project.

# Project code is warning-clean. Third-party headers come in as SYSTEM includes. Warnings fail
# the project's own builds; a build by pip (another compiler may warn about new things) or as
# a subproject only shows them.
option(SP_WARNINGS_AS_ERRORS "Fail the build on a compiler warning" ${PROJECT_IS_TOP_LEVEL})
add_library(selective_precision_warnings INTERFACE)
target_compile_options(selective_precision_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:C,CXX>:-Wall -Wextra>
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
if(SP_WARNINGS_AS_ERRORS)
  target_compile_options(selective_precision_warnings INTERFACE
    $<$<COMPILE_LANGUAGE:C,CXX>:-Werror> $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Werror --Werror=all-warnings>)
endif()

# What a sanitized build links with: also what a consumer of its installed package must link
# with (SpPackage.cmake puts it on the exported libraries).
set(SELECTIVE_PRECISION_SANITIZER_LINK_OPTION "")
if(SP_SANITIZE)
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=address,undefined>
                      $<$<COMPILE_LANGUAGE:C,CXX>:-fno-omit-frame-pointer>
                      $<$<COMPILE_LANGUAGE:C,CXX>:-fno-sanitize-recover=undefined>)
  set(SELECTIVE_PRECISION_SANITIZER_LINK_OPTION -fsanitize=address,undefined)
endif()
if(SP_SANITIZE_THREAD)
  if(SP_SANITIZE)
    message(FATAL_ERROR "SP_SANITIZE and SP_SANITIZE_THREAD cannot be combined")
  endif()
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=thread> $<$<COMPILE_LANGUAGE:C,CXX>:-fno-omit-frame-pointer>)
  set(SELECTIVE_PRECISION_SANITIZER_LINK_OPTION -fsanitize=thread)
endif()
if(SELECTIVE_PRECISION_SANITIZER_LINK_OPTION)
  add_link_options(${SELECTIVE_PRECISION_SANITIZER_LINK_OPTION})
endif()

# Code that ends up in a plugin a host dlclose()s must not hold STB_GNU_UNIQUE symbols (glibc
# would mark the library NODELETE). GCC makes inline statics unique unless told not to; Clang
# never emits them and does not know the flag.
set(SELECTIVE_PRECISION_NO_GNU_UNIQUE "$<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>>:-fno-gnu-unique>")

# selective_precision_add_plugin(<target> SOURCES ... [OUTPUT_DIR dir] [OUTPUT_NAME name])
#
# A policy plugin is a MODULE library that a host dlopen()s and later dlclose()s
# during a hot swap. Three rules keep that unload real (docs/plugin-abi.md):
#   - hidden visibility and a version script: only the versioned entry symbol is exported;
#   - -fno-gnu-unique: inline statics must not become STB_GNU_UNIQUE, which would make
#     glibc mark the library NODELETE;
#   - the plugin is linked with --no-undefined so a missing symbol fails the build, not the load.
function(selective_precision_add_plugin target)
  cmake_parse_arguments(ARG "" "OUTPUT_DIR;OUTPUT_NAME;ENTRY_SYMBOL" "SOURCES" ${ARGN})
  if(NOT ARG_OUTPUT_DIR)
    set(ARG_OUTPUT_DIR ${SP_PLUGIN_OUTPUT_DIR})
  endif()
  if(NOT ARG_ENTRY_SYMBOL)
    set(ARG_ENTRY_SYMBOL sp_policy_plugin_v1)
  endif()
  add_library(${target} MODULE ${ARG_SOURCES})
  set(version_script ${CMAKE_CURRENT_BINARY_DIR}/${target}.map)
  file(WRITE ${version_script} "{\n  global: ${ARG_ENTRY_SYMBOL};\n  local: *;\n};\n")
  set_target_properties(${target} PROPERTIES
    PREFIX "lib"
    C_VISIBILITY_PRESET hidden
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON
    LIBRARY_OUTPUT_DIRECTORY ${ARG_OUTPUT_DIR}
    LINK_DEPENDS ${version_script})
  if(ARG_OUTPUT_NAME)
    set_target_properties(${target} PROPERTIES OUTPUT_NAME ${ARG_OUTPUT_NAME})
  endif()
  target_compile_options(${target} PRIVATE ${SELECTIVE_PRECISION_NO_GNU_UNIQUE})
  # Under a sanitizer the plugin calls into the sanitizer's runtime, which the executable holds.
  target_link_options(${target} PRIVATE
    -Wl,--version-script=${version_script}
    $<$<NOT:$<OR:$<BOOL:${SP_SANITIZE}>,$<BOOL:${SP_SANITIZE_THREAD}>,$<BOOL:${SP_BUILD_FUZZERS}>>>:-Wl,--no-undefined>)
  target_link_libraries(${target} PRIVATE selective_precision_warnings)
  target_link_libraries(${target} PRIVATE selective_precision_plugin_abi)
endfunction()
