"""Where an RMSNorm inside the skinny matmul costs time (issue 6, session 10; one GPU).

    python3 benchmarks/gemv_norm_variants.py [tp2]

A stand-alone copy of kernels/gemv/triton_gemv.py's loop (no bias, no TP exchange) with the norm done in
one of several ways, on Llama-3-8B's qkv / gate_up / o / down shapes at TP=1 (or qkv and gate_up
at TP=2 with `tp2`), one row:
  N0 no norm (the plain matmul)           N1 x^T x on the tensor cores + weighing x in the loop
  N2 tl.sum(x * x) + weighing in the loop  N3 only the weighing in the loop
  N4 only x^T x in the loop                N5 1/rms read from memory, applied to the sums at the end
Each variant runs 100 calls in a CUDA graph (one weight, so the smaller ones partly come from L2:
compare variants, not absolute bandwidths); best of 5 replays, us per call and weight GB/s.
"""
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def gemv_norm_variant(x_ptr, w_ptr, out_ptr, inv_ptr, g_ptr, rows, n, k, eps, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    col_ok = cols < n
    w_rows = w_ptr + cols[:, None].to(tl.int64) * k
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    gram = tl.zeros([BLOCK_M, BLOCK_M], tl.float32)
    ssq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        x = tl.load(x_ptr + m[None, :] * k + (k0 + kk)[:, None], mask=m[None, :] < rows, other=0.0)
        if NORM == 1 or NORM == 4:
            gram = tl.dot(tl.trans(x), x, gram)
        if NORM == 2:
            xf = x.to(tl.float32)
            ssq += tl.sum(xf * xf, axis=0)
        if NORM == 1 or NORM == 2 or NORM == 3:
            x = (x.to(tl.float32) * tl.load(g_ptr + k0 + kk).to(tl.float32)[:, None]).to(x.dtype)
        w = tl.load(w_rows + (k0 + kk)[None, :], mask=col_ok[:, None], other=0.0)
        acc = tl.dot(w, x, acc)
        if GATED:
            w_up = tl.load(w_rows + n * k + (k0 + kk)[None, :], mask=col_ok[:, None], other=0.0)
            acc_up = tl.dot(w_up, x, acc_up)
    if NORM == 1 or NORM == 4:
        ssq = tl.sum(tl.where(m[:, None] == m[None, :], gram, 0.0), axis=0)
    if NORM == 5:
        inv = tl.load(inv_ptr + m)[None, :]
    else:
        inv = (1.0 / tl.sqrt(ssq / k + eps))[None, :]
    if NORM != 0:
        acc *= inv
        acc_up *= inv
    y = acc.to(tl.bfloat16)
    if GATED:
        y = (y.to(tl.float32) * acc_up).to(tl.bfloat16)
    tl.store(out_ptr + m[None, :] * n + cols[:, None], y, mask=col_ok[:, None] & (m[None, :] < rows))


def main() -> None:
    dev = "cuda"
    shapes = {"qkv": (6144, 4096, False, 64, 256), "gate_up": (14336, 4096, True, 64, 128),
              "o": (4096, 4096, False, 32, 512), "down": (4096, 14336, False, 32, 512)}
    if len(sys.argv) > 1 and sys.argv[1] == "tp2":
        shapes = {"qkv": (3072, 4096, False, 32, 512), "gate_up": (7168, 4096, True, 64, 128)}
    for name, (n, k, gated, bn, bk) in shapes.items():
        w = torch.randn((2 * n if gated else n), k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        g = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5
        inv = torch.ones(16, device=dev)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        res = []
        for norm in (0, 1, 2, 3, 4, 5, 0):
            def call():
                gemv_norm_variant[(triton.cdiv(n, bn),)](x, w, out, inv, g, 1, n, k, 1e-5, BLOCK_M=16, BLOCK_N=bn,
                                                         BLOCK_K=bk, GATED=gated, NORM=norm, num_warps=4, num_stages=4)
            call()
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for _ in range(100):
                    call()
            gr.replay()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            best = 1e9
            for _ in range(5):
                s.record()
                gr.replay()
                e.record()
                torch.cuda.synchronize()
                best = min(best, s.elapsed_time(e) * 10)   # us per call
            nbytes = w.numel() * 2
            res.append(f"N{norm} {best:6.1f}us {nbytes / best / 1e3:5.0f}GB/s")
        print(f"{name:8s}", " | ".join(res), flush=True)


main()
