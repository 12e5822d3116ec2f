# ctest `install_consumer`: installs this build into a scratch prefix, then
# configures, builds and runs tests/consumer — an outside project that only
# knows find_package(diffcomm CONFIG REQUIRED). Proves the installed headers,
# libraries and package config are complete and usable.
#
# cmake -D DIFFCOMM_BUILD_DIR=<build> -D DIFFCOMM_SOURCE_DIR=<src>
#       -D WORK_DIR=<scratch> -D GENERATOR=<gen> [-D MAKE_PROGRAM=<prog>]
#       -D CXX_COMPILER=<c++> [-D CUDA_COMPILER=<nvcc>] -D BUILD_TYPE=<cfg>
#       -P ConsumerTest.cmake
cmake_minimum_required(VERSION 3.25)

foreach(_var DIFFCOMM_BUILD_DIR DIFFCOMM_SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "ConsumerTest.cmake: -D ${_var}=... is required")
  endif()
endforeach()
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()

set(_prefix ${WORK_DIR}/prefix)
set(_consumer_build ${WORK_DIR}/build)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

function(run_step what)
  message(STATUS "install_consumer: ${what}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "install_consumer: ${what} failed (${_rc})")
  endif()
endfunction()

# 1. install
run_step("install ${DIFFCOMM_BUILD_DIR} into ${_prefix}"
  ${CMAKE_COMMAND} --install ${DIFFCOMM_BUILD_DIR} --prefix ${_prefix} --config ${BUILD_TYPE})

# 2. configure the consumer against the installed package only
set(_configure_args
  -S ${DIFFCOMM_SOURCE_DIR}/tests/consumer
  -B ${_consumer_build}
  -G ${GENERATOR}
  -D CMAKE_BUILD_TYPE=${BUILD_TYPE}
  -D CMAKE_CXX_COMPILER=${CXX_COMPILER}
  -D CMAKE_PREFIX_PATH=${_prefix}
  # look nowhere else for diffcomm (e.g. not the user package registry)
  -D CMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
if(MAKE_PROGRAM)
  list(APPEND _configure_args -D CMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
endif()
if(CUDA_COMPILER)
  list(APPEND _configure_args -D CMAKE_CUDA_COMPILER=${CUDA_COMPILER})
endif()
run_step("configure tests/consumer" ${CMAKE_COMMAND} ${_configure_args})

# 3. build it
run_step("build tests/consumer"
  ${CMAKE_COMMAND} --build ${_consumer_build} --config ${BUILD_TYPE})

# 4. run it (single-config generators put it in the build dir, multi-config
#    ones in a per-config subdirectory)
find_program(_consumer_exe diffcomm_consumer
  PATHS ${_consumer_build} ${_consumer_build}/${BUILD_TYPE}
  NO_DEFAULT_PATH NO_CACHE)
if(NOT _consumer_exe)
  message(FATAL_ERROR "install_consumer: diffcomm_consumer not found under ${_consumer_build}")
endif()
run_step("run ${_consumer_exe}" ${_consumer_exe})
message(STATUS "install_consumer: passed")
