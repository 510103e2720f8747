"""FP4 (E2M1) weights kept 4-bit on CUDA, times bf16/fp16 activations (W4A16): the layout they are
repacked into once after loading, and the plain Triton kernels on it (the decode GEMV, 1-4 rows, is
kernels/quant/triton_fp4_gemv.py).

What a checkpoint stores (quantization/fp4.py): `packed` uint8 [N, K / 2], two E2M1 codes a byte
(input 2j in the lower nibble), a code being a sign bit and three bits of magnitude (0, 0.5, 1,
1.5, 2, 3, 4, 6); `scales` uint8 [N, K / G], NVFP4's E4M3 bits (G = 16) or MXFP4's E8M0 exponent
(G = 32, 2^(e - 127)); per row an fp32 global factor (NVFP4's, else 1).

The layout (`repack`): kernels/quant/int4_layout.py's with runs of RUN = 16 inputs, so a block is 8
runs (128 inputs) in 16 int32 words a row, nibble i of word w holding input 16 i + w of the block,
the code unchanged. A run then lies inside one scale group (16 or 32 inputs), so the GEMV
multiplies a whole run by one scale, and one load of 16 words a row brings a block. K is padded
with zero codes to whole blocks. The scales stay bytes [N, K / G]; `row_scale` [N] fp32 carries
the global factor.

Decoding is bit arithmetic, exact, no table (`_unpack_asm`, PTX: two codes into a bf16 / fp16 pair
by a `prmt`, a shift, a mask and a `lop3`; triton_fp4_gemv.py's docstring has the details): a
code's magnitude bits placed under its sign at bits 9-11 of an fp16 make the fp16 e2m1 * 2^-14,
normal and subnormal values alike (bf16: bits 6-8, e2m1 * 2^-126, then one multiply by 2^126); an
E4M3 scale byte's magnitude bits at bits 7-13 of an fp16 make e4m3 * 2^-8. Under Triton's
interpreter (no PTX) `decode_run` does the same in plain Triton. `matmul`, 5-16 rows: each run's
16 inputs multiplied on the tensor cores, the products scaled by the run's scales spread over the
rows by a one-hot product (exact, in the accumulators' layout). 17-64 rows (scale-first): each
run's weights times their scale (exact in the activations' dtype), four runs joined into one
[strip, 64] operand against activations permuted to the joined order (`_JOINED`), so the scaling
costs per weight, not per output. Both with split-K where the workspace allows. `dequantize`
writes the whole weight for cuBLAS (e2m1 * scale * the row's factor in fp32, then rounded to the
dtype), the faster way past 64 rows: every row tile of the kernels decodes the weights again.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from shardserve.kernels import pdl
from shardserve.kernels.quant import int4_layout, splitk
from shardserve.utils import cdiv

GROUP = {"nvfp4": 16, "mxfp4": 32}
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"   # no PTX there: the kernels decode in plain Triton
RUN = 16
BLOCK = 8 * RUN   # inputs a block: 16 words a row
# The input at each column of the scale-first kernel's joined tiles (4 runs, 64 inputs, a product):
# column 64 h + 4 w + 2 a + b holds input w of run 4 h + 2 b + a (tl.join nests the innermost first).
_JOINED_ON: dict[torch.device, torch.Tensor] = {}   # _JOINED per device, made at the first call (a capture's warm-up)
_JOINED = torch.tensor([16 * (4 * (c // 64) + 2 * (c & 1) + ((c >> 1) & 1)) + (c % 64) // 4 for c in range(BLOCK)])


def codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> the E2M1 codes [N, K] (int64), each byte's lower nibble first."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()


def repack(packed: torch.Tensor) -> torch.Tensor:
    """The checkpoint's bytes [N, K / 2] -> the kernels' words [N, padded(K) / 8] (int32)."""
    return int4_layout.pack(codes(packed).t(), RUN)


def codes_of(words: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of repack, as codes [N, K] (int32)."""
    return int4_layout.unpack(words, k, RUN).t()


def _unpack_asm(bf16: bool) -> str:
    """PTX: two words in ($8, $9: inputs 2v and 2v + 1 of each run); run i out in $i as a packed
    pair of e2m1 values (fp16: times 2^-14)."""
    shift, magnitude = (6, "0x01C001C0") if bf16 else (3, "0x0E000E00")
    lines = (["{ .reg .b32 t, u, v, c, z;", "mov.b32 c, 0x7E807E80;", "mov.b32 z, 0x80008000;"] if bf16   # 2^126, -0
             else ["{ .reg .b32 t, u, v;"])
    for b in range(4):
        select = b | b << 4 | (4 + b) << 8 | (4 + b) << 12    # byte b of $8, $9 into bytes 1 and 3
        lines += [f"prmt.b32 t, $8, $9, {select:#x};", "shl.b32 v, t, 4;"]
        for out, src in ((2 * b, "v"), (2 * b + 1, "t")):    # the lower code (nibble 2b), then the upper
            lines += [f"shr.u32 u, {src}, {shift};", f"and.b32 u, u, {magnitude};",
                      f"lop3.b32 ${out}, {src}, 0x80008000, u, 0xEA;"]   # (src & signs) | u
            if bf16:
                lines.append(f"fma.rn.bf16x2 ${out}, ${out}, c, z;")
    return "\n".join(lines + ["}"])


try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

if triton is not None:
    UNPACK_BF16 = tl.constexpr(_unpack_asm(True))
    UNPACK_FP16 = tl.constexpr(_unpack_asm(False))

    @triton.jit
    def decode(P, BF16: tl.constexpr):
        """The 8 runs of the words P [H, BLOCK_N, 16] as 8 tensors of e2m1 values (fp16: times 2^-14)."""
        if BF16:
            return tl.inline_asm_elementwise(UNPACK_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [P],
                                             dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(UNPACK_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [P],
                                             dtype=(tl.float16,) * 8, is_pure=True, pack=2)

    @triton.jit
    def scale_of(s_rows, ok, k0, MX: tl.constexpr, GROUP: tl.constexpr):
        """The fp32 scales of the groups holding inputs k0 (broadcasting against s_rows, the rows'
        first scale bytes); 0 where masked."""
        s = tl.load(s_rows + k0 // GROUP, mask=ok, other=0).to(tl.int32)
        if MX:   # E8M0: 2^(s - 127), built as an fp32's exponent field (s = 0, 2^-127, reads as 0)
            return (s << 23).to(tl.float32, bitcast=True)
        e4m3 = (((s & 0x7F) << 7) | ((s & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        return e4m3.to(tl.float32) * 256.0

    @triton.jit
    def decode_run(P, i: tl.constexpr):
        """Run i of the words P (nibble i of each) as fp32 E2M1 values."""
        q = (P >> (4 * i)) & 0xF
        bits = ((q & 0x7) << 9) | ((q & 0x8) << 12)
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0

    @triton.jit
    def decode_runs(P, ASM: tl.constexpr, BF16: tl.constexpr):
        """The 8 runs of the words P as tensors in the activations' dtype: e2m1 values (compiled
        fp16: times 2^-14); the PTX when compiled, bit arithmetic in fp32 under the interpreter."""
        if ASM:
            return decode(P, BF16)
        else:
            dt = tl.bfloat16 if BF16 else tl.float16
            return (decode_run(P, 0).to(dt), decode_run(P, 1).to(dt), decode_run(P, 2).to(dt),
                    decode_run(P, 3).to(dt), decode_run(P, 4).to(dt), decode_run(P, 5).to(dt),
                    decode_run(P, 6).to(dt), decode_run(P, 7).to(dt))

    @triton.jit
    def run_part(acc, w, S, i: tl.constexpr, x_rows, m_ok, k0, k, BLOCK_M: tl.constexpr):
        """acc plus run i's products (w [BLOCK_N, 16] times its 16 activations of each row) times
        the run's scales, spread over the rows by a one-hot product (exact, and in the accumulator's
        layout: no trip through shared memory)."""
        j = tl.arange(0, 16)
        kk = k0 + 16 * i + j
        x = tl.load(x_rows + kk[:, None], mask=m_ok[None, :] & (kk < k)[:, None], other=0.0)   # [16, M]
        E = tl.where((j == i)[:, None] & m_ok[None, :], 1.0, 0.0).to(S.dtype)                # row i: ones
        return acc + tl.dot(S, E) * tl.dot(w, x)

    @triton.jit
    def scaled(w, i: tl.constexpr, s_rows, col_ok, k0, k, unit, MX: tl.constexpr, GROUP: tl.constexpr, dt):
        """Run i's weights w [BLOCK_N, 16] times their scale (and `unit`) in fp32, rounded to dt:
        exact, e2m1 times a scale needing at most 6 bits."""
        s_ok = (col_ok & (col_ok.to(tl.int32) * 0 + k0 + 16 * i < k))[:, None]   # (a tensor: the interpreter's masks)
        return (w.to(tl.float32) * (scale_of(s_rows, s_ok, k0 + 16 * i, MX, GROUP) * unit)).to(dt)

    @triton.jit
    def scaled_four(acc, wa, wb, wc, wd, i: tl.constexpr, s_rows, col_ok, x_ptr, x_off, m_ok, k0, k, unit,
                    MX: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
        """acc plus runs i..i+3 (wa..wd) scaled and joined into one [BLOCK_N, 64] operand (column
        4 w + 2 a + b: run i + 2 b + a, input w: `_JOINED`) times the activations x, permuted to that
        order by `matmul`, at inputs k0 + 16 i .. + 64 (zeros past K)."""
        dt = x_ptr.dtype.element_ty
        W = tl.join(tl.join(scaled(wa, i, s_rows, col_ok, k0, k, unit, MX, GROUP, dt),
                            scaled(wb, i + 1, s_rows, col_ok, k0, k, unit, MX, GROUP, dt)),
                    tl.join(scaled(wc, i + 2, s_rows, col_ok, k0, k, unit, MX, GROUP, dt),
                            scaled(wd, i + 3, s_rows, col_ok, k0, k, unit, MX, GROUP, dt)))
        kk = k0 + tl.arange(0, 64)
        xb = tl.load(x_ptr + (x_off + 16 * i + kk[:, None]), mask=m_ok[None, :], other=0.0)
        return tl.dot(tl.reshape(W, [BLOCK_N, 64]), xb, acc)

    @triton.jit
    def fp4_matmul_kernel(x_ptr, w_ptr, s_ptr, r_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, rows, n, k, words, stride_x,
                          stride_s, stride_o, MX: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
                          SCALE_FIRST: tl.constexpr, PDL: tl.constexpr):
        # Per block of 128 inputs: the 8 runs decoded at once. Without SCALE_FIRST: each run's
        # product (K = 16) scaled by its scales spread over the rows. SCALE_FIRST: each run's weights times
        # their scale (exact in the activations' dtype), runs joined four by four into [BLOCK_N, 64]
        # tiles, two products with K = 64 against activations permuted to the joined order (the
        # joins keep fewer values live than one of 128; int32 offsets into x, fewer registers than
        # pointers). The fp32 sums take the rows' global factor at the end. The grid: (strips, row
        # tiles), or with SPLIT > 1 (one row tile) (strips, parts of K) (split-K); SCALE_FIRST without
        # a split (row tiles, strips), so that the programs side by side share one strip of weights
        # (read once from memory) while the activations stay in L2.
        pdl.start(PDL)
        BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
        ROWS_FIRST: tl.constexpr = SCALE_FIRST and SPLIT == 1
        strip, tile = (tl.program_id(1), tl.program_id(0)) if ROWS_FIRST else (tl.program_id(0), tl.program_id(1))
        cols = strip * BLOCK_N + tl.arange(0, BLOCK_N)
        m = (tile * BLOCK_M if SPLIT == 1 else 0) + tl.arange(0, BLOCK_M)
        col_ok = cols < n
        m_ok = m < rows
        j = tl.arange(0, 16)
        w_rows = w_ptr + cols[:, None].to(tl.int64) * words + j[None, :]
        s_rows = s_ptr + cols[:, None].to(tl.int64) * stride_s
        x_rows = x_ptr + m[None, :].to(tl.int64) * stride_x
        x_off = m[None, :] * stride_x   # SCALE_FIRST's int32 offsets (`matmul` keeps x under 2^31 values)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        blocks = tl.cdiv(k, 128)
        per = tl.cdiv(blocks, SPLIT)
        first = tl.program_id(1) * per if SPLIT > 1 else 0
        for blk in range(first, tl.minimum(first + per, blocks)):
            k0 = blk * 128
            P = tl.load(w_rows + k0 // 8, mask=col_ok[:, None], other=0)
            w0, w1, w2, w3, w4, w5, w6, w7 = decode_runs(P, ASM, BF16)
            if SCALE_FIRST:   # the scaled runs side by side, 4 a product
                unit = 16384.0 if ASM and not BF16 else 1.0   # the fp16 PTX's 2^-14
                acc = scaled_four(acc, w0, w1, w2, w3, 0, s_rows, col_ok, x_ptr, x_off, m_ok, k0, k, unit, MX, GROUP,
                                  BLOCK_N)
                acc = scaled_four(acc, w4, w5, w6, w7, 4, s_rows, col_ok, x_ptr, x_off, m_ok, k0, k, unit, MX, GROUP,
                                  BLOCK_N)
            else:
                k_run = k0 + 16 * j                        # the block's runs (columns 8 and up: none)
                s_ok = col_ok[:, None] & ((j < 8) & (k_run < k))[None, :]
                S = scale_of(s_rows, s_ok, k_run[None, :], MX, GROUP)   # [BLOCK_N, 16] fp32
                S = S.to(tl.bfloat16) if ASM else S        # exact (E4M3, powers of two); the interpreter: fp32
                acc = run_part(acc, w0, S, 0, x_rows, m_ok, k0, k, BLOCK_M)
                acc = run_part(acc, w1, S, 1, x_rows, m_ok, k0, k, BLOCK_M)
                acc = run_part(acc, w2, S, 2, x_rows, m_ok, k0, k, BLOCK_M)
                acc = run_part(acc, w3, S, 3, x_rows, m_ok, k0, k, BLOCK_M)
                acc = run_part(acc, w4, S, 4, x_rows, m_ok, k0, k, BLOCK_M)
                acc = run_part(acc, w5, S, 5, x_rows, m_ok, k0, k, BLOCK_M)
                acc = run_part(acc, w6, S, 6, x_rows, m_ok, k0, k, BLOCK_M)
                acc = run_part(acc, w7, S, 7, x_rows, m_ok, k0, k, BLOCK_M)
        unit = 16384.0 if ASM and not BF16 and not SCALE_FIRST else 1.0   # the fp16 PTX's 2^-14, if still there
        acc = acc * (tl.load(r_ptr + cols, mask=col_ok, other=0.0) * unit)[:, None]
        splitk.reduce_and_finish(acc, acc, ws_ptr, cnt_ptr, n, out_ptr, b_ptr, cols, col_ok, m, rows, stride_o, SPLIT,
                                 HAS_BIAS, False)

    @triton.jit
    def fp4_dequantize_kernel(w_ptr, s_ptr, r_ptr, out_ptr, n, k, words, stride_s, MX: tl.constexpr,
                              GROUP: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * 128
        col_ok = cols < n
        j = tl.arange(0, 16)
        P = tl.load(w_ptr + cols[:, None].to(tl.int64) * words + (k0 // 8 + j)[None, :], mask=col_ok[:, None], other=0)
        s_rows = s_ptr + cols.to(tl.int64) * stride_s
        r = tl.load(r_ptr + cols, mask=col_ok, other=0.0)
        for i in tl.static_range(8):
            kk = k0 + 16 * i + j
            s = scale_of(s_rows, col_ok & (cols * 0 + k0 + 16 * i < k), k0 + 16 * i, MX, GROUP)
            w = decode_run(P, i) * s[:, None] * r[:, None]   # e2m1 * scale exact in fp32, then the factor
            tl.store(out_ptr + cols[:, None].to(tl.int64) * k + kk[None, :], w.to(out_ptr.dtype.element_ty),
                     mask=col_ok[:, None] & (kk < k)[None, :])


def tiles_for(rows: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages, SPLIT): the fastest on Llama-3-8B's shapes (`benchmarks/
    quant_gemv.py --sweep`, BENCHMARKS.md sessions 35-36). 5-16 rows (scales after the products): narrow
    strips and K in 4 parts under 8192 outputs, 64-output strips and 2 parts up to 32768, no split
    beyond (an LM head's strips fill the GPU). 17-64 rows (scales first): one row tile, K in 4 parts
    where splitk's standing workspace holds them, else 2, else none. More rows (not sent here by
    quantization/fp4.py, which dequantizes for cuBLAS): wider tiles."""
    if rows <= 16:
        return (16, 32, 2, 3, 4) if n < 8192 else (16, 64, 4, 3, 2 if n <= 32768 else 1)
    if rows <= 64:
        block_m, block_n, warps = (32, 32, 2) if rows <= 32 else (64, 64, 4)
        split = next(s for s in (4, 2, 1) if s == 1 or s * block_m * 2 * n <= splitk.MIN_FLOATS)
        return block_m, block_n, warps, 3, split
    return 128, 64, 4, 3, 1


def matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor,
           bias: torch.Tensor | None, kind: str, k: int, tiles: tuple[int, int, int, int, int] | None = None,
           scale_first: bool | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16) @ the FP4 weight^T -> [M, N] in x's dtype, on the tensor cores;
    scale_first (default: past 16 rows) scales the weights before their products (see the kernel)."""
    rows, n = x.shape[0], words.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_m, block_n, warps, stages, split = tiles or tiles_for(rows, n)
    small = rows * words.shape[1] * 8 < 2 ** 31   # the scale-first kernel's int32 offsets into x
    scale_first = 16 < rows and small if scale_first is None else scale_first
    if scale_first and not small:
        raise ValueError(f"the scale-first FP4 matmul takes fewer than 2^31 activations, not {rows} x {k}")
    if scale_first:   # the inputs of each block of 128 in the kernel's joined order, zeros up to whole blocks
        padded = words.shape[1] * 8
        order = _JOINED_ON.get(x.device)
        if order is None:
            order = _JOINED_ON[x.device] = _JOINED.to(x.device)
        x = F.pad(x, (0, padded - k)).view(rows, padded // BLOCK, BLOCK)[:, :, order].view(rows, padded)
    split = min(split, cdiv(k, BLOCK)) if rows <= block_m else 1
    grid = (cdiv(n, block_n), split) if split > 1 else (cdiv(n, block_n), cdiv(rows, block_m))
    grid = (grid[1], grid[0]) if scale_first and split == 1 else grid
    # (no split: no workspace, which an LM head's outputs would outgrow)
    ws, counters = splitk.buffers(x.device, split * block_m * 2 * n, grid[0]) if split > 1 else (out, out)
    fp4_matmul_kernel[grid](
        x, words, scales, row_scale, bias if bias is not None else row_scale, out, ws, counters, rows, n, k,
        words.shape[1], x.stride(0), scales.stride(0), out.stride(0), MX=kind == "mxfp4", GROUP=GROUP[kind],
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split, ASM=not INTERPRETED,
        SCALE_FIRST=scale_first, num_warps=warps, num_stages=stages, **pdl.launch_args(x))
    return out


def dequantize(words: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor, kind: str, k: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` (for cuBLAS on many rows), each value rounded once."""
    n = words.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=words.device)
    block_n = 32
    fp4_dequantize_kernel[(cdiv(n, block_n), cdiv(k, BLOCK))](
        words, scales, row_scale, out, n, k, words.shape[1], scales.stride(0), MX=kind == "mxfp4",
        GROUP=GROUP[kind], BLOCK_N=block_n, num_warps=4, **pdl.launch_args(words))
    return out
