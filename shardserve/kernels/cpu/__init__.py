"""cpu kernels."""
