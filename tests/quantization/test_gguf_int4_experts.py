"""GGUF's 4-bit MoE experts (Q4_0, Q4_1, Q4_K) in kernels/moe/int4_experts.py's layout, as CUDA keeps
them (quantization/gguf_moe.py): the values are the file's (Q4_K's scale and min products rounded
once to fp16), and the fused INT4 MoE kernel's two matmuls (zero points, and mins: dot(a, q) s -
(sum a) m per block) run under Triton's interpreter on the CPU (TRITON_INTERPRET=1, in a
subprocess) against the torch path on the same experts. tests/gpu runs them compiled."""
from __future__ import annotations

import pytest
import torch

from shardserve.kernels.quant import gguf_layout
from tests.triton_interpreter import run_interpreted

E, H, INTER, TOKENS, TOP = 4, 256, 256, 5, 2


def gguf_experts(type_name: str, n: int, k: int, seed: int):
    """(Int4Experts of E random experts [n, k] of the type, as int4_experts.from_gguf_blocks converts
    a file's stacked blocks, the file's values [E, n, k])."""
    from shardserve.kernels.moe.int4_experts import from_gguf_blocks
    from tests.quantization.test_gguf_quant import _weights
    raw, values = zip(*(_weights(type_name, n, k, seed=seed + e) for e in range(E)))
    return from_gguf_blocks(torch.stack(raw), type_name, k, torch.device("cpu")), torch.stack(values)


@pytest.mark.parametrize("type_name", gguf_layout.INT4_TYPES)
def test_experts_hold_the_files_values(type_name):
    experts, values = gguf_experts(type_name, 2 * INTER, H, 0)
    assert experts.zeros.dtype == (torch.uint8 if type_name == "Q4_0" else torch.float16)
    got = experts.dequantize_all()
    if type_name == "Q4_K":   # each product rounded once to fp16
        assert ((got - values).abs() <= 2.0 ** -10 * values.abs().amax()).all()
    else:
        assert torch.equal(got, values)


def check_kernel() -> None:
    """Under TRITON_INTERPRET=1: both matmuls of triton_moe_int4.fused_moe (aligned blocks, the
    per-input group lookup and the vector kernel) against torch_moe's expert-by-expert path; the pick sum in torch (the
    interpreter cannot run that kernel's masks)."""
    from shardserve.kernels.moe import torch_moe, triton_moe, triton_moe_int4
    from shardserve.kernels.moe.align import moe_align
    torch.manual_seed(0)
    for type_name in gguf_layout.INT4_TYPES:
        w13, _ = gguf_experts(type_name, 2 * INTER, H, 0)
        w2, _ = gguf_experts(type_name, H, INTER, 10)
        # fp16 (the interpreter has no bf16 arithmetic), small: the random K-quant values reach ~10
        x = (torch.randn(TOKENS, H) * 0.05).half()
        weights, ids = torch.topk(torch.softmax(torch.randn(TOKENS, E), -1), TOP)
        want = torch_moe.fused_moe(x.float(), w13, w2, weights, ids)
        for aligned in (True, False):
            cfg = {**triton_moe.default_config(TOKENS, E, TOP), "ALIGNED_GROUPS": aligned}
            sorted_ids, expert_ids, total = moe_align(ids.contiguous(), E, cfg["BLOCK_SIZE_M"])
            act = torch.empty(TOKENS * TOP, INTER, dtype=x.dtype)
            triton_moe_int4.moe_int4_gemm(x, w13, act, None, sorted_ids, expert_ids, total, TOP, True, cfg)
            y = torch.empty(TOKENS * TOP, H, dtype=x.dtype)
            triton_moe_int4.moe_int4_gemm(act, w2, y, weights.reshape(-1).float(), sorted_ids, expert_ids, total, 1,
                                          False, cfg)
            got = y.float().view(TOKENS, TOP, H).sum(1)
            err = ((got - want).norm() / want.norm()).item()
            assert err < 5e-3, (type_name, aligned, err)
        # the vector kernel (decode): one program per pick and strip of outputs
        act = torch.empty(TOKENS * TOP, INTER, dtype=x.dtype)
        triton_moe_int4.moe_int4_vec(x, w13, act, None, ids.int(), TOP, True)
        y = torch.empty(TOKENS * TOP, H, dtype=x.dtype)
        triton_moe_int4.moe_int4_vec(act, w2, y, weights.reshape(-1).float(), ids.int(), 1, False)
        got = y.float().view(TOKENS, TOP, H).sum(1)
        err = ((got - want).norm() / want.norm()).item()
        assert err < 5e-3, (type_name, "vec", err)


def test_fused_int4_moe_kernel_under_the_interpreter():
    run_interpreted("tests.quantization.test_gguf_int4_experts", "check_kernel")
