# CUDA kernels. Machine code for Hopper (sm_90a) and PTX for compute_80, which the driver compiles for any
# sm_80+ GPU (A100, L40S, RTX 4090, ...); KDAKIT_CUDA_GENCODE overrides the list.
set(KDAKIT_CUDA_GENCODE "-gencode=arch=compute_90a,code=sm_90a;-gencode=arch=compute_80,code=compute_80"
    CACHE STRING "nvcc -gencode flags for the kdakit kernels")
find_package(CUDAToolkit REQUIRED)
include(${CMAKE_CURRENT_LIST_DIR}/cutlass.cmake)
target_sources(kdakit PRIVATE ${KDAKIT_CUDA_SOURCES})
target_include_directories(kdakit SYSTEM PRIVATE ${KDAKIT_CUTLASS_DIR})
target_compile_definitions(kdakit PRIVATE KDAKIT_WITH_CUDA)
set_target_properties(kdakit PROPERTIES CUDA_ARCHITECTURES OFF CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
target_compile_options(kdakit PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:${KDAKIT_CUDA_GENCODE} --expt-relaxed-constexpr -lineinfo -Xptxas=-warn-spills>)
target_link_libraries(kdakit PUBLIC CUDA::cudart_static)
set(KDAKIT_WITH_CUDA_KERNELS ON)
