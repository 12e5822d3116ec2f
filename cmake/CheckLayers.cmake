# cmake -D DIFFCOMM_SOURCE_DIR=<root> -P cmake/CheckLayers.cmake
#
# The layers of diffcomm, enforced: a source or header of a layer may include
# headers of its own layer and of the layers below it only.
#
#   tensor < autograd < dist < nn < encoder_parallel
#   backends (src/backends, include/diffcomm/backends): tensor and dist only
#            (dist/backend/ is their toolkit; not autograd, nn, ...)
#   sim      (sim/, diffcomm::sim): tensor, autograd, dist (a dist backend)
#   sim_reports (sim/src/{adjoint,report,step_options}.cpp, diffcomm/sim/{adjoint,report,step_options}.hpp,
#            diffcomm::sim_reports): the whole core and sim
#
# Run by the build (target diffcomm_layer_check, src/CMakeLists.txt), which
# every layer library depends on: a forbidden include fails the build with
# file:line: the include and the rule it breaks.
cmake_minimum_required(VERSION 3.25)
if(NOT DIFFCOMM_SOURCE_DIR)
  message(FATAL_ERROR "CheckLayers.cmake: pass -D DIFFCOMM_SOURCE_DIR=<source root>")
endif()
set(_root "${DIFFCOMM_SOURCE_DIR}")

# The layer a file belongs to (by its path relative to the source root), or
# "" for a file outside the layered tree.
function(_file_layer rel out)
  set(_layer "")
  if(rel MATCHES "^include/diffcomm/(dtype|tensor|error|cuda|config)\\.hpp$"
     OR rel MATCHES "^src/(tensor|dlpack|error|host_cache)\\.(cpp|hpp)$"
     OR rel MATCHES "^src/(cuda|detail)/")
    set(_layer tensor)
  elseif(rel MATCHES "^include/diffcomm/(autograd|ops)\\.hpp$"
         OR rel MATCHES "^src/(autograd|ops)\\.cpp$")
    set(_layer autograd)
  elseif(rel MATCHES "^(include/diffcomm|src)/dist/")
    set(_layer dist)
  elseif(rel MATCHES "^(include/diffcomm|src)/nn/")
    set(_layer nn)
  elseif(rel MATCHES "^(include/diffcomm|src)/encoder_parallel/")
    set(_layer encoder_parallel)
  elseif(rel MATCHES "^(include/diffcomm|src)/backends/")
    set(_layer backends)
  elseif(rel MATCHES "^sim/(src|include/diffcomm/sim)/(adjoint|report|step_options)\\.(cpp|hpp)$")
    set(_layer sim_reports)
  elseif(rel MATCHES "^sim/")
    set(_layer sim)
  elseif(rel MATCHES "^(include/diffcomm|src)/")
    set(_layer unassigned)
  endif()
  set(${out} "${_layer}" PARENT_SCOPE)
endfunction()

# The layer of a quoted include, or "" for one that is not a diffcomm header
# of another directory (a header next to the file: "agreement.hpp").
function(_include_layer inc out)
  set(_layer "")
  if(inc MATCHES "^diffcomm/(dtype|tensor|error|cuda|config)\\.hpp$"
     OR inc MATCHES "^(cuda|detail)/")
    set(_layer tensor)
  elseif(inc MATCHES "^diffcomm/(autograd|ops)\\.hpp$")
    set(_layer autograd)
  elseif(inc MATCHES "^diffcomm/dist/")
    set(_layer dist)
  elseif(inc MATCHES "^diffcomm/nn/")
    set(_layer nn)
  elseif(inc MATCHES "^diffcomm/encoder_parallel/")
    set(_layer encoder_parallel)
  elseif(inc MATCHES "^diffcomm/backends/")
    set(_layer backends)
  elseif(inc MATCHES "^diffcomm/sim/(adjoint|report|step_options)\\.hpp$")
    set(_layer sim_reports)
  elseif(inc MATCHES "^diffcomm/sim/")
    set(_layer sim)
  elseif(inc MATCHES "^diffcomm/")
    set(_layer unknown)
  endif()
  set(${out} "${_layer}" PARENT_SCOPE)
endfunction()

# What each layer may include.
set(_allowed_tensor tensor)
set(_allowed_autograd tensor autograd)
set(_allowed_dist tensor autograd dist)
set(_allowed_nn tensor autograd dist nn)
set(_allowed_encoder_parallel tensor autograd dist nn encoder_parallel)
set(_allowed_backends tensor dist backends)
set(_allowed_sim tensor autograd dist sim)
set(_allowed_sim_reports tensor autograd dist nn encoder_parallel sim sim_reports)

file(GLOB_RECURSE _files
  "${_root}/include/diffcomm/*.hpp"
  "${_root}/src/*.hpp" "${_root}/src/*.cpp" "${_root}/src/*.cu"
  "${_root}/sim/*.hpp" "${_root}/sim/*.cpp")
list(SORT _files)

set(_errors "")
set(_checked 0)
foreach(_file IN LISTS _files)
  file(RELATIVE_PATH _rel "${_root}" "${_file}")
  _file_layer("${_rel}" _layer)
  if(_layer STREQUAL "")
    continue()
  endif()
  if(_layer STREQUAL "unassigned")
    string(APPEND _errors
      "${_rel}: not part of any layer; give it one in cmake/CheckLayers.cmake\n")
    continue()
  endif()
  math(EXPR _checked "${_checked} + 1")
  file(STRINGS "${_file}" _includes REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  if(NOT _includes)
    continue()
  endif()
  set(_content "")
  foreach(_line IN LISTS _includes)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]*)\".*$" "\\1" _inc "${_line}")
    _include_layer("${_inc}" _target)
    if(_target STREQUAL "" OR _target IN_LIST _allowed_${_layer})
      continue()
    endif()
    # The line number, only for a violation: count the newlines before it.
    if(_content STREQUAL "")
      file(READ "${_file}" _content)
    endif()
    string(FIND "${_content}" "${_line}" _pos)
    set(_lineno "?")
    if(_pos GREATER_EQUAL 0)
      string(SUBSTRING "${_content}" 0 ${_pos} _before)
      string(REGEX MATCHALL "\n" _newlines "${_before}")
      list(LENGTH _newlines _lineno)
      math(EXPR _lineno "${_lineno} + 1")
    endif()
    list(JOIN _allowed_${_layer} ", " _may)
    string(APPEND _errors
      "${_rel}:${_lineno}: error: #include \"${_inc}\" (layer ${_target}) from layer ${_layer}, "
      "which may include only ${_may}\n")
  endforeach()
endforeach()

if(_errors)
  message(FATAL_ERROR
    "diffcomm layer check failed (cmake/CheckLayers.cmake; the layers: "
    "tensor < autograd < dist < nn < encoder_parallel; backends and sim over dist; "
    "sim_reports over everything):\n"
    "${_errors}")
endif()
message(STATUS "diffcomm layer check: ${_checked} files, no include of a higher layer")
