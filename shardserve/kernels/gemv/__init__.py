"""gemv kernels."""
