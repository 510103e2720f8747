"""A MoE layer's routing in C (kernels/cpu/csrc/moe_route.c, what the one-call decoder stack runs)
gives kernels/moe/reference.py's route_topk bits: softmax, top-k and renormalisation in torch's
float order, for expert counts shorter and longer than torch's vectors and pick counts on both sides
of its 8-wide sum; ties inside the picks stay in C, ties across the k-th pick (and NaN rows) go to
torch.topk itself."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shardserve.kernels.cpu import moe_route
from shardserve.kernels.moe import reference

pytestmark = pytest.mark.skipif(moe_route.route_fns() is None,
                                reason="no native kernels, or torch's softmax is not its AVX-512 / AVX2 kernel")


def _odd_rows(experts: int) -> torch.Tensor:
    """A NaN, a +inf, -inf scores and huge spreads: what torch turns into NaNs or exact zeros."""
    rows = torch.randn(5, experts, generator=torch.Generator().manual_seed(3))
    rows[0, 1] = float("nan")
    rows[1, 0] = float("inf")
    rows[2, :experts // 2] = float("-inf")
    rows[3] *= 1e4
    rows[4] *= 1e-30
    return rows


@pytest.mark.parametrize("experts", [4, 8, 60, 128])
def test_c_routing_gives_torch_bits(experts):
    logits = torch.cat([moe_route.check_logits(experts, rows=64, seed=1), _odd_rows(experts)])
    for top_k in (1, 2, 3, 6, 8, 9, 16, 20):
        for renormalize in (False, True):
            if top_k <= experts:
                ours = moe_route.route(logits, top_k, renormalize)
                assert moe_route.same_picks(ours, reference.route_topk(logits, top_k, renormalize)), (top_k,
                                                                                                     renormalize)


def test_only_ties_across_the_cut_go_to_torch():
    cases = [([1.0, 1.0, 0.0, 0.0], False), ([2.0, 1.0, 1.0, 0.0], True), ([1.0, 1.0, 1.0, 0.0], True)]
    for row, to_torch in cases:
        before = moe_route.torch_topk_rows
        logits = torch.tensor([row])
        assert moe_route.same_picks(moe_route.route(logits, 2, True), reference.route_topk(logits, 2, True))
        assert (moe_route.torch_topk_rows > before) == to_torch, row


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="torch runs its AVX2 kernels here already: this module's other tests cover that path")
def test_c_routing_follows_torch_avx2_kernels():
    """ATEN_CPU_CAPABILITY=avx2: torch's softmax on 8-float vectors, the C side with it."""
    code = ("from shardserve.kernels.cpu import moe_route\n"
            "assert moe_route.route_fns().lanes == 8\n"
            "assert all(moe_route.matches_torch(e, k, True) for e in (8, 60, 128) for k in (2, 8, 9) if k <= e)\n")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
