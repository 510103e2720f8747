"""Greedy sampling's argmax over a Llama-3 vocabulary (128256 logits per row) on one GPU: torch's
cast + argmax (one thread block per row) against the chunked Triton kernels
(layers/triton_argmax.py), 32 calls on 8 logit tensors captured in a CUDA graph (issue 6).

    python3 benchmarks/greedy_argmax.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardserve.kernels.argmax import triton_argmax  # noqa: E402
from shardserve.worker.graph_profile import graph_call_ms  # noqa: E402

if __name__ == "__main__":
    for rows in (1, 8):
        xs = [torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        torch_us = graph_call_ms(lambda i: xs[i % 8].float().argmax(dim=-1), 32) * 1e3
        triton_us = graph_call_ms(lambda i: triton_argmax.argmax_rows(xs[i % 8]), 32) * 1e3
        print(f"argmax of {rows} x 128256: torch (cast + argmax) {torch_us:.1f} us, Triton {triton_us:.1f} us")
