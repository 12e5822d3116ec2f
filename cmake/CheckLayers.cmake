# cmake -D DIFFCOMM_SOURCE_DIR=<root> -P cmake/CheckLayers.cmake
#
# The layers of diffcomm, enforced: a source or header of a layer may include
# headers of its own layer and of the layers below it only. A file's layer is
# its folder, nothing else:
#
#   src/<layer>/, include/diffcomm/<layer>/   tensor < autograd < distributed < nn
#                                             < encoder_parallel;  backends
#   sim/<concern>/                            sim_world, sim_replay, sim_checks
#
#   backends    (production backends): tensor and distributed only
#               (distributed/backend/ is their toolkit; not autograd, nn, ...)
#   sim_world   (the simulated world, a backend too): tensor, autograd, distributed
#   sim_replay  (replay of flight-recorder dumps): sim_world and what it may include
#   sim_checks  (adjoint checker, equivalence oracle, reports): the whole core and sim_world
#
# A quoted include is resolved the way the compiler does (next to the file,
# then include/, src/, sim/*/include/) and takes the layer of the file it
# names; "diffcomm/config.hpp" is the build's generated configuration, open to
# every layer. A file in src/ or include/diffcomm/ outside a layer folder, or
# an include of a diffcomm header that does not exist, fails the check.
#
# Run by the build (target diffcomm_layer_check, src/CMakeLists.txt), which
# every layer library depends on: a forbidden include fails the build with
# file:line: the include and the rule it breaks.
cmake_minimum_required(VERSION 3.25)
if(NOT DIFFCOMM_SOURCE_DIR)
  message(FATAL_ERROR "CheckLayers.cmake: pass -D DIFFCOMM_SOURCE_DIR=<source root>")
endif()
set(_root "${DIFFCOMM_SOURCE_DIR}")

# What each layer may include (its own layer first).
set(_layers tensor autograd distributed nn encoder_parallel backends sim_world sim_replay
            sim_checks)
set(_allowed_tensor tensor)
set(_allowed_autograd autograd tensor)
set(_allowed_distributed distributed tensor autograd)
set(_allowed_nn nn tensor autograd distributed)
set(_allowed_encoder_parallel encoder_parallel tensor autograd distributed nn)
set(_allowed_backends backends tensor distributed)
set(_allowed_sim_world sim_world tensor autograd distributed)
set(_allowed_sim_replay sim_replay sim_world tensor autograd distributed)
set(_allowed_sim_checks sim_checks sim_world tensor autograd distributed nn encoder_parallel)

# The layer of a file (its path relative to the source root), from its
# folder; "" outside the layered tree, "unassigned" for a file of src/ or
# include/diffcomm/ that sits outside every layer folder.
function(_file_layer rel out)
  set(_layer "")
  if(rel MATCHES "^(src|include/diffcomm)/([a-z_]+)/")
    set(_layer "${CMAKE_MATCH_2}")
  elseif(rel MATCHES "^sim/([a-z_]+)/")
    set(_layer "sim_${CMAKE_MATCH_1}")
  elseif(rel MATCHES "^(src|include/diffcomm)/")
    set(_layer unassigned)
  endif()
  if(NOT _layer STREQUAL "" AND NOT _layer IN_LIST _layers)
    set(_layer unassigned)
  endif()
  set(${out} "${_layer}" PARENT_SCOPE)
endfunction()

file(GLOB _sim_include_dirs LIST_DIRECTORIES true "${_root}/sim/*/include")
set(_include_roots "${_root}/include" "${_root}/src" ${_sim_include_dirs})

file(GLOB_RECURSE _files
  "${_root}/include/diffcomm/*.hpp"
  "${_root}/src/*.hpp" "${_root}/src/*.cpp" "${_root}/src/*.cu"
  "${_root}/sim/*.hpp" "${_root}/sim/*.cpp")
list(SORT _files)

# The file a quoted include names (as the compiler would find it), or "".
function(_resolve file inc out)
  get_filename_component(_dir "${file}" DIRECTORY)
  set(_found "")
  foreach(_base IN ITEMS "${_dir}" ${_include_roots})
    if(EXISTS "${_base}/${inc}")
      set(_found "${_base}/${inc}")
      break()
    endif()
  endforeach()
  set(${out} "${_found}" PARENT_SCOPE)
endfunction()

set(_errors "")
set(_checked 0)
foreach(_file IN LISTS _files)
  file(RELATIVE_PATH _rel "${_root}" "${_file}")
  _file_layer("${_rel}" _layer)
  if(_layer STREQUAL "")
    continue()
  endif()
  if(_layer STREQUAL "unassigned")
    string(APPEND _errors "${_rel}: outside every layer folder (${_layers})\n")
    continue()
  endif()
  math(EXPR _checked "${_checked} + 1")
  file(STRINGS "${_file}" _includes REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(_line IN LISTS _includes)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]*)\".*$" "\\1" _inc "${_line}")
    if(_inc STREQUAL "diffcomm/config.hpp")
      continue()
    endif()
    _resolve("${_file}" "${_inc}" _target_file)
    set(_problem "")
    if(_target_file STREQUAL "")
      if(_inc MATCHES "^diffcomm/")
        set(_problem "names no diffcomm header")
      endif()
    else()
      file(RELATIVE_PATH _target_rel "${_root}" "${_target_file}")
      _file_layer("${_target_rel}" _target)
      if(NOT _target STREQUAL "" AND NOT _target IN_LIST _allowed_${_layer})
        list(JOIN _allowed_${_layer} ", " _may)
        set(_problem "(layer ${_target}) from layer ${_layer}, which may include only ${_may}")
      endif()
    endif()
    if(_problem STREQUAL "")
      continue()
    endif()
    # The line number, only for a violation: count the newlines before it.
    file(READ "${_file}" _content)
    string(FIND "${_content}" "${_line}" _pos)
    set(_lineno "?")
    if(_pos GREATER_EQUAL 0)
      string(SUBSTRING "${_content}" 0 ${_pos} _before)
      string(REGEX MATCHALL "\n" _newlines "${_before}")
      list(LENGTH _newlines _lineno)
      math(EXPR _lineno "${_lineno} + 1")
    endif()
    string(APPEND _errors "${_rel}:${_lineno}: error: #include \"${_inc}\" ${_problem}\n")
  endforeach()
endforeach()

if(_errors)
  message(FATAL_ERROR
    "diffcomm layer check failed (cmake/CheckLayers.cmake; a file's layer is its folder: "
    "tensor < autograd < distributed < nn < encoder_parallel; backends and sim_world over "
    "distributed; sim_replay over sim_world; sim_checks over everything):\n"
    "${_errors}")
endif()
message(STATUS "diffcomm layer check: ${_checked} files, no include of a higher layer")
