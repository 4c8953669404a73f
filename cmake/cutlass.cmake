# CUTLASS / CuTe headers, the Hopper kernels' atoms and layouts: a build-time dependency from the package index, never
# vendored. KDAKIT_CUTLASS_DIR (a CMake variable or an environment variable) names an include folder with cute/ and
# cutlass/ (offline machines carry one); otherwise the pinned nvidia-cutlass wheel is fetched from PyPI into the build
# tree (checked against its SHA-256) and its headers unpacked there.
set(KDAKIT_CUTLASS_VERSION "4.2.0.0")
set(KDAKIT_CUTLASS_URL "https://files.pythonhosted.org/packages/21/6b/e86fc2fd536dd4b8bd2209aa31d7002610c501b0802337787eac9c9b328c/nvidia_cutlass-4.2.0.0-py3-none-any.whl")
set(KDAKIT_CUTLASS_SHA256 "f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6")

if(NOT KDAKIT_CUTLASS_DIR AND DEFINED ENV{KDAKIT_CUTLASS_DIR})
  set(KDAKIT_CUTLASS_DIR "$ENV{KDAKIT_CUTLASS_DIR}")
endif()
if(NOT KDAKIT_CUTLASS_DIR)
  set(_kdakit_cutlass_root "${CMAKE_BINARY_DIR}/_deps/nvidia-cutlass-${KDAKIT_CUTLASS_VERSION}")
  set(_kdakit_cutlass_include "${_kdakit_cutlass_root}/cutlass_library/source/include")
  if(NOT EXISTS "${_kdakit_cutlass_include}/cute/tensor.hpp")
    set(_kdakit_cutlass_wheel "${_kdakit_cutlass_root}/nvidia_cutlass-${KDAKIT_CUTLASS_VERSION}-py3-none-any.whl")
    message(STATUS "kdakit: fetching CUTLASS ${KDAKIT_CUTLASS_VERSION} headers from PyPI")
    file(DOWNLOAD "${KDAKIT_CUTLASS_URL}" "${_kdakit_cutlass_wheel}" EXPECTED_HASH SHA256=${KDAKIT_CUTLASS_SHA256}
         STATUS _kdakit_cutlass_status)
    list(GET _kdakit_cutlass_status 0 _kdakit_cutlass_code)
    if(NOT _kdakit_cutlass_code EQUAL 0)
      message(FATAL_ERROR "kdakit: could not fetch ${KDAKIT_CUTLASS_URL} (${_kdakit_cutlass_status}); offline, pass "
                          "-DKDAKIT_CUTLASS_DIR=<folder with cute/ and cutlass/> (nvidia-cutlass=="
                          "${KDAKIT_CUTLASS_VERSION}: cutlass_library/source/include)")
    endif()
    file(ARCHIVE_EXTRACT INPUT "${_kdakit_cutlass_wheel}" DESTINATION "${_kdakit_cutlass_root}"
         PATTERNS "cutlass_library/source/include/*")
    file(REMOVE "${_kdakit_cutlass_wheel}")
  endif()
  set(KDAKIT_CUTLASS_DIR "${_kdakit_cutlass_include}")
endif()
if(NOT EXISTS "${KDAKIT_CUTLASS_DIR}/cute/tensor.hpp")
  message(FATAL_ERROR "kdakit: KDAKIT_CUTLASS_DIR=${KDAKIT_CUTLASS_DIR} has no cute/tensor.hpp")
endif()
message(STATUS "kdakit: CUTLASS headers in ${KDAKIT_CUTLASS_DIR}")
