# Install rules and the CMake package: find_package(SelectivePrecision CONFIG) gives
#   SelectivePrecision::plugin_abi   the frozen C ABI header alone (for plugin authors)
#   SelectivePrecision::vocabulary   sp::Error and sp::Precision, the words every layer shares
#   SelectivePrecision::host         loads, drives and hot-swaps policy plugins
#   SelectivePrecision::kernels      CPU kernels and the slab format (::kernels_cuda: CUDA twins)
#   SelectivePrecision::adapters     the streaming engine (::adapters_cuda: its CUDA backend)
#   SelectivePrecision::torch        the LibTorch layer that streams any model
# Each component is its own export file, loaded with only the dependencies it needs, so a
# plugin author's find_package(SelectivePrecision COMPONENTS plugin_abi) needs nothing else
# and one of host needs neither LibTorch nor CUDA.
#
# The package's own files (headers, archives, the CMake files) are the install component
# `development`; the Python wheel installs that component inside the package
# (python/CMakeLists.txt), where selective_precision.cmake_prefix_path finds it. The plugins,
# tools, configs and docs are the component `runtime`. `cmake --install` without --component
# installs both.
include(CMakePackageConfigHelpers)

set(SP_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/SelectivePrecision)
set(SP_INSTALL_PLUGINDIR ${CMAKE_INSTALL_LIBDIR}/selective_precision/plugins)
set(SP_INSTALL_DOCDIR ${CMAKE_INSTALL_DATADIR}/doc/selective_precision)
set(SP_INSTALL_DATADIR ${CMAKE_INSTALL_DATADIR}/selective_precision)

# selective_precision_install_component(<component> TARGETS ... [HEADERS dir...])
function(selective_precision_install_component component)
  cmake_parse_arguments(ARG "" "" "TARGETS;HEADERS" ${ARGN})
  foreach(target IN LISTS ARG_TARGETS)
    get_target_property(type ${target} TYPE)
    if(NOT type STREQUAL "INTERFACE_LIBRARY")  # the interface targets are headers that say their own standard
      # The public headers are C++17: a consumer compiles them with at least that.
      target_compile_features(${target} INTERFACE cxx_std_17)
      # The installed libraries of a sanitized build call into the sanitizer's runtime.
      if(SELECTIVE_PRECISION_SANITIZER_LINK_OPTION)
        target_link_options(${target} INTERFACE "$<INSTALL_INTERFACE:${SELECTIVE_PRECISION_SANITIZER_LINK_OPTION}>")
      endif()
    endif()
  endforeach()
  install(TARGETS ${ARG_TARGETS} EXPORT SelectivePrecision_${component}
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT development
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT development
    INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  foreach(dir IN LISTS ARG_HEADERS)
    install(DIRECTORY ${dir}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT development FILES_MATCHING PATTERN "*.h")
  endforeach()
  install(EXPORT SelectivePrecision_${component}
    NAMESPACE SelectivePrecision::
    FILE SelectivePrecision_${component}.cmake
    DESTINATION ${SP_INSTALL_CMAKEDIR} COMPONENT development)
endfunction()

# The compiled fmt, spdlog and yaml-cpp and the JSON headers (SpDependencies.cmake): every static
# library's link interface names them, so they are exported first, in a file of their own, as
# archives of the package's own names (libselective_precision_fmt.a, ...), with the headers of
# nlohmann_json, fmt and spdlog under include/selective_precision/third_party (SpDependencies.cmake
# says who includes them) and every licence beside the docs.
install(TARGETS selective_precision_fmt selective_precision_spdlog selective_precision_yaml_cpp selective_precision_json
  EXPORT SelectivePrecision_dependencies ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT development)
install(EXPORT SelectivePrecision_dependencies
  NAMESPACE SelectivePrecision::
  FILE SelectivePrecision_dependencies.cmake
  DESTINATION ${SP_INSTALL_CMAKEDIR} COMPONENT development)
get_target_property(sp_json_include nlohmann_json::nlohmann_json INTERFACE_INCLUDE_DIRECTORIES)
list(GET sp_json_include 0 sp_json_include)
install(DIRECTORY ${sp_json_include}/nlohmann DESTINATION ${SP_INSTALL_JSON_INCLUDEDIR} COMPONENT development)
install(DIRECTORY ${sp_fmt_source}/include/fmt ${sp_spdlog_source}/include/spdlog
  DESTINATION ${SP_INSTALL_LOGGING_INCLUDEDIR} COMPONENT development)
install(FILES ${sp_fmt_source}/LICENSE.rst DESTINATION ${SP_INSTALL_DOCDIR}/third_party/fmt COMPONENT development)
install(FILES ${sp_spdlog_source}/LICENSE DESTINATION ${SP_INSTALL_DOCDIR}/third_party/spdlog COMPONENT development)
install(FILES ${sp_yaml_cpp_source}/LICENSE DESTINATION ${SP_INSTALL_DOCDIR}/third_party/yaml-cpp COMPONENT development)
if(EXISTS /usr/share/doc/nlohmann-json3-dev/copyright)
  install(FILES /usr/share/doc/nlohmann-json3-dev/copyright DESTINATION ${SP_INSTALL_DOCDIR}/third_party/nlohmann_json
          COMPONENT development)
endif()

set(SP_PACKAGE_COMPONENTS plugin_abi vocabulary host kernels adapters)
selective_precision_install_component(plugin_abi TARGETS selective_precision_plugin_abi
  HEADERS ${PROJECT_SOURCE_DIR}/plugin_abi/include)
selective_precision_install_component(vocabulary TARGETS selective_precision_vocabulary
  HEADERS ${PROJECT_SOURCE_DIR}/vocabulary/include)
selective_precision_install_component(host TARGETS selective_precision_host HEADERS ${PROJECT_SOURCE_DIR}/host_api/include)
set(sp_kernel_targets selective_precision_kernels)
# input_files (whole-file reads, typed JSON fields) is a private link dependency of the static
# adapters library, exported with it; its headers are not installed.
set(sp_adapter_targets selective_precision_adapters selective_precision_input_files)
if(SP_HAVE_CUDA)
  list(APPEND sp_kernel_targets selective_precision_kernels_cuda)
  list(APPEND sp_adapter_targets selective_precision_adapters_cuda)
endif()
selective_precision_install_component(kernels TARGETS ${sp_kernel_targets} HEADERS ${PROJECT_SOURCE_DIR}/kernels/include)
selective_precision_install_component(adapters TARGETS ${sp_adapter_targets} HEADERS ${PROJECT_SOURCE_DIR}/adapters/include)
if(SP_HAVE_TORCH)
  list(APPEND SP_PACKAGE_COMPONENTS torch)
  selective_precision_install_component(torch TARGETS selective_precision_torch
    HEADERS ${PROJECT_SOURCE_DIR}/torch_layer/include)
endif()

install(TARGETS selective_precision_policy_plugin selective_precision_example_minimal_c
  LIBRARY DESTINATION ${SP_INSTALL_PLUGINDIR} COMPONENT runtime)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/docs/ DESTINATION ${SP_INSTALL_DOCDIR} COMPONENT runtime)
install(FILES ${PROJECT_SOURCE_DIR}/README.md DESTINATION ${SP_INSTALL_DOCDIR} COMPONENT runtime)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/configs/ DESTINATION ${SP_INSTALL_DATADIR}/configs COMPONENT runtime)
if(SP_BUILD_TOOLS)
  install(TARGETS sp-train sp-replay sp-bench RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)
endif()

# Whether the layer's archive calls into torch's libgomp (torch_layer/CMakeLists.txt): the config
# then links the libgomp of the torch a consumer finds, never this machine's path.
set(SP_PACKAGE_TORCH_OPENMP OFF)
if(SP_HAVE_TORCH AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND SP_TORCH_LIBGOMP)
  set(SP_PACKAGE_TORCH_OPENMP ON)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/SelectivePrecisionConfig.cmake.in
  ${PROJECT_BINARY_DIR}/SelectivePrecisionConfig.cmake
  INSTALL_DESTINATION ${SP_INSTALL_CMAKEDIR}
  PATH_VARS SP_INSTALL_PLUGINDIR)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/SelectivePrecisionConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  # Before 1.0 a minor release may break the API: only the same 0.x is compatible.
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/SelectivePrecisionConfig.cmake
              ${PROJECT_BINARY_DIR}/SelectivePrecisionConfigVersion.cmake
        DESTINATION ${SP_INSTALL_CMAKEDIR} COMPONENT development)
