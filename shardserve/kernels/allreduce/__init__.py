"""allreduce kernels."""
