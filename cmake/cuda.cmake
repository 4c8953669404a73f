# CUDA kernels. Machine code for Hopper (sm_90a) and PTX for compute_80, which the driver compiles for any
# sm_80+ GPU (A100, L40S, RTX 4090, ...); KDAKIT_CUDA_GENCODE overrides the list.
set(KDAKIT_CUDA_GENCODE "-gencode=arch=compute_90a,code=sm_90a;-gencode=arch=compute_80,code=compute_80"
    CACHE STRING "nvcc -gencode flags for the kdakit kernels")
find_package(CUDAToolkit REQUIRED)
include(${CMAKE_CURRENT_LIST_DIR}/cutlass.cmake)
if(NOT KDAKIT_CUDA_KERNELS OR NOT KDAKIT_CUDA_SOURCES)
  return()
endif()
# The kernels join the library's objects; the libraries link the runtime (CMakeLists.txt), and KDAKIT_WITH_CUDA is
# defined in the generated kdakit/config.h.
target_sources(kdakit_objects PRIVATE ${KDAKIT_CUDA_SOURCES})
target_include_directories(kdakit_objects SYSTEM PRIVATE ${KDAKIT_CUTLASS_DIR} ${CUDAToolkit_INCLUDE_DIRS})
set_target_properties(kdakit_objects PROPERTIES CUDA_ARCHITECTURES OFF CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
# CMake applies VISIBILITY_INLINES_HIDDEN to C++ only; the host compiler gets it here for the CUDA sources.
target_compile_options(kdakit_objects PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:${KDAKIT_CUDA_GENCODE} --expt-relaxed-constexpr -lineinfo -Xptxas=-warn-spills
                             -Xcompiler=-fvisibility-inlines-hidden>)
set(KDAKIT_WITH_CUDA_KERNELS ON)
