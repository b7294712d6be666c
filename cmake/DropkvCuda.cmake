# Resolves DROPKV_CUDA (ON / OFF / AUTO) into DROPKV_CUDA_ENABLED and enables the CUDA language.
# AUTO turns CUDA on when nvcc is found. Without a GPU there is no `native` architecture under
# CUDA 13, so the default is sm_80 (A100) and sm_90 (H100/H200).
include(CheckLanguage)

string(TOUPPER "${DROPKV_CUDA}" _dropkv_cuda)
set(DROPKV_CUDA_ENABLED OFF)
if(_dropkv_cuda STREQUAL "ON" OR _dropkv_cuda STREQUAL "AUTO")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS "/usr/local/cuda/bin/nvcc")
    set(CMAKE_CUDA_COMPILER "/usr/local/cuda/bin/nvcc")
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(DROPKV_CUDA_ENABLED ON)
  elseif(_dropkv_cuda STREQUAL "ON")
    message(FATAL_ERROR "DROPKV_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
elseif(NOT _dropkv_cuda STREQUAL "OFF")
  message(FATAL_ERROR "DROPKV_CUDA must be ON, OFF or AUTO, not '${DROPKV_CUDA}'")
endif()

if(DROPKV_CUDA_ENABLED)
  # A cache entry, so that tools reading CMakeCache.txt (scripts/gpu_pack.sh) see it.
  set(CMAKE_CUDA_ARCHITECTURES "80;90" CACHE STRING "CUDA architectures (A100: 80, H100/H200: 90)")
  # CMake 3.25 (Debian 12) knows no CUDA20 dialect for nvcc; device code is C++17.
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  enable_language(CUDA)
  # torch's CMake ignores CMAKE_CUDA_ARCHITECTURES for its own flags; keep the two in step.
  if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(_arch_list "")
    foreach(_a IN LISTS CMAKE_CUDA_ARCHITECTURES)
      string(REGEX REPLACE "^([0-9])([0-9]).*" "\\1.\\2" _v "${_a}")
      list(APPEND _arch_list "${_v}")
    endforeach()
    list(JOIN _arch_list ";" _arch_str)
    set(ENV{TORCH_CUDA_ARCH_LIST} "${_arch_str}")
  endif()
  message(STATUS "dropkv: CUDA on, architectures ${CMAKE_CUDA_ARCHITECTURES}")
else()
  # The PyPI torch wheel is a CUDA build: its CMake config still looks for the toolkit and, with
  # no GPU to query, fails to pick architectures. Our targets compile no CUDA code then, so any
  # valid list will do.
  if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(ENV{TORCH_CUDA_ARCH_LIST} "9.0")
  endif()
  message(STATUS "dropkv: CUDA off")
endif()
