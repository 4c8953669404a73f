# The C++ package as a program uses it (a CTest, run by cmake -P): kdakit built without CUDA and installed into a
# fresh prefix, the installed files checked, examples/cpp built against the prefix as its own project and run.
#   -DSOURCE_DIR=<repository> -DWORK_DIR=<folder for the builds and the prefix> -DSHARED=ON|OFF
#   -DGENERATOR=<CMake generator> [-DMAKE_PROGRAM=...] [-DCXX_COMPILER=...]
cmake_minimum_required(VERSION 3.24)
foreach(var SOURCE_DIR WORK_DIR SHARED GENERATOR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "install_and_run_example.cmake needs -D${var}=...")
  endif()
endforeach()

set(build ${WORK_DIR}/build)
set(prefix ${WORK_DIR}/prefix)
set(example ${WORK_DIR}/example)
cmake_host_system_information(RESULT jobs QUERY NUMBER_OF_LOGICAL_CORES)
set(tools -G "${GENERATOR}")
if(MAKE_PROGRAM)
  list(APPEND tools -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
endif()
if(CXX_COMPILER)
  list(APPEND tools -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()

# Runs a command; on failure prints its output and stops.
function(step name)
  string(TIMESTAMP t0 "%s")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(TIMESTAMP t1 "%s")
  math(EXPR seconds "${t1} - ${t0}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${name} failed (${rc}):\n${out}")
  endif()
  message(STATUS "${name}: ${seconds} s")
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

step("configure kdakit" ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${build} ${tools} -DCMAKE_BUILD_TYPE=Release
     -DKDAKIT_CUDA=OFF -DBUILD_SHARED_LIBS=${SHARED} -DKDAKIT_BUILD_TESTS=OFF -DKDAKIT_BUILD_PYTHON=OFF
     -DKDAKIT_INSTALL=ON -DCMAKE_INSTALL_PREFIX=${prefix} -DCMAKE_INSTALL_LIBDIR=lib)
step("build kdakit" ${CMAKE_COMMAND} --build ${build} --parallel ${jobs})
file(REMOVE_RECURSE ${prefix})
step("install kdakit" ${CMAKE_COMMAND} --install ${build})

if(SHARED)
  set(library lib/libkdakit.so)
else()
  set(library lib/libkdakit.a)
endif()
foreach(file include/kdakit/kdakit.h include/kdakit/params.h include/kdakit/tensor.h include/kdakit/error.h
             include/kdakit/export.h include/kdakit/version.h include/kdakit/config.h ${library}
             lib/cmake/kdakit/kdakitConfig.cmake lib/cmake/kdakit/kdakitConfigVersion.cmake
             lib/cmake/kdakit/kdakitTargets.cmake)
  if(NOT EXISTS ${prefix}/${file})
    message(FATAL_ERROR "the install has no ${file}")
  endif()
endforeach()

step("configure examples/cpp" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples/cpp -B ${example} ${tools}
     -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix})
# find_package must have found this install, not another kdakit on the machine.
file(STRINGS ${example}/CMakeCache.txt found REGEX "^kdakit_DIR:")
if(NOT found STREQUAL "kdakit_DIR:PATH=${prefix}/lib/cmake/kdakit")
  message(FATAL_ERROR "examples/cpp found another kdakit: ${found}")
endif()
step("build examples/cpp" ${CMAKE_COMMAND} --build ${example} --parallel ${jobs})
step("run examples/cpp" ${example}/prefill_decode)
message("${step_output}")
