# Third-party dependencies. Order matters:
#  1. Protobuf before Torch: torch's config otherwise defines an empty protobuf::libprotobuf target
#     and the real library silently drops off the link line.
#  2. The torch wheel ships its own (older) protobuf headers; targets that include generated code
#     link dropkv::protobuf_first so that the real headers win (-I beats torch's -isystem).

find_package(Threads REQUIRED)

if(DROPKV_SERVER)
  find_package(Protobuf REQUIRED)
  set(_pb_inc "${Protobuf_INCLUDE_DIR}")
  if(NOT _pb_inc)
    list(GET Protobuf_INCLUDE_DIRS 0 _pb_inc)
  endif()
  set(_pb_shadow "${CMAKE_BINARY_DIR}/protobuf_first/include")
  file(MAKE_DIRECTORY "${_pb_shadow}")
  file(CREATE_LINK "${_pb_inc}/google" "${_pb_shadow}/google" SYMBOLIC)
  add_library(dropkv_protobuf_first INTERFACE)
  target_include_directories(dropkv_protobuf_first BEFORE INTERFACE "${_pb_shadow}")
  add_library(dropkv::protobuf_first ALIAS dropkv_protobuf_first)
endif()

# --- LibTorch 2.11.0 from the PyPI wheel -------------------------------------------------------
# The wheel's share/cmake/Torch is the C++ LibTorch. scripts/setup.sh installs it into a venv
# outside the clone; DROPKV_VENV (env) or DROPKV_PYTHON (cache) point at it.
if(NOT DROPKV_PYTHON)
  if(DEFINED ENV{DROPKV_VENV})
    set(_venv "$ENV{DROPKV_VENV}")
  else()
    set(_venv "$ENV{HOME}/.cache/dropkv/venv")
  endif()
  if(EXISTS "${_venv}/bin/python")
    set(DROPKV_PYTHON "${_venv}/bin/python" CACHE FILEPATH "" FORCE)
  else()
    find_program(_py3 python3)
    set(DROPKV_PYTHON "${_py3}" CACHE FILEPATH "" FORCE)
  endif()
endif()
# The torch package's folder, found without importing it: `import torch` loads libtorch_cuda, cuDNN,
# cuBLAS, ..., which a CPU-only install (the wheel with --no-deps, as in docker/Dockerfile.cpu)
# does not have. Its share/cmake is torch.utils.cmake_prefix_path.
execute_process(
  COMMAND "${DROPKV_PYTHON}" -c
          "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('torch').origin))"
  OUTPUT_VARIABLE _torch_root OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc ERROR_QUIET)
if(NOT _rc EQUAL 0 OR NOT EXISTS "${_torch_root}/version.py")
  set(_torch_root "")
endif()
if(NOT Torch_DIR)
  if(NOT _torch_root)
    message(FATAL_ERROR "LibTorch not found: no torch package for '${DROPKV_PYTHON}'. "
                        "Run scripts/setup.sh, or pass -DTorch_DIR=... / -DDROPKV_PYTHON=...")
  endif()
  list(APPEND CMAKE_PREFIX_PATH "${_torch_root}/share/cmake")
endif()
if(NOT DROPKV_KVPRESS_PYTHON)
  get_filename_component(_venv_dir "${DROPKV_PYTHON}" DIRECTORY)
  get_filename_component(_venv_dir "${_venv_dir}" DIRECTORY)
  if(EXISTS "${_venv_dir}-kvpress/bin/python")
    set(DROPKV_KVPRESS_PYTHON "${_venv_dir}-kvpress/bin/python" CACHE FILEPATH "" FORCE)
  endif()
endif()

# The PyPI wheel is a CUDA build, and its CMake config stops with a fatal error on a machine
# without a CUDA toolkit (a plain CPU machine). The CPU engine needs none of it: there, the target
# is made from the wheel's headers and CPU libraries directly (DROPKV_TORCH_CPU_ONLY; AUTO = when
# CUDA is off and no nvcc exists).
set(DROPKV_TORCH_CPU_ONLY "AUTO" CACHE STRING "Link LibTorch's CPU libraries only: ON, OFF or AUTO")
set(_torch_cpu_only OFF)
if(DROPKV_TORCH_CPU_ONLY STREQUAL "ON")
  set(_torch_cpu_only ON)
elseif(DROPKV_TORCH_CPU_ONLY STREQUAL "AUTO" AND NOT DROPKV_CUDA_ENABLED)
  find_program(_dropkv_nvcc nvcc HINTS "$ENV{CUDA_HOME}/bin" /usr/local/cuda/bin)
  if(NOT _dropkv_nvcc)
    set(_torch_cpu_only ON)
  endif()
endif()
if(_torch_cpu_only AND DROPKV_CUDA_ENABLED)
  message(FATAL_ERROR "DROPKV_TORCH_CPU_ONLY=ON needs DROPKV_CUDA=OFF")
endif()

add_library(dropkv_torch INTERFACE)
if(_torch_cpu_only)
  if(NOT _torch_root)
    message(FATAL_ERROR "LibTorch not found: no torch package for '${DROPKV_PYTHON}'")
  endif()
  # torch/version.py holds __version__ = '2.11.0+cu130'.
  file(STRINGS "${_torch_root}/version.py" _torch_version_line REGEX "^__version__ *=")
  string(REGEX REPLACE "^__version__ *= *'([0-9.]+).*$" "\\1" Torch_VERSION "${_torch_version_line}")
  # Every PyPI wheel since torch 2.7 is built with the C++11 ABI (torch.compiled_with_cxx11_abi()
  # returns a constant True in 2.11); the version pin below keeps this true.
  set(TORCH_CXX_FLAGS "-D_GLIBCXX_USE_CXX11_ABI=1")
  target_include_directories(dropkv_torch SYSTEM INTERFACE "${_torch_root}/include"
                                                           "${_torch_root}/include/torch/csrc/api/include")
  # --no-as-needed: libtorch_cpu registers its operators in static initialisers.
  target_link_libraries(dropkv_torch INTERFACE "-Wl,--no-as-needed" "${_torch_root}/lib/libtorch_cpu.so"
                                               "${_torch_root}/lib/libc10.so" "-Wl,--as-needed")
  target_link_options(dropkv_torch INTERFACE "-Wl,-rpath,${_torch_root}/lib")
  message(STATUS "dropkv: LibTorch ${Torch_VERSION} CPU libraries only (no CUDA toolkit here)")
else()
  find_package(Torch 2.11 REQUIRED)
  target_link_libraries(dropkv_torch INTERFACE ${TORCH_LIBRARIES})
endif()
if(NOT Torch_VERSION VERSION_EQUAL "2.11.0")
  message(FATAL_ERROR "dropkv pins LibTorch 2.11.0 (the GPU machine's version); found ${Torch_VERSION}")
endif()
# TORCH_CXX_FLAGS carries the ABI define; apply it everywhere so Debian libs and torch agree.
string(APPEND CMAKE_CXX_FLAGS " ${TORCH_CXX_FLAGS}")
add_library(dropkv::torch ALIAS dropkv_torch)
# The wheel's libtorch_python is not needed and drags in libpython; TORCH_LIBRARIES does not list it.

# --- the rest, all from Debian packages -----------------------------------------------------------
find_package(spdlog REQUIRED)
find_package(fmt REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(yaml-cpp REQUIRED)
find_package(CLI11 REQUIRED)
find_package(absl REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
if(DROPKV_TESTS)
  find_package(GTest REQUIRED)
endif()
if(DROPKV_BENCH)
  find_package(benchmark QUIET)
endif()
if(DROPKV_SERVER)
  find_package(gRPC CONFIG REQUIRED)
  find_program(GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)
endif()
