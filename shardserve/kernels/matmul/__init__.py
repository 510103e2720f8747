"""matmul kernels."""
