"""Mixture-of-experts kernels: routing (top-k over router logits), the experts' grouped matmuls."""
