"""Rendering fused kernels as Triton source: ``triton_printer`` prints scalar SymPy
expressions, ``triton_kernel`` writes whole kernels (indexing, loads, reductions, stores)."""
