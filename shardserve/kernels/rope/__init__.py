"""rope kernels."""
