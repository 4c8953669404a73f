# CUDA kernels: Hopper (sm_90a) machine code plus compute_80 PTX for the portable path.
set(KDAKIT_WITH_CUDA_KERNELS ON PARENT_SCOPE)
