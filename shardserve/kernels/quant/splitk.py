"""What the decode GEMVs of kernels/quant/ share: the epilogue (bias, SiLU-and-mul, one rounding,
the store) and split-K.

Split-K: with few output features per layer (small N, or wide tiles) one program per strip of
outputs leaves SMs idle, so the grid's second axis cuts K into SPLIT parts. Each program stores its
fp32 partial sums into its own slot of a workspace, then takes a ticket from the strip's counter;
the program that draws the last ticket sums the SPLIT slots in a fixed order (the result does not
depend on which program finished last), runs the epilogue and sets the counter back to zero for
the next call (so a CUDA graph can replay it). Ordering: every thread's partial stores, then a
barrier, then one thread's acq_rel atomic at GPU scope publishes them; the last program reads the
slots past L1 (`.cg`). One workspace per device, shared by every layer: kernels on a stream run one
after the other (with PDL a kernel touches memory only once the previous one has finished).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernels
    triton = None

_BUFFERS: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}
_OUTGROWN: list[torch.Tensor] = []   # buffers replaced by larger ones: graphs may hold them
MIN_FLOATS = 4 << 20     # 16 MiB: 16 rows x 2 x 14336 outputs x 8 parts fit
MIN_COUNTERS = 1 << 16


def buffers(device: torch.device, floats: int, strips: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 workspace of at least `floats`, int32 counters, zero, at least `strips`) for `device`,
    allocated once (sized so the 8B shapes never grow it, as growing inside a CUDA graph capture
    would take graph-pool memory). A buffer outgrown is kept alive, never freed: CUDA graphs captured
    before still write to it."""
    index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    ws, counters = _BUFFERS.get(index, (None, None))
    if ws is None or ws.numel() < floats:
        _OUTGROWN.extend([ws] if ws is not None else [])
        ws = torch.empty(max(floats, MIN_FLOATS), dtype=torch.float32, device=device)
    if counters is None or counters.numel() < strips:
        _OUTGROWN.extend([counters] if counters is not None else [])
        counters = torch.zeros(max(strips, MIN_COUNTERS), dtype=torch.int32, device=device)
    _BUFFERS[index] = (ws, counters)
    return ws, counters


if triton is not None:
    @triton.jit
    def finish(y, y_up, out_ptr, b_ptr, cols, col_ok, r, rows, stride_o, HAS_BIAS: tl.constexpr,
               GATED: tl.constexpr):
        """y, y_up: fp32 sums [BLOCK_N, ROWS] (scales applied) -> out[r, cols]: bias added in fp32
        before the one rounding; gated as SiluAndMul on the rounded gate_up output (silu rounded,
        then the product), as kernels/gemv/triton_gemv.py does."""
        dt = out_ptr.dtype.element_ty
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        y = y.to(dt)
        if GATED:
            g = y.to(tl.float32)
            sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            y = (sg * y_up.to(dt).to(tl.float32)).to(dt)
        ok = col_ok[:, None] & (r < rows)[None, :]
        tl.store(out_ptr + r[None, :].to(tl.int64) * stride_o + cols[:, None], y, mask=ok)   # (rows x N past 2^31)

    @triton.jit
    def reduce_and_finish(y, y_up, ws_ptr, cnt_ptr, n, out_ptr, b_ptr, cols, col_ok, r, rows, stride_o,
                          SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
        """The end of every GEMV program: the epilogue directly (SPLIT 1), or the split-K exchange
        of the module docstring. Workspace slot of part p: [p, ROWS, 2n] (gate outputs, then up)."""
        if SPLIT == 1:
            finish(y, y_up, out_ptr, b_ptr, cols, col_ok, r, rows, stride_o, HAS_BIAS, GATED)
        else:
            ROWS: tl.constexpr = y.shape[1]
            plane = ROWS * 2 * n
            offs = r[None, :] * (2 * n) + cols[:, None]
            ok = col_ok[:, None] & (r < rows)[None, :]
            slot = ws_ptr + tl.program_id(1) * plane + offs
            tl.store(slot, y, mask=ok)
            if GATED:
                tl.store(slot + n, y_up, mask=ok)
            tl.debug_barrier()   # every thread's stores before the ticket
            ticket = tl.atomic_add(cnt_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT - 1:
                y = tl.zeros(y.shape, tl.float32)
                y_up = tl.zeros(y.shape, tl.float32)
                for p in tl.static_range(SPLIT):   # a fixed order: deterministic sums
                    y += tl.load(ws_ptr + p * plane + offs, mask=ok, other=0.0, cache_modifier=".cg")
                    if GATED:
                        y_up += tl.load(ws_ptr + p * plane + offs + n, mask=ok, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + tl.program_id(0), 0)   # ready for the next call
                finish(y, y_up, out_ptr, b_ptr, cols, col_ok, r, rows, stride_o, HAS_BIAS, GATED)
