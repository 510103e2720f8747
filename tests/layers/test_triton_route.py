"""kernels/moe/triton_route.py (CUDA's top-k routing in one kernel) under Triton's interpreter on the
CPU (TRITON_INTERPRET=1, in a subprocess) against reference.route_topk; tests/gpu runs it compiled."""
from __future__ import annotations

import torch

from tests.triton_interpreter import run_interpreted


def check_kernel() -> None:
    from shardserve.kernels.moe import reference, triton_route
    torch.manual_seed(0)
    for tokens, experts, top_k in ((1, 8, 2), (5, 60, 4), (3, 128, 8), (2, 8, 8), (4, 7, 1)):
        for renormalize in (True, False):
            for dtype in (torch.float32, torch.float16):
                logits = torch.randn(tokens, experts).to(dtype)
                want_w, want_ids = reference.route_topk(logits, top_k, renormalize)
                got_w, got_ids = triton_route.route_topk(logits, top_k, renormalize)
                assert got_ids.dtype == torch.int32 and got_w.dtype == torch.float32
                assert torch.equal(got_ids, want_ids), (tokens, experts, top_k, got_ids, want_ids)
                torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    # equal logits: the lower index first; a strided (sliced) logits tensor
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 0.1]])
    _, ids = triton_route.route_topk(logits, 3, True)
    assert ids.tolist() == [[1, 2, 4]]
    # -inf logits still give distinct experts; NaN never gives an index past the experts
    _, ids = triton_route.route_topk(torch.tensor([[float("-inf")] * 4 + [1.0, 0.0]]), 4, True)
    assert ids.tolist() == [[4, 5, 0, 1]]
    w, ids = triton_route.route_topk(torch.tensor([[0.1, float("nan"), 0.3, float("nan"), -2.0]]), 3, True)
    assert ids.tolist() == [[1, 3, 2]] and torch.isnan(w).all()
    wide = torch.randn(3, 16)
    got = triton_route.route_topk(wide[:, :10], 2, False)
    want = reference.route_topk(wide[:, :10].contiguous(), 2, False)
    assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0])


def test_route_kernel_under_the_interpreter():
    run_interpreted("tests.layers.test_triton_route", "check_kernel")
