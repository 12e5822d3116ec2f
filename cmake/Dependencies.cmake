# Third-party libraries, all from Debian packages (scripts/setup-deps).
find_package(fmt REQUIRED)
find_package(Boost 1.74 REQUIRED COMPONENTS fiber context)
find_path(DLPACK_INCLUDE_DIR dlpack/dlpack.h REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
if(DIFFCOMM_BUILD_TOOLS OR DIFFCOMM_BUILD_TESTS OR DIFFCOMM_BUILD_FUZZ)
  find_package(CLI11 REQUIRED)  # diffcomm-sim (fuzz_cli compiles it too)
endif()
if(DIFFCOMM_BUILD_TESTS)
  find_package(GTest REQUIRED)
  find_package(rapidcheck REQUIRED)
endif()
if(DIFFCOMM_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()

# GPU architectures diffcomm's kernels are built for, by default: A100/A30
# (80), A10/A40/RTX 30xx (86), L4/L40/RTX 40xx (89), H100/H200/GH200 (90),
# B200/GB200 (100) and RTX 50xx/RTX PRO Blackwell (120) as SASS, plus PTX of
# the newest (120) so that later GPUs JIT-compile it. Entries the CUDA
# compiler does not know (nvcc --list-gpu-arch) are dropped with a message,
# so an older toolkit builds what it can. CMAKE_CUDA_ARCHITECTURES (or the
# CUDAARCHS environment variable) overrides the list: -DCMAKE_CUDA_ARCHITECTURES=90
# builds for H100/H200 only (a sixth of the device code), "native" for the
# GPUs of the build machine. The default actually used is kept in
# DIFFCOMM_CUDA_ARCHITECTURES_DEFAULT_USED (tests/check_cuda_architectures).
set(DIFFCOMM_CUDA_ARCHITECTURES_DEFAULT "80-real;86-real;89-real;90-real;100-real;120")
macro(diffcomm_default_cuda_architectures)
  execute_process(COMMAND ${CMAKE_CUDA_COMPILER} --list-gpu-arch
                  OUTPUT_VARIABLE DIFFCOMM_NVCC_GPU_ARCHS RESULT_VARIABLE _dc_rc ERROR_QUIET)
  string(REGEX REPLACE "[ \t\r\n]+" ";" DIFFCOMM_NVCC_GPU_ARCHS "${DIFFCOMM_NVCC_GPU_ARCHS}")
  set(_dc_archs "")
  foreach(_dc_a IN LISTS DIFFCOMM_CUDA_ARCHITECTURES_DEFAULT)
    string(REGEX REPLACE "-(real|virtual)$" "" _dc_n "${_dc_a}")
    if(NOT _dc_rc EQUAL 0 OR "compute_${_dc_n}" IN_LIST DIFFCOMM_NVCC_GPU_ARCHS)
      list(APPEND _dc_archs "${_dc_n}-real")
    else()
      message(STATUS "diffcomm: ${CMAKE_CUDA_COMPILER} cannot build sm_${_dc_n}; left out")
    endif()
  endforeach()
  # The newest architecture that is left carries the PTX as well.
  list(LENGTH _dc_archs _dc_len)
  if(_dc_len GREATER 0)
    math(EXPR _dc_last "${_dc_len} - 1")
    list(GET _dc_archs ${_dc_last} _dc_a)
    string(REGEX REPLACE "-real$" "" _dc_a "${_dc_a}")
    list(REMOVE_AT _dc_archs ${_dc_last})
    list(APPEND _dc_archs "${_dc_a}")
  endif()
  set(DIFFCOMM_CUDA_ARCHITECTURES_DEFAULT_USED "${_dc_archs}")
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
    # A cache entry: shown by ccmake/cmake-gui, kept by a re-run.
    set(CMAKE_CUDA_ARCHITECTURES "${_dc_archs}" CACHE STRING
        "CUDA architectures (diffcomm default: ${DIFFCOMM_CUDA_ARCHITECTURES_DEFAULT})")
  endif()
endmacro()

# CUDA + NCCL: detected, never required. The CUDA parts build when nvcc and
# the toolkit are found; the NCCL backend additionally needs nccl.h/libnccl.
set(DIFFCOMM_HAVE_CUDA OFF)
set(DIFFCOMM_HAVE_NCCL OFF)
if(DIFFCOMM_ENABLE_CUDA)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    diffcomm_default_cuda_architectures()
    enable_language(CUDA)
    find_package(CUDAToolkit)
    if(CUDAToolkit_FOUND)
      set(DIFFCOMM_HAVE_CUDA ON)
      # CMake 3.25 predates nvcc's C++20 support (CUDA >= 12): teach it the flag.
      if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
        set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
        set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
      endif()
      set(CMAKE_CUDA_STANDARD 20)
      find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
      find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
      if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
        set(DIFFCOMM_HAVE_NCCL ON)
      endif()
    endif()
  endif()
endif()

set(DIFFCOMM_HAVE_MPI OFF)
if(DIFFCOMM_ENABLE_MPI)
  find_package(MPI COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    set(DIFFCOMM_HAVE_MPI ON)
  endif()
endif()

# 0/1 spellings for the generated config.hpp.
foreach(_f CUDA NCCL MPI)
  if(DIFFCOMM_HAVE_${_f})
    set(DIFFCOMM_HAVE_${_f}_01 1)
  else()
    set(DIFFCOMM_HAVE_${_f}_01 0)
  endif()
endforeach()
