"""Group a batch's (token, pick) pairs by expert for the grouped matmul, on the GPU, with no host sync.

The fused MoE kernel multiplies tiles of BLOCK_M rows that all go to one expert. This module lays the
T * K picks out expert by expert, each expert's run padded up to a multiple of BLOCK_M:
- `sorted_token_ids` [max_padded] int32: flat pick indices (token * K + slot); padding holds T * K
  (a sentinel past every real pick, which the kernel masks off);
- `expert_ids` [max_blocks] int32: the expert of each BLOCK_M block;
- `num_tokens_post_padded` [1] int32: how much of `sorted_token_ids` is used; blocks past it exit.
Picks with id -1 (held by another expert-parallel rank) are left out altogether.

Every output has a size fixed by (T, K, E, BLOCK_M) alone, and nothing is read back to the host, so a
CUDA graph can capture it. Within an expert the order of picks is whatever the atomics give: each
output row of the matmul depends on its own row only, so the result does not depend on it.
"""
from __future__ import annotations

import functools

import torch

# Up to this many picks one program does the whole job in one launch (decode); past it a grid of
# programs counts and scatters, with the prefix sum between them (three launches, but parallel).
ONE_PROGRAM_MAX = 4096
_CHUNK = 1024


def max_padded_len(num_picks: int, num_experts: int, block_m: int) -> int:
    """At most min(E, picks) experts are hit, each padding fewer than BLOCK_M slots."""
    return num_picks + min(num_experts, num_picks) * (block_m - 1)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def align_kernel(ids_ptr, counts_ptr, sorted_ptr, expert_ptr, total_ptr, cursor_ptr, numel, num_experts,
                     STEP: tl.constexpr, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCKS_CHUNK: tl.constexpr):
        # STEP 0: the whole job in one program. Else one step per launch: 1 counts a chunk of picks per
        # program, 2 (one program) lays out the runs, 3 scatters a chunk per program.
        if STEP == 0:
            lo = 0
            hi = numel
        else:
            lo = tl.program_id(0) * CHUNK
            hi = lo + CHUNK
        e = tl.arange(0, E_POW2)
        e_ok = e < num_experts

        if STEP == 0 or STEP == 1:
            counts = tl.zeros([E_POW2], tl.int32)
            for c0 in range(lo, hi, CHUNK):
                offs = c0 + tl.arange(0, CHUNK)
                ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
                ok = (ids >= 0) & (ids < num_experts)
                counts += tl.histogram(tl.where(ok, ids, 0), E_POW2, mask=ok)
            if STEP == 1:
                tl.atomic_add(counts_ptr + e, counts, mask=e_ok)
        if STEP == 2:
            counts = tl.load(counts_ptr + e, mask=e_ok, other=0)

        if STEP == 0 or STEP == 2:
            # Each expert's run starts where the padded runs before it end; the scatter claims slots
            # from `cursor`, which starts at each run's start.
            padded = tl.where(e_ok, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
            ends = tl.cumsum(padded, 0)
            starts = ends - padded
            tl.store(cursor_ptr + e, starts, mask=e_ok)
            total = tl.sum(padded, 0)
            tl.store(total_ptr, total)
            # The tail of each run (fewer than BLOCK_M slots) gets the sentinel.
            first_pad = starts + counts
            for j0 in tl.static_range(0, BLOCK_M, 16):
                j = j0 + tl.arange(0, 16)
                pad_ok = e_ok[:, None] & (j[None, :] < (padded - counts)[:, None])
                tl.store(sorted_ptr + first_pad[:, None] + j[None, :], numel, mask=pad_ok)
            # Block b belongs to the expert whose run covers b * BLOCK_M: the number of runs ending at
            # or before it (an empty run ends where the one before it does, so it is skipped).
            for b0 in range(0, total // BLOCK_M, BLOCKS_CHUNK):
                b = b0 + tl.arange(0, BLOCKS_CHUNK)
                before = (ends[None, :] <= (b * BLOCK_M)[:, None]) & e_ok[None, :]
                tl.store(expert_ptr + b, tl.sum(before.to(tl.int32), 1), mask=b * BLOCK_M < total)

        if STEP == 0:
            tl.debug_barrier()  # the cursor stores above must land before any thread claims a slot
        if STEP == 0 or STEP == 3:
            for c0 in range(lo, hi, CHUNK):
                offs = c0 + tl.arange(0, CHUNK)
                ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
                ok = (ids >= 0) & (ids < num_experts)
                slot = tl.atomic_add(cursor_ptr + ids, 1, mask=ok)
                tl.store(sorted_ptr + slot, offs, mask=ok)

    return triton, align_kernel


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) for `topk_ids` [T, K] (-1 = not here).
    `block_m` must be a power of two, at least 16."""
    triton, kernel = _kernel()
    ids = topk_ids.reshape(-1)
    numel, dev = ids.numel(), ids.device
    max_padded = max_padded_len(numel, num_experts, block_m)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(triton.cdiv(max_padded, block_m), dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    e_pow2 = max(16, triton.next_power_of_2(num_experts))
    common = dict(BLOCK_M=block_m, E_POW2=e_pow2, BLOCKS_CHUNK=max(16, min(64, 8192 // e_pow2)), num_warps=4)
    args = (sorted_ids, expert_ids, total, cursor, numel, num_experts)
    if numel <= ONE_PROGRAM_MAX:
        chunk = min(_CHUNK, max(16, triton.next_power_of_2(numel)))
        kernel[(1,)](ids, cursor, *args, STEP=0, CHUNK=chunk, **common)
    else:
        counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
        grid = (triton.cdiv(numel, _CHUNK),)
        for step, g in ((1, grid), (2, (1,)), (3, grid)):
            kernel[g](ids, counts, *args, STEP=step, CHUNK=_CHUNK, **common)
    return sorted_ids, expert_ids, total
