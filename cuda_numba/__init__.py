"""Numba kernels of the engine, each for CUDA and for CPU (built by the kernels issue)."""
