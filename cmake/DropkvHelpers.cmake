# Small helpers so every folder declares its targets the same way.

# dropkv_warnings(target): the project's warning set for our own code.
function(dropkv_warnings target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
endfunction()

# dropkv_add_tool(NAME name SOURCES ... LIBS ...): an executable in build/bin that answers --help.
function(dropkv_add_tool)
  cmake_parse_arguments(T "" "NAME" "SOURCES;LIBS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS})
  dropkv_warnings(${T_NAME})
endfunction()

# dropkv_add_test(NAME name SOURCES ... LIBS ... LABELS unit|parity|e2e|gpu|soak [TIMEOUT s]
#                 [FIXTURES_REQUIRED ...] [ENV K=V ...])
# One GoogleTest binary = one ctest entry (a process per test case would pay LibTorch's start-up
# each time). Tests find ../shared and the reference Python through the environment.
function(dropkv_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS;FIXTURES_REQUIRED;ENV" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  set_target_properties(${T_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/tests")
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main GTest::gmock)
  dropkv_warnings(${T_NAME})
  add_test(NAME ${T_NAME} COMMAND ${T_NAME} --gtest_color=no)
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  set_tests_properties(${T_NAME} PROPERTIES
    LABELS "${T_LABELS}"
    TIMEOUT ${T_TIMEOUT}
    ENVIRONMENT "DROPKV_SHARED=${DROPKV_SHARED_DIR};DROPKV_MODELS=${DROPKV_MODELS_DIR};DROPKV_PYTHON=${DROPKV_PYTHON};DROPKV_KVPRESS_PYTHON=${DROPKV_KVPRESS_PYTHON};DROPKV_SOURCE_DIR=${CMAKE_SOURCE_DIR};DROPKV_BUILD_DIR=${CMAKE_BINARY_DIR};OMP_NUM_THREADS=2;${T_ENV}")
  if(T_FIXTURES_REQUIRED)
    set_tests_properties(${T_NAME} PROPERTIES FIXTURES_REQUIRED "${T_FIXTURES_REQUIRED}")
  endif()
endfunction()

# dropkv_add_fixture(NAME name COMMAND ... FIXTURE fixture_name): a setup step (e.g. a Python
# script that builds reference models) that tests needing it run after.
function(dropkv_add_fixture)
  cmake_parse_arguments(F "" "NAME;FIXTURE;TIMEOUT" "COMMAND;LABELS" ${ARGN})
  add_test(NAME ${F_NAME} COMMAND ${F_COMMAND})
  if(NOT F_TIMEOUT)
    set(F_TIMEOUT 900)
  endif()
  set_tests_properties(${F_NAME} PROPERTIES FIXTURES_SETUP ${F_FIXTURE} LABELS "${F_LABELS}"
    TIMEOUT ${F_TIMEOUT}
    ENVIRONMENT "DROPKV_SHARED=${DROPKV_SHARED_DIR};DROPKV_MODELS=${DROPKV_MODELS_DIR};DROPKV_SOURCE_DIR=${CMAKE_SOURCE_DIR};DROPKV_BUILD_DIR=${CMAKE_BINARY_DIR};OMP_NUM_THREADS=2")
endfunction()

# tests/, tools/ and bench/: every subfolder with a CMakeLists.txt is one area (one owner), so
# adding a folder needs no edit in its parent.
macro(dropkv_add_area_subdirectories)
  file(GLOB _dropkv_subdirs LIST_DIRECTORIES true RELATIVE "${CMAKE_CURRENT_SOURCE_DIR}"
       "${CMAKE_CURRENT_SOURCE_DIR}/*")
  list(SORT _dropkv_subdirs)
  foreach(_dropkv_sub IN LISTS _dropkv_subdirs)
    if(EXISTS "${CMAKE_CURRENT_SOURCE_DIR}/${_dropkv_sub}/CMakeLists.txt")
      add_subdirectory(${_dropkv_sub})
    endif()
  endforeach()
endmacro()
