"""Quantized-weight matmuls: FP8 (E4M3, per-output-channel scales) and INT4 (W4A16) Triton kernels,
the INT4 weight layout they read, and their plain-torch references."""
