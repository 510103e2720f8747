"""FP8 weights with block-wise scales as CUDA keeps them (quantization/fp8_block.py, fp8_block_moe.py):
the compact scales point every output row at its own, and the Triton kernels (kernels/quant/
triton_fp8_block.py, the fused MoE kernel of kernels/moe/triton_moe.py) run under Triton's interpreter
on the CPU (TRITON_INTERPRET=1, in a subprocess) against dequantize-then-matmul, so their index
arithmetic is checked on every CI run; tests/gpu runs them compiled."""
from __future__ import annotations

import torch

from shardserve.quantization.fp8 import FP8
from shardserve.quantization.fp8_block import compact_scale_rows
from tests.triton_interpreter import run_interpreted


def _block_weight(n: int, k: int, block: tuple[int, int], seed: int, parts: tuple[int, ...] = ()):
    """(E4M3 [n, k], scales spread one row per output row [n, ceil(k / bk)]) for a layer whose fused
    parts (row counts; default one part) each start a fresh grid of blocks, as loading lays them out."""
    gen = torch.Generator().manual_seed(seed)
    bn, bk = block
    q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8)
    rows = []
    for size in parts or (n,):
        grid = torch.rand(-(-size // bn), -(-k // bk), generator=gen) * 0.02 + 0.001
        rows.append(grid.repeat_interleave(bn, 0)[:size])
    return q, torch.cat(rows)


def test_compact_scales_give_every_row_its_own():
    q, rows = _block_weight(100, 70, (32, 16), 0, parts=(40, 24, 36))   # parts start inside blocks
    scales, scale_row = compact_scale_rows(rows)
    assert scale_row.dtype == torch.int32 and scale_row.shape == (100,)
    assert torch.equal(scales[scale_row.long()], rows)
    assert scales.shape[0] == 2 + 1 + 2   # ceil(40 / 32) + ceil(24 / 32) + ceil(36 / 32)


def check_kernels() -> None:
    """Under TRITON_INTERPRET=1: both loops (the runs GEMV with split-K; output tiles of 16 and 32
    rows, several along the rows), plain, with a bias and gated, and the dequantize kernel, against
    the fp32 reference, on partial edge blocks and K past the last step."""
    from shardserve.kernels.quant import reference, triton_fp8_block
    for (n, k, block, parts) in [(72, 200, (32, 32), (40, 32)), (48, 256, (16, 128), ())]:
        q, rows = _block_weight(2 * n, k, block, 1, parts=parts + parts if parts else ())
        scales, scale_row = compact_scale_rows(rows)
        bk = block[1]
        w = reference.fp8_block_weight(q, scales, scale_row, bk, torch.float32)
        assert torch.equal(triton_fp8_block.dequantize(q, scales, scale_row, bk, torch.float32), w)
        bias = torch.randn(2 * n).half()
        for rows_in in (1, 3, 5, 16, 40):
            # fp16 (the interpreter has no bf16 arithmetic)
            x = torch.randn(rows_in, k).half()
            want = torch.nn.functional.linear(x.float(), w, bias.float())
            run = triton_fp8_block.run_length(bk)
            loops = [("dot", 16, 16, run, 4, 2), ("dot", 32, 64, 16, 4, 2)]
            if rows_in <= triton_fp8_block.RUNS_ROWS:
                loops += [("runs", 16, run, 2, 2, 1), ("runs", 32, 16, 2, 2, 3)]
            for tiles in loops:
                got = triton_fp8_block.matmul(x, q, scales, scale_row, bk, bias, tiles=tiles).float()
                err = ((got - want).norm() / want.norm()).item()
                assert err < 2e-3, (n, k, block, rows_in, tiles, err)
                gated = triton_fp8_block.matmul(x, q, scales, scale_row, bk, gated=True, tiles=tiles).float()
                y = torch.nn.functional.linear(x.float(), w).half().float()
                ref = (torch.nn.functional.silu(y[:, :n]).half().float() * y[:, n:]).half().float()
                err = ((gated - ref).norm() / ref.norm()).item()
                assert err < 5e-3, ("gated", n, k, block, rows_in, tiles, err)


def check_group_quantization() -> None:
    """Under TRITON_INTERPRET=1: quantize_token_groups against its definition (a scale per token and
    128 inputs, the last group partial; rows padded with zeros to a multiple of 4; scales group-major)."""
    from shardserve.kernels.quant import triton_fp8_quant
    torch.manual_seed(0)
    x = (torch.randn(5, 300) * torch.logspace(-2, 2, 300)).half()
    q, scales = triton_fp8_quant.quantize_token_groups(x, 128)
    assert q.shape == (8, 300) and scales.shape == (8, 3) and scales.stride() == (1, 8)
    assert torch.equal(q[5:].float(), torch.zeros(3, 300))
    for g in range(3):
        part = x[:, 128 * g:128 * (g + 1)].float()
        want = (part.abs().amax(dim=1) / 448).clamp_min(1e-12)
        assert torch.equal(scales[:5, g], want)
        got, ref = q[:5, 128 * g:128 * (g + 1)].float(), (part / want[:, None]).clamp(-448, 448).to(FP8).float()
        # The interpreter's own E4M3 rounding breaks ties away from zero and misses the carry into the
        # exponent (a value just under a power of two gives half of it); compiled kernels round as
        # torch does, bit for bit (tests/gpu checks that).
        near = ((got - ref).abs() <= ref.abs() / 8) | (got * 2 == ref)
        assert near.all() and (got != ref).float().mean() < 0.1


def test_uniform_scale_rows():
    """How many rows of each fused part share a scale row, in aligned runs (kernels/moe/reference.py)."""
    from shardserve.kernels.moe.reference import uniform_rows
    blocks = torch.arange(768) // 128
    assert uniform_rows(torch.cat([blocks, blocks + 6]).int(), 2) == 128       # Qwen3-30B-A3B's gate, up
    second_rank = torch.arange(384, 768) // 128 - 3                           # its TP=2 second rank
    assert uniform_rows(torch.cat([second_rank, second_rank + 3]).int(), 2) == 128
    inside = torch.arange(16, 96) // 32                                       # parts starting 16 rows in
    assert uniform_rows(torch.cat([inside, inside + 3]).int(), 2) == 16
    assert uniform_rows((torch.arange(100) // 32).int(), 1) == 4                # 100 rows: runs of 4 at most
    assert uniform_rows(torch.tensor([0, 0, 1, 1, 1, 2], dtype=torch.int32), 1) == 1


def check_moe_kernel() -> None:
    """Under TRITON_INTERPRET=1: the fused MoE kernel with block-scaled experts against the fp32 oracle:
    gate and up rows starting 16 rows into a block of 32 (a TP rank's cut), partial edge blocks
    (96 and 80 inputs in blocks of 32), steps of 16 and 32 inputs inside a block and of 64 cut to the
    block, a pick held by another rank (-1). Then one grouped matmul with FP8 activations (W8A8,
    block and row scales, gated) against the same quantized activations dequantized: the
    interpreter's own E4M3 rounding is off, so the activations' rounding is not what is checked."""
    from shardserve.kernels.moe import reference, triton_moe
    torch.manual_seed(0)
    experts, hidden, inter, tokens, bn, bk = 6, 96, 80, 7, 32, 32

    def block_experts(rows: int, cols: int, start: int, parts: int) -> tuple[torch.Tensor, reference.BlockScales]:
        q = (torch.randn(experts, parts * rows, cols) * 100).clamp(-448, 448).to(FP8)
        part_rows = torch.arange(start, start + rows) // bn - start // bn
        per_part = int(part_rows[-1]) + 1
        scale_row = torch.cat([part_rows + p * per_part for p in range(parts)]).to(torch.int32)
        scales = torch.rand(experts, parts * per_part, -(-cols // bk)) * 0.02 + 0.001
        return q, reference.BlockScales(scales, scale_row, bk, reference.uniform_rows(scale_row, parts))
    w13, s13 = block_experts(inter, hidden, 16, 2)
    w2, s2 = block_experts(hidden, inter, 0, 1)
    assert (s13.uniform_rows, s2.uniform_rows) == (16, 32)   # gate / up runs of 16 from their first row
    x = torch.randn(tokens, hidden).half()   # fp16: the interpreter has no bf16 arithmetic
    topk_weights, topk_ids = reference.route_topk(torch.randn(tokens, experts), 2, True)
    topk_ids[0, 1] = -1
    want = reference.fused_moe(x.float(), w13, w2, topk_weights, topk_ids, s13, s2).float()
    for step, width in ((16, 16), (32, 32), (64, 32)):   # one scale per tile: both (16), down only (32)
        cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=width, BLOCK_SIZE_K=step, GROUP_SIZE_M=2, num_warps=4, num_stages=2,
                   BLOCK_SIZE_K_BLOCKS=step, W8A8=False)
        got = triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, config=cfg, w13_scale=s13, w2_scale=s2)
        err = ((got.float() - want).norm() / want.norm()).item()
        assert err < 2e-3, (step, err)

    from shardserve.kernels.moe.align import moe_align
    from shardserve.kernels.quant import triton_fp8_quant
    x = torch.randn(tokens, 256).half()
    w13, s13 = block_experts(64, 256, 0, 2)
    row_scales = torch.rand(experts, 128) * 0.02 + 0.001
    q, act_scales = triton_fp8_quant.quantize_token_groups(x, triton_moe.ACT_GROUP)
    xq = (q[:tokens].float().view(tokens, 2, 128) * act_scales[:tokens, :, None]).view(tokens, 256)
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
    sorted_ids, expert_ids, total = moe_align(topk_ids, experts, 16)
    for scales in (s13, row_scales):
        got = torch.empty(tokens * 2, 64).half()
        triton_moe.moe_gemm(q, w13, got, None, sorted_ids, expert_ids, total, 2, True, cfg, scales, act_scales)
        w = reference.dequantize_experts(w13, scales)
        for pick, expert in enumerate(topk_ids.reshape(-1).tolist()):
            if expert >= 0:
                y = xq[pick // 2] @ w[expert].t()
                want_row = torch.nn.functional.silu(y[:64]) * y[64:]
                err = ((got[pick].float() - want_row).norm() / want_row.norm()).item()
                assert err < 2e-3, (type(scales).__name__, pick, err)


def test_kernels_under_the_interpreter():
    run_interpreted("tests.quantization.test_fp8_block_kernels", "check_kernels")


def test_group_quantization_under_the_interpreter():
    run_interpreted("tests.quantization.test_fp8_block_kernels", "check_group_quantization")


def test_moe_kernel_under_the_interpreter():
    run_interpreted("tests.quantization.test_fp8_block_kernels", "check_moe_kernel")
