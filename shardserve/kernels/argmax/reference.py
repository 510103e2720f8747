"""Greedy sampling's argmax in plain torch: the Triton kernel's oracle (ties go to the first index)."""
from __future__ import annotations

import torch


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)
