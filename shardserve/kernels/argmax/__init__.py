"""argmax kernels."""
