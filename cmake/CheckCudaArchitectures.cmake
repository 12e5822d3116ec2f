# ctest `cuda_architectures` (cmake -P): the CUDA architectures of the
# configured build. Inputs (-D): CONFIGURED (CMAKE_CUDA_ARCHITECTURES),
# DEFAULT_USED (diffcomm's default after dropping what nvcc cannot build),
# DOCUMENTED (the README's list), NVCC_ARCHS (nvcc --list-gpu-arch),
# COMPILE_COMMANDS (compile_commands.json of the build).
#
# Checks: (1) the default is the documented list, less the entries nvcc does
# not know, with PTX only on the newest; (2) the compile command of
# src/tensor/cuda/device_ops.cu generates SASS for every configured architecture and
# PTX exactly for the entries without "-real". Prints the list either way.
cmake_minimum_required(VERSION 3.25)

set(errors "")
message(STATUS "configured CMAKE_CUDA_ARCHITECTURES: ${CONFIGURED}")
message(STATUS "diffcomm default on this nvcc:        ${DEFAULT_USED}")

# (1) the default
set(expected "")
foreach(a IN LISTS DOCUMENTED)
  string(REGEX REPLACE "-(real|virtual)$" "" n "${a}")
  if("compute_${n}" IN_LIST NVCC_ARCHS)
    list(APPEND expected "${n}-real")
  endif()
endforeach()
list(POP_BACK expected last)
string(REGEX REPLACE "-real$" "" last "${last}")
list(APPEND expected "${last}")
if(NOT "${DEFAULT_USED}" STREQUAL "${expected}")
  string(APPEND errors "default '${DEFAULT_USED}' != expected '${expected}' (documented '${DOCUMENTED}', nvcc knows '${NVCC_ARCHS}')\n")
endif()
foreach(n 80 86 89 90 100 120)
  if("compute_${n}" IN_LIST NVCC_ARCHS AND NOT "${n}-real" IN_LIST DEFAULT_USED
     AND NOT "${n}" IN_LIST DEFAULT_USED)
    string(APPEND errors "sm_${n} is missing from the default although nvcc supports it\n")
  endif()
endforeach()

# (2) the compile command of the kernels
if(CONFIGURED MATCHES "^(all|all-major|native)$")
  message(STATUS "CMAKE_CUDA_ARCHITECTURES=${CONFIGURED}: resolved by CMake; flags not checked")
else()
  file(READ "${COMPILE_COMMANDS}" json)
  string(JSON count LENGTH "${json}")
  math(EXPR last_index "${count} - 1")
  set(command "")
  foreach(i RANGE ${last_index})
    string(JSON file GET "${json}" ${i} file)
    if(file MATCHES "src/tensor/cuda/device_ops\\.cu$")
      string(JSON command GET "${json}" ${i} command)
      break()
    endif()
  endforeach()
  if(command STREQUAL "")
    string(APPEND errors "no compile command for src/tensor/cuda/device_ops.cu in ${COMPILE_COMMANDS}\n")
  else()
    # --generate-code=arch=compute_N,code=[compute_N,sm_N] or code=[sm_N]
    string(REGEX MATCHALL "--generate-code=arch=compute_[0-9]+[a-z]?,code=\\[[^]]*\\]" gens "${command}")
    set(sass "")
    set(ptx "")
    foreach(g IN LISTS gens)
      string(REGEX MATCHALL "sm_[0-9]+[a-z]?" s "${g}")
      string(REGEX MATCHALL "compute_[0-9]+[a-z]?" p "${g}")
      list(REMOVE_AT p 0)  # the arch= part
      list(APPEND sass ${s})
      list(APPEND ptx ${p})
    endforeach()
    message(STATUS "device_ops.cu builds SASS: ${sass}; PTX: ${ptx}")
    set(want_sass "")
    set(want_ptx "")
    foreach(a IN LISTS CONFIGURED)
      string(REGEX REPLACE "-(real|virtual)$" "" n "${a}")
      if(NOT a MATCHES "-virtual$")
        list(APPEND want_sass "sm_${n}")
      endif()
      if(NOT a MATCHES "-real$")
        list(APPEND want_ptx "compute_${n}")
      endif()
    endforeach()
    foreach(kind sass ptx)
      list(SORT ${kind})
      list(SORT want_${kind})
      if(NOT "${${kind}}" STREQUAL "${want_${kind}}")
        string(APPEND errors "${kind}: the compile command builds '${${kind}}', configured '${want_${kind}}'\n")
      endif()
    endforeach()
  endif()
endif()

if(errors)
  message(FATAL_ERROR "cuda_architectures:\n${errors}")
endif()
message(STATUS "cuda_architectures: ok")
