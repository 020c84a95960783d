# Builds each probe of tests/layering/CMakeLists.txt and checks the outcome:
#   cmake -DBUILD_DIR=<build tree> -DPROBES=<name|builds/fails|h1,h2;...> -P check_scopes.cmake
# A `fails` probe passes only when its compile stops at its own #include
# with the header not found (GCC: "No such file or directory", Clang: "file
# not found"); any other failure (a syntax error, a broken dependency) is a
# failure of this test, so it cannot pass by accident.
set(failures 0)
foreach(probe IN LISTS PROBES)
  string(REPLACE "|" ";" fields "${probe}")
  list(GET fields 0 name)
  list(GET fields 1 expect)
  list(GET fields 2 headers)
  string(REPLACE "," ";" headers "${headers}")
  execute_process(
    COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ampd_probe_${name}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(expect STREQUAL "builds")
    if(rc EQUAL 0)
      message(STATUS "ok   ${name}: builds")
    else()
      message(STATUS "FAIL ${name}: should build, did not:\n${out}")
      math(EXPR failures "${failures} + 1")
    endif()
  else()
    list(GET headers 0 header)
    string(REGEX REPLACE "([.+])" "\\\\\\1" header_re "${header}")
    if(rc EQUAL 0)
      message(STATUS "FAIL ${name}: ${header} should be out of scope, but it built")
      math(EXPR failures "${failures} + 1")
    elseif(out MATCHES "${header_re}: No such file or directory"
           OR out MATCHES "'${header_re}' file not found")
      message(STATUS "ok   ${name}: ${header} not found")
    else()
      message(STATUS "FAIL ${name}: failed, but not on ${header} missing:\n${out}")
      math(EXPR failures "${failures} + 1")
    endif()
  endif()
endforeach()
if(failures GREATER 0)
  message(FATAL_ERROR "${failures} header-scope probe(s) failed")
endif()
