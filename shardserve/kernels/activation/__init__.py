"""activation kernels."""
