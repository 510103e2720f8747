"""FP4 (E2M1) weights kept 4-bit on CUDA, times bf16/fp16 activations (W4A16), in Triton: the
layout NVFP4 and MXFP4 checkpoints store (quantization/fp4.py), read as it is.

- `packed` uint8 [N, K / 2]: two E2M1 values a byte, input 2j in the lower nibble, 2j + 1 in the
  upper; a nibble is a sign bit and three bits of magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6).
- `scales` uint8 [N, K / G]: one per G inputs, NVFP4's E4M3 bits (G = 16) or MXFP4's E8M0
  exponent (G = 32, 2^(e - 127)).
- `row_scale` fp32 [N]: NVFP4's global scale of the row's fused part (its inverse, compressed-
  tensors' divisor, or ModelOpt's multiplier), applied to the fp32 sum; MXFP4: ones.

Decoding is bit arithmetic, exact, no table: a nibble's three magnitude bits placed at bits 9-11 of
an fp16 (and its sign at bit 15) make the fp16 e2m1 * 2^-14, normal and subnormal values alike; an
E4M3 byte's seven magnitude bits placed at bits 7-13 make the fp16 e4m3 * 2^-8. The product of the
two (at most 3 + 4 significant bits) is exact in bf16 and fp16, so the tensor cores multiply the
checkpoint's values against the activations as dequantize-then-matmul would, summing in fp32.

One kernel for every row count: programs own BLOCK_N outputs x BLOCK_M rows and walk K, the
weight tile decoded in registers for each row tile (decode batches: one row tile of 16, so each
weight byte is read once; prefills decode it once per row tile, compute-bound anyway). Tiles
(`tiles_for`) are fixed per row count, so CUDA graphs replay one variant. Not tuned per GPU, no PDL
and no split-K yet: the bf16 and FP8 GEMVs (kernels/gemv, triton_fp8_gemv.py) are the faster-tuned
neighbours; what FP4 brings here is its memory (about 4.5 bits a weight against 16).
"""
from __future__ import annotations

import torch

from shardserve.utils import cdiv

GROUP = {"nvfp4": 16, "mxfp4": 32}

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    @triton.jit
    def _e2m1(q):
        """Nibbles (int32, 0..15) -> fp32 E2M1 values times 2^-14 (their fp16 bit pattern)."""
        return (((q & 0x7) << 9) | ((q & 0x8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _scales(s_ptr, cols, col_ok, k0, k, stride_s, MX: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The scales of inputs k0 .. k0 + BLOCK_K, one per byte of the packed tile [BLOCK_N, BLOCK_K / 2]
        (a byte's two inputs share a group), in fp32 times 2^14 (undoing _e2m1's 2^-14)."""
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        s = tl.load(s_ptr + cols[:, None].to(tl.int64) * stride_s + g[None, :],
                    mask=col_ok[:, None] & (g < k // GROUP)[None, :], other=0).to(tl.int32)
        if MX:   # E8M0: 2^(s - 127), built as an fp32's exponent field (s = 0, 2^-127, reads as 0)
            scale = (s << 23).to(tl.float32, bitcast=True) * 16384.0
        else:    # E4M3's seven magnitude bits at bits 7-13 of an fp16: e4m3 * 2^-8
            e4m3 = (((s & 0x7F) << 7) | ((s & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
            scale = e4m3.to(tl.float32) * 4194304.0   # 2^14 * 2^8
        spread = tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP // 2))
        return tl.reshape(spread, (BLOCK_N, BLOCK_K // 2))

    @triton.jit
    def fp4_matmul_kernel(x_ptr, w_ptr, s_ptr, r_ptr, b_ptr, out_ptr, m, n, k, stride_x, stride_w, stride_s,
                          stride_o, MX: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Each K step loads the packed tile [BLOCK_N, BLOCK_K / 2] whole (contiguous bytes) and
        # multiplies its lower nibbles (even inputs) and upper nibbles (odd inputs) as two products
        # against the even and odd activations: no interleaving of nibbles in registers.
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        jj = tl.arange(0, BLOCK_K // 2)
        col_ok = cols < n
        row_ok = rows < m
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
        x_rows = x_ptr + rows[None, :].to(tl.int64) * stride_x
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, k, BLOCK_K):
            byte_ok = (k0 // 2 + jj) < k // 2
            byte = tl.load(w_rows + (k0 // 2 + jj)[None, :], mask=col_ok[:, None] & byte_ok[None, :],
                           other=0).to(tl.int32)
            scale = _scales(s_ptr, cols, col_ok, k0, k, stride_s, MX, GROUP, BLOCK_N, BLOCK_K)
            x_ok = row_ok[None, :] & byte_ok[:, None]
            x_even = tl.load(x_rows + (k0 + 2 * jj)[:, None], mask=x_ok, other=0.0)                # [K / 2, M]
            x_odd = tl.load(x_rows + (k0 + 2 * jj + 1)[:, None], mask=x_ok, other=0.0)
            acc = tl.dot((_e2m1(byte & 0xF) * scale).to(x_even.dtype), x_even, acc)
            acc = tl.dot((_e2m1(byte >> 4) * scale).to(x_odd.dtype), x_odd, acc)
        acc = acc * tl.load(r_ptr + cols, mask=col_ok, other=0.0)[:, None]
        if HAS_BIAS:   # added in fp32 before the one rounding
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rows[None, :].to(tl.int64) * stride_o + cols[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=col_ok[:, None] & row_ok[None, :])


def tiles_for(rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) for a matmul of `rows` rows: decode batches one row tile of
    16 and narrow strips (a 4096-output layer gets 256 programs), prefills wider tiles."""
    if rows <= 16:
        return 16, 16, 256, 4
    if rows <= 64:
        return 64, 64, 64, 4
    return 128, 128, 64, 8


def matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor,
           bias: torch.Tensor | None, kind: str, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16) @ the FP4 weight^T -> [M, N] in x's dtype (the module docstring has the layout)."""
    m, k = x.shape
    n = packed.shape[0]
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, warps = tiles or tiles_for(m)
    grid = (cdiv(n, block_n), cdiv(m, block_m))
    fp4_matmul_kernel[grid](x, packed, scales, row_scale, bias if bias is not None else row_scale, out, m, n, k,
                            x.stride(0), packed.stride(0), scales.stride(0), out.stride(0), MX=kind == "mxfp4",
                            GROUP=GROUP[kind], HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                            BLOCK_K=block_k, num_warps=warps)
    return out
