# morse_add_test(<source under tests/> LIBS <targets...> [LABELS <labels...>])
#
# The one way tests are registered: the executable is named after the source
# file (tests/compress/sign_codec_test.cc -> compress_sign_codec_test) and each
# GoogleTest case becomes its own ctest test.
include(GoogleTest)

function(morse_add_test source)
  cmake_parse_arguments(ARG "" "" "LIBS;LABELS" ${ARGN})
  file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR}/tests ${CMAKE_CURRENT_SOURCE_DIR}/${source})
  string(REGEX REPLACE "\\.cc$" "" name ${rel})
  string(REPLACE "/" "_" name ${name})
  add_executable(${name} ${source})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gtest_main)
  # Oracles written out in tests must round like the code under test.
  target_compile_options(${name} PRIVATE -ffp-contract=off)
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 120
                       PROPERTIES LABELS "${ARG_LABELS}")
endfunction()
