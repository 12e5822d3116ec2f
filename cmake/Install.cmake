# Install rules and the CMake package (find_package(diffcomm CONFIG)).
#
# Included at the end of the top-level CMakeLists.txt, once every target
# exists. Installs:
#   include/diffcomm/...                   public headers (core + sim) and the
#                                          generated diffcomm/config.hpp
#   lib/libdiffcomm_*.a                    the libraries
#   lib/cmake/diffcomm/                    diffcomm-config.cmake, version file,
#                                          diffcommTargets*.cmake
# Consumers:
#   find_package(diffcomm CONFIG REQUIRED)           # or COMPONENTS mpi nccl
#   target_link_libraries(app PRIVATE diffcomm::core) # diffcomm::sim_world, ...
#   (or one layer: diffcomm::tensor, ::autograd, ::distributed, ::nn, ::encoder_parallel)
#
# The libraries are static by default, so the exported link interface carries
# their private dependencies ($<LINK_ONLY:fmt::fmt>, ...); the package config
# must find those packages again. Which ones is read from the targets' link
# interfaces below rather than hard-coded, so a new dependency cannot be
# forgotten silently.
include(CMakePackageConfigHelpers)

set(DIFFCOMM_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/diffcomm)

# ---- headers ---------------------------------------------------------------
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/diffcomm
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
foreach(_concern world replay checks)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/sim/${_concern}/include/diffcomm
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endforeach()
install(FILES ${PROJECT_BINARY_DIR}/generated/diffcomm/config.hpp
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/diffcomm)

# ---- libraries -------------------------------------------------------------
# Export sets: diffcommTargets (core, sim) is always loaded by the package;
# diffcomm-mpiTargets and diffcomm-ncclTargets only when the consumer asks for
# the component (find_package(diffcomm COMPONENTS mpi nccl)), so a CPU-only
# program using core + sim needs neither MPI nor NCCL.
# The core layers (src/CMakeLists.txt) and diffcomm::core, the INTERFACE
# target linking them all.
set(_diffcomm_core_layers diffcomm_tensor diffcomm_autograd diffcomm_distributed diffcomm_nn
                          diffcomm_encoder_parallel diffcomm_core)
set(_diffcomm_export_targets ${_diffcomm_core_layers})
set(_diffcomm_set_base ${_diffcomm_core_layers})
set(_diffcomm_optional_components "")
foreach(_pair IN ITEMS diffcomm_sim_world:sim_world diffcomm_sim_replay:sim_replay
                      diffcomm_sim_checks:sim_checks diffcomm_mpi:mpi
                      diffcomm_nccl:nccl)
  string(REPLACE ":" ";" _pair "${_pair}")
  list(GET _pair 0 _target)
  list(GET _pair 1 _export_name)
  if(TARGET ${_target})
    get_target_property(_current ${_target} EXPORT_NAME)
    if(NOT _current)
      set_target_properties(${_target} PROPERTIES EXPORT_NAME ${_export_name})
    endif()
    list(APPEND _diffcomm_export_targets ${_target})
    if(_export_name MATCHES "^sim_")
      list(APPEND _diffcomm_set_base ${_target})
    else()
      set(_diffcomm_set_${_export_name} ${_target})
      list(APPEND _diffcomm_optional_components ${_export_name})
    endif()
  endif()
endforeach()

# A sanitized static library needs the sanitizer runtime wherever it is
# linked; the project applies -fsanitize through directory-wide options, which
# are not exported, so the installed interface carries it explicitly.
if(DIFFCOMM_SANITIZE)
  foreach(_target IN LISTS _diffcomm_export_targets)
    get_target_property(_type ${_target} TYPE)
    if(_type STREQUAL "STATIC_LIBRARY" OR _type STREQUAL "OBJECT_LIBRARY")
      target_link_options(${_target} INTERFACE
        $<INSTALL_INTERFACE:-fsanitize=${DIFFCOMM_SANITIZE}>)
    endif()
  endforeach()
endif()

# `cmake --install` of a tree where only some targets were built (scripts/demo
# builds diffcomm-sim only) would stop at the first missing library with a raw
# "file INSTALL cannot find"; say what to build instead.
set(_diffcomm_check_files "")
foreach(_target IN LISTS _diffcomm_export_targets)
  get_target_property(_type ${_target} TYPE)
  if(NOT _type STREQUAL "INTERFACE_LIBRARY")
    string(APPEND _diffcomm_check_files "  \"$<TARGET_FILE:${_target}>\"\n")
  endif()
endforeach()
install(CODE "
set(_missing \"\")
foreach(_f
${_diffcomm_check_files})
  if(NOT EXISTS \"\${_f}\")
    list(APPEND _missing \"\${_f}\")
  endif()
endforeach()
if(_missing)
  message(FATAL_ERROR \"diffcomm: cmake --install needs every library of this build tree; missing: \${_missing}. Build them first: cmake --build ${PROJECT_BINARY_DIR} (scripts/demo builds only diffcomm-sim).\")
endif()
")

install(TARGETS ${_diffcomm_set_base}
  EXPORT diffcommTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT diffcommTargets
  NAMESPACE diffcomm::
  DESTINATION ${DIFFCOMM_INSTALL_CMAKEDIR})
foreach(_comp IN LISTS _diffcomm_optional_components)
  install(TARGETS ${_diffcomm_set_${_comp}}
    EXPORT diffcomm-${_comp}Targets
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
    INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(EXPORT diffcomm-${_comp}Targets
    NAMESPACE diffcomm::
    DESTINATION ${DIFFCOMM_INSTALL_CMAKEDIR})
endforeach()

# The command-line simulator, when built.
if(TARGET diffcomm-sim)
  install(TARGETS diffcomm-sim RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

# ---- dependencies the package config must find -----------------------------
# Read from the exported link interfaces (static libraries carry their private
# dependencies as $<LINK_ONLY:...>) and written out as find_dependency() calls,
# per export set: the base set's run on every find_package(diffcomm), a
# component's only when it is requested.
function(_diffcomm_find_dependencies out)
  set(_links "")
  foreach(_target IN LISTS ARGN)
    get_target_property(_libs ${_target} INTERFACE_LINK_LIBRARIES)
    if(_libs)
      list(APPEND _links ${_libs})
    endif()
  endforeach()
  string(REGEX MATCHALL "[A-Za-z0-9_.+-]+::[A-Za-z0-9_.+-]+" _imported "${_links}")
  list(REMOVE_DUPLICATES _imported)
  set(_dep_fmt OFF)
  set(_dep_threads OFF)
  set(_dep_json OFF)
  set(_dep_cuda OFF)
  set(_dep_boost OFF)
  set(_boost_components "")
  set(_mpi_components "")
  foreach(_lib IN LISTS _imported)
    if(_lib MATCHES "^diffcomm::")
      # our own targets
    elseif(_lib MATCHES "^fmt::")
      set(_dep_fmt ON)
    elseif(_lib MATCHES "^Threads::")
      set(_dep_threads ON)
    elseif(_lib MATCHES "^nlohmann_json::")
      set(_dep_json ON)
    elseif(_lib MATCHES "^CUDA::")
      set(_dep_cuda ON)
    elseif(_lib MATCHES "^Boost::(.+)$")
      set(_dep_boost ON)
      set(_component ${CMAKE_MATCH_1})
      # Boost::headers and the like are not components.
      if(NOT _component MATCHES "^(boost|headers|disable_autolinking|diagnostic_definitions|dynamic_linking)$")
        list(APPEND _boost_components ${_component})
      endif()
    elseif(_lib MATCHES "^MPI::MPI_(C|CXX|Fortran)$")
      list(APPEND _mpi_components ${CMAKE_MATCH_1})
    else()
      message(WARNING "cmake/Install.cmake: the installed diffcomm targets link ${_lib}, "
                      "which diffcomm-config.cmake does not know how to find; teach "
                      "cmake/Install.cmake about it.")
    endif()
  endforeach()
  set(_text "")
  if(_dep_fmt)
    string(APPEND _text "find_dependency(fmt)\n")
  endif()
  if(_dep_threads)
    string(APPEND _text "find_dependency(Threads)\n")
  endif()
  if(_dep_json)
    string(APPEND _text "find_dependency(nlohmann_json 3)\n")
  endif()
  if(_dep_boost)
    set(_boost_version 1.74)
    if(DEFINED Boost_VERSION_MAJOR AND DEFINED Boost_VERSION_MINOR)
      set(_boost_version ${Boost_VERSION_MAJOR}.${Boost_VERSION_MINOR})
    endif()
    set(_line "find_dependency(Boost ${_boost_version}")
    if(_boost_components)
      list(REMOVE_DUPLICATES _boost_components)
      list(JOIN _boost_components " " _joined)
      string(APPEND _line " COMPONENTS ${_joined}")
    endif()
    string(APPEND _text "${_line})\n")
  endif()
  if(_dep_cuda)
    # The toolkit this build used is a hint for consumers whose nvcc is not on
    # PATH (FindCUDAToolkit also looks in /usr/local/cuda by itself).
    if(CUDAToolkit_BIN_DIR)
      get_filename_component(_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
      string(APPEND _text
        "if(NOT DEFINED CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDAToolkit_ROOT}\n"
        "   AND NOT CMAKE_CUDA_COMPILER AND EXISTS \"${_cuda_root}\")\n"
        "  set(CUDAToolkit_ROOT \"${_cuda_root}\")\n"
        "endif()\n")
    endif()
    string(APPEND _text "find_dependency(CUDAToolkit)\n")
  endif()
  if(_mpi_components)
    list(REMOVE_DUPLICATES _mpi_components)
    # FindMPI only looks for the components of enabled languages.
    foreach(_lang IN LISTS _mpi_components)
      string(APPEND _text
        "if(NOT CMAKE_${_lang}_COMPILER_LOADED)\n"
        "  enable_language(${_lang})\n"
        "endif()\n")
    endforeach()
    list(JOIN _mpi_components " " _joined)
    string(APPEND _text "find_dependency(MPI COMPONENTS ${_joined})\n")
  endif()
  set(${out} "${_text}" PARENT_SCOPE)
endfunction()

_diffcomm_find_dependencies(DIFFCOMM_FIND_DEPENDENCIES ${_diffcomm_set_base})
# Per optional component: an if() block the config runs when it is requested.
set(DIFFCOMM_COMPONENT_BLOCKS "")
foreach(_comp IN LISTS _diffcomm_optional_components)
  _diffcomm_find_dependencies(_deps ${_diffcomm_set_${_comp}})
  string(APPEND DIFFCOMM_COMPONENT_BLOCKS
    "if(\"${_comp}\" IN_LIST diffcomm_FIND_COMPONENTS)\n"
    "${_deps}"
    "  include(\"\${CMAKE_CURRENT_LIST_DIR}/diffcomm-${_comp}Targets.cmake\")\n"
    "endif()\n")
endforeach()

set(DIFFCOMM_EXPORTED_COMPONENTS "")
foreach(_target IN LISTS _diffcomm_export_targets)
  get_target_property(_name ${_target} EXPORT_NAME)
  list(APPEND DIFFCOMM_EXPORTED_COMPONENTS ${_name})
endforeach()
list(JOIN DIFFCOMM_EXPORTED_COMPONENTS " " DIFFCOMM_EXPORTED_COMPONENTS)

configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/diffcomm-config.cmake.in
  ${PROJECT_BINARY_DIR}/diffcomm-config.cmake
  INSTALL_DESTINATION ${DIFFCOMM_INSTALL_CMAKEDIR})
# 0.x: minor versions may break the API, so only the same minor is compatible.
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/diffcomm-config-version.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/diffcomm-config.cmake
  ${PROJECT_BINARY_DIR}/diffcomm-config-version.cmake
  DESTINATION ${DIFFCOMM_INSTALL_CMAKEDIR})

# ---- test: an outside project builds against the installed package ----------
if(DIFFCOMM_BUILD_TESTS)
  get_property(_diffcomm_multi_config GLOBAL PROPERTY GENERATOR_IS_MULTI_CONFIG)
  if(_diffcomm_multi_config)
    set(_diffcomm_consumer_config $<CONFIG>)
  else()
    set(_diffcomm_consumer_config ${CMAKE_BUILD_TYPE})
  endif()
  add_test(NAME install_consumer
    COMMAND ${CMAKE_COMMAND}
      -D DIFFCOMM_BUILD_DIR=${PROJECT_BINARY_DIR}
      -D DIFFCOMM_SOURCE_DIR=${PROJECT_SOURCE_DIR}
      -D WORK_DIR=${PROJECT_BINARY_DIR}/install_consumer
      -D GENERATOR=${CMAKE_GENERATOR}
      -D MAKE_PROGRAM=${CMAKE_MAKE_PROGRAM}
      -D CXX_COMPILER=${CMAKE_CXX_COMPILER}
      -D CUDA_COMPILER=${CMAKE_CUDA_COMPILER}
      -D BUILD_TYPE=${_diffcomm_consumer_config}
      -P ${PROJECT_SOURCE_DIR}/cmake/ConsumerTest.cmake)
  set_tests_properties(install_consumer PROPERTIES
    LABELS unit
    TIMEOUT 900
    # It installs into and builds under the build tree: keep it out of the
    # way of a concurrent copy of itself.
    RESOURCE_LOCK diffcomm_install_consumer)
  # diffcomm as an add_subdirectory of another project (tests/subproject): configured with the
  # test and tool packages hidden from find_package.
  add_test(NAME subproject_configure
    COMMAND ${CMAKE_COMMAND} -S ${PROJECT_SOURCE_DIR}/tests/subproject
      -B ${PROJECT_BINARY_DIR}/subproject -G ${CMAKE_GENERATOR}
      -D DIFFCOMM_SOURCE_DIR=${PROJECT_SOURCE_DIR}
      -D CMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}
      -D DIFFCOMM_ENABLE_CUDA=OFF
      -D CMAKE_DISABLE_FIND_PACKAGE_GTest=ON -D CMAKE_DISABLE_FIND_PACKAGE_rapidcheck=ON
      -D CMAKE_DISABLE_FIND_PACKAGE_benchmark=ON -D CMAKE_DISABLE_FIND_PACKAGE_CLI11=ON)
  set_tests_properties(subproject_configure PROPERTIES LABELS unit TIMEOUT 300
    PASS_REGULAR_EXPRESSION "no test or tool dependency")
endif()
