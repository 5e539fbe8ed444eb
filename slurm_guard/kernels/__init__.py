"""The guard's compute kernels: C sources (package data), their loader, Triton versions.

Every kernel here has a torch-op specification that defines its output bit for bit; the native
(C) and Triton versions are tested against it. `native` compiles the C sources with the system
compiler on first use and caches the shared library; `sketch` is the fused per-bucket check of
the communication hook; `triton_kernels` holds the GPU versions (imported only when Triton is).
"""

__all__ = [
    "abft_native",
    "abft_triton",
    "bucket",
    "build",
    "inputs",
    "native",
    "sketch",
    "triton_kernels",
    "warm",
]  # its modules, imported by path
