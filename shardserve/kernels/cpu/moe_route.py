"""A MoE layer's routing in C with torch's bits (csrc/moe_route.c): what the native decoder stack
calls in place of kernels/moe/reference.py's route_topk (softmax, top-k, renormalisation).

The C side repeats torch's CPU operations in torch's order; two things come from torch itself:
the vector exp its softmax kernel calls (Sleef's, exported by libtorch_cpu: the 16-float one under
torch's AVX-512 kernels, the 8-float one under AVX2), and, for the rare row whose k-th pick is tied
with an expert left out (or holds a NaN), torch.topk through a ctypes callback, since which of the
tied experts torch keeps is its selection algorithm's business. `matches_torch` checks the bits
against route_topk once per (experts, top-k, renormalize) before the stack relies on them, so a
torch whose kernels changed keeps the module path instead of drifting.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from shardserve.kernels.cpu import cpu_ops
from shardserve.kernels.moe import reference

logger = logging.getLogger("shardserve")

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class RouteFns(ctypes.Structure):
    """csrc/moe_route.c's RouteFns: torch's vector exp, its width, the torch.topk callback."""

    _fields_ = [("exp", _ptr), ("lanes", _i64), ("topk", _ptr)]


_TOPK = ctypes.CFUNCTYPE(None, _ptr, _i64, _i64, _ptr, _ptr)
torch_topk_rows = 0   # rows the C routing handed to torch.topk (ties across the k-th pick, NaNs): for tests


def _torch_topk(probs: int, experts: int, k: int, weights: int, ids: int) -> None:
    """torch.topk of one row of probabilities, written where the C side asked."""
    global torch_topk_rows
    torch_topk_rows += 1
    row = torch.frombuffer((ctypes.c_float * experts).from_address(probs), dtype=torch.float32)
    values, picks = torch.topk(row, k)
    ctypes.memmove(weights, values.data_ptr(), 4 * k)
    ctypes.memmove(ids, picks.data_ptr(), 8 * k)


_topk_callback = _TOPK(_torch_topk)   # held for the life of the process: C keeps its address


@functools.cache
def route_fns() -> RouteFns | None:
    """The functions the C routing takes from torch, or None where torch's softmax is not a kernel
    the C side follows (a build other than its AVX-512 or AVX2 one, no native kernels)."""
    lanes = {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability())
    if lanes is None or not cpu_ops.available():
        return None
    try:
        torch_cpu = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        exp = getattr(torch_cpu, "Sleef_expf16_u10" if lanes == 16 else "Sleef_expf8_u10")
    except (OSError, AttributeError) as e:
        logger.debug("MoE routing stays in torch (torch's vector exp not found: %s)", e)
        return None
    return RouteFns(exp=ctypes.cast(exp, _ptr).value, lanes=lanes,
                    topk=ctypes.cast(_topk_callback, _ptr).value)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """route_topk's (weights fp32 [T, k], ids [T, k]; int64 here) from the C routing. Picks of equal
    weight may come in another order than torch.topk's (nothing downstream tells them apart)."""
    fns = route_fns()
    assert fns is not None, "the C routing needs torch's AVX-512 or AVX2 kernels and the native library"
    probs = router_logits.to(torch.float32).contiguous().clone()   # the C side writes the probabilities
    t, experts = probs.shape
    weights = torch.empty(t, top_k, dtype=torch.float32)
    ids = torch.empty(t, top_k, dtype=torch.int64)
    tmp = torch.empty(experts, dtype=torch.float32)
    cpu_ops.moe_route(ctypes.byref(fns), probs.data_ptr(), t, experts, top_k, int(renormalize), weights.data_ptr(),
                      ids.data_ptr(), tmp.data_ptr())
    return weights, ids


def same_picks(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether two routings pick the same experts with the same weight bits, row by row (the order of
    a row's picks aside)."""
    (wa, ia), (wb, ib) = a, b
    if wa.shape != wb.shape:
        return False
    ia, ib = ia.long(), ib.long()
    oa, ob = ia.argsort(dim=-1), ib.argsort(dim=-1)
    return (torch.equal(ia.gather(-1, oa), ib.gather(-1, ob))
            and torch.equal(wa.gather(-1, oa).view(torch.int32), wb.gather(-1, ob).view(torch.int32)))


def check_logits(experts: int, rows: int = 96, seed: int = 0) -> torch.Tensor:
    """Router logits that try the routing's corners: spreads from tiny to wide, rows with many equal
    values (ties inside the picks and across the k-th place), one row all equal."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-3, 1.5, rows)[:, None]
    logits = torch.randn(rows, experts, generator=gen) * spread
    tied = torch.randint(0, 3, (rows // 4, experts), generator=gen).float()
    return torch.cat([logits, tied, torch.zeros(1, experts)])


@functools.cache
def matches_torch(experts: int, top_k: int, renormalize: bool) -> bool:
    """Whether the C routing gives route_topk's picks and weight bits on check_logits (once per
    shape and process); False where it cannot run here."""
    if route_fns() is None or not 0 < top_k <= min(experts, 64):
        return False
    logits = check_logits(experts)
    if same_picks(route(logits, top_k, renormalize), reference.route_topk(logits, top_k, renormalize)):
        return True
    logger.warning("MoE routing in C differs from torch's here (%d experts, top-%d); MoE layers run as modules",
                   experts, top_k)
    return False
