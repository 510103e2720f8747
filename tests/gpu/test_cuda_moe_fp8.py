"""FP8 experts in the Triton fused MoE (kernels/moe/triton_moe.py): E4M3 weights with per-row scales,
bf16/fp16 activations, against dequantize-then-reference in fp32 (kernels/moe/reference.py); decode
and prefill sizes, expert parallelism's -1 picks, odd sizes, every tile shape, CUDA-graph replay;
then a tiny Qwen3-MoE served on the GPU with `--quantization fp8` (experts E4M3 through the kernel)
against the same model's CPU torch path. Figures (bf16 vs FP8 kernel time) go to $OUT if set."""
from __future__ import annotations

import gc

import pytest
import torch

from shardserve.kernels.moe import reference
from tests.gpu.cuda_timing import report
from tests.gpu.cuda_timing import time_ms as _time_ms

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("GPU-only: needs CUDA and Triton", allow_module_level=True)

FP8 = torch.float8_e4m3fn


def _fp8_experts(num_experts: int, hidden: int, inter: int) -> tuple[torch.Tensor, ...]:
    """(w13, w13_scale, w2, w2_scale): E4M3 with per-row scales, rows of very different magnitudes."""
    out = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        w = torch.randn(num_experts, rows, cols, device="cuda") / cols ** 0.5
        w = w * torch.logspace(-1, 1, rows, device="cuda")[None, :, None]
        scale = w.abs().amax(dim=2) / 448.0
        out += [(w / scale[..., None]).to(FP8), scale.float().contiguous()]
    return tuple(out)


def _routing(tokens: int, experts: int, top_k: int, ep: bool) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = reference.route_topk(torch.randn(tokens, experts, device="cuda"), top_k, True)
    if ep:   # about 40% of the picks live on another expert-parallel rank
        ids = torch.where(torch.rand(ids.shape, device="cuda") < 0.4, -1, ids)
    return weights, ids


def _fp8_groups(x: torch.Tensor) -> torch.Tensor:
    """x rounded as triton_moe's FP8 activations: E4M3 with a scale per row and 128 inputs."""
    k = x.shape[1]
    g = torch.nn.functional.pad(x.float(), (0, -k % 128)).view(x.shape[0], -1, 128)   # the last group partial
    scale = (g.abs().amax(dim=2, keepdim=True) / 448.0).clamp_min(1e-12)
    return ((g / scale).clamp(-448, 448).to(FP8).float() * scale).view(x.shape[0], -1)[:, :k]


def _w8a8_reference(x, w13, s13, w2, s2, weights, ids) -> torch.Tensor:
    """reference.fused_moe with the activations of both matmuls rounded as the W8A8 kernels round them
    (the gate_up output first stored in x's dtype)."""
    w13, w2 = reference.dequantize_experts(w13, s13), reference.dequantize_experts(w2, s2)
    out, xq, inter = torch.zeros(x.shape, device=x.device), _fp8_groups(x), w2.shape[2]
    for expert in range(w13.shape[0]):
        tokens, slot = torch.nonzero(ids == expert, as_tuple=True)
        if tokens.numel():
            gate_up = xq[tokens] @ w13[expert].t()
            act = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
            y = _fp8_groups(act) @ w2[expert].t()
            out.index_add_(0, tokens, y * weights[tokens, slot].float().unsqueeze(1))
    return out


def _check(got, x, w13, s13, w2, s2, weights, ids, config=None) -> None:
    from shardserve.kernels.moe import triton_moe
    if (config or {}).get("W8A8", triton_moe.w8a8(ids.numel(), w13.shape[0])):   # FP8 activations too
        want = _w8a8_reference(x, w13, s13, w2, s2, weights, ids)
    else:
        want = reference.fused_moe(x.float(), w13, w2, weights, ids, s13, s2)   # dequantized in fp32
    scale = max(want.abs().max().item(), 1e-3)
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * scale, f"max error {err:.4g} at output scale {scale:.4g}"
    assert got.dtype == x.dtype and got.shape == x.shape


CASES = [  # tokens, experts, hidden, inter, top_k, ep
    (1, 8, 256, 128, 2, False),
    (3, 128, 2048, 768, 8, False),     # Qwen3-30B-A3B at decode
    (7, 16, 384, 192, 1, True),
    (100, 32, 256, 128, 4, True),
    (600, 64, 320, 200, 8, False),     # sizes no tile divides; the grid path of the grouping
    (300, 8, 4096, 1792, 2, True),     # Mixtral-like, 4-way sharded intermediate
]


@pytest.mark.parametrize("tokens,experts,hidden,inter,top_k,ep", CASES)
def test_fp8_fused_moe_matches_dequantized_reference(tokens, experts, hidden, inter, top_k, ep):
    from shardserve.kernels.moe import triton_moe
    torch.manual_seed(tokens * 7 + experts)
    w13, s13, w2, s2 = _fp8_experts(experts, hidden, inter)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = _routing(tokens, experts, top_k, ep)
    assert triton_moe.handles(x, w13, s13) and not triton_moe.handles(x, w13)   # FP8 needs its scales
    _check(triton_moe.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2), x, w13, s13, w2, s2,
           weights, ids)


@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_fp8_fused_moe_any_tile_config_fp16(block_m):
    from shardserve.kernels.moe import triton_moe
    torch.manual_seed(block_m)
    cfg = dict(BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=4, num_warps=4, num_stages=2,
               down=dict(BLOCK_SIZE_N=64, BLOCK_SIZE_K=32))
    w13, s13, w2, s2 = _fp8_experts(16, 200, 136)
    x = torch.randn(90, 200, device="cuda").to(torch.float16)
    weights, ids = _routing(90, 16, 4, True)
    out = triton_moe.fused_moe(x, w13, w2, weights, ids, config=cfg, w13_scale=s13, w2_scale=s2)
    _check(out, x, w13, s13, w2, s2, weights, ids)


def test_fp8_fused_moe_replays_in_cuda_graph():
    from shardserve.kernels.moe import triton_moe
    torch.manual_seed(5)
    w13, s13, w2, s2 = _fp8_experts(64, 512, 256)
    x = torch.randn(4, 512, device="cuda").to(torch.bfloat16)
    weights, ids = _routing(4, 64, 4, False)
    run = lambda: triton_moe.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)   # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for ep in (False, True):
        new_weights, new_ids = _routing(4, 64, 4, ep)
        x.copy_(torch.randn_like(x))
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        _check(out.clone(), x, w13, s13, w2, s2, weights, ids)


def _gpu_and_cpu_prompt_logprobs(path: str, monkeypatch, quantization: str | None = None,
                                 **gpu_kw) -> tuple[torch.Tensor, torch.Tensor, list]:
    """The prompt log-probs of a tiny MoE checkpoint served on the GPU and on the CPU (bf16), with its
    experts held in E4M3 on both, and the FP8 scales each call of the Triton MoE kernel got. 12 prompt
    tokens keep the dense FP8 layers on their weight-only GEMVs rather than on FP8 activations
    (`_scaled_mm`), whose rounding would swamp the comparison."""
    from shardserve import LLM, SamplingParams
    from shardserve.kernels.moe import triton_moe
    from shardserve.layers.moe import FusedMoE
    calls = []
    fused = triton_moe.fused_moe
    monkeypatch.setattr(triton_moe, "fused_moe", lambda *a, **kw: calls.append(kw.get("w13_scale")) or fused(*a, **kw))
    prompt = list(range(3, 15))
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=5, ignore_eos=True)
    lps = []
    for device in ("cuda", "cpu"):
        llm = LLM(path, dtype="bfloat16", device=device, quantization=quantization, show_progress=False,
                  **({**gpu_kw, "gpu_memory_utilization": 0.3} if device == "cuda" else dict(kv_cache_memory="16MiB")))
        model = llm.engine.executor.worker.model_runner.model
        assert all(m.w13_weight.dtype == FP8 for m in model.modules() if isinstance(m, FusedMoE))
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        lps.append(torch.tensor([row[t].logprob for row, t in zip(out.prompt_logprobs[1:], prompt[1:])]))
        llm.engine.shutdown()
        del llm, model
        gc.collect()
    torch.cuda.empty_cache()
    return lps[0], lps[1], calls


def test_fp8_experts_serve_on_gpu(tmp_path, monkeypatch):
    """--quantization fp8 on a tiny Qwen3-MoE on the GPU: the experts are E4M3 there and go through the
    Triton kernel; its log-probs match the same FP8 model's CPU path (torch, fp32 math on the same
    bf16-rounded weights, so the same E4M3 values) up to bf16 activations."""
    from tests.tiny_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(str(tmp_path / "m"), "qwen3_moe")
    gpu, cpu, calls = _gpu_and_cpu_prompt_logprobs(path, monkeypatch, quantization="fp8", enforce_eager=True)
    assert calls and all(isinstance(s, torch.Tensor) for s in calls), "the FP8 experts must run in the Triton kernel"
    diff = (gpu - cpu).abs().max().item()
    print(f"GPU (Triton, bf16) vs CPU (torch, fp32 math) FP8 prompt log-probs: max diff {diff:.4f}")
    assert diff < 0.15

def _block_experts(num_experts: int, rows: int, cols: int, parts: int, start: int,
                   block: tuple[int, int]) -> tuple[torch.Tensor, reference.BlockScales]:
    """E4M3 experts of `parts` fused parts (gate, up) of `rows` rows each, with block scales as
    quantization/fp8_block_moe.py keeps them: each part's rows from `start` rows into its full grid of
    blocks (a TP rank's cut), blocks of very different magnitudes."""
    bn, bk = block
    q = (torch.randn(num_experts, parts * rows, cols, device="cuda") * 64).clamp(-448, 448).to(FP8)
    part_rows = torch.arange(start, start + rows, device="cuda") // bn - start // bn
    per_part = int(part_rows[-1]) + 1
    scale_row = torch.cat([part_rows + p * per_part for p in range(parts)]).to(torch.int32)
    scales = torch.logspace(-4, -2, num_experts * parts * per_part * -(-cols // bk), device="cuda")
    scales = scales[torch.randperm(scales.numel(), device="cuda")].view(num_experts, parts * per_part, -1)
    return q, reference.BlockScales(scales.contiguous(), scale_row, bk, reference.uniform_rows(scale_row, parts))


BLOCK_CASES = [  # tokens, experts, hidden, inter, top_k, ep, gate start, block
    (1, 128, 2048, 768, 8, False, 0, (128, 128)),      # Qwen3-30B-A3B-FP8 at decode
    (64, 128, 2048, 768, 8, True, 0, (128, 128)),
    (600, 128, 2048, 384, 8, False, 384, (128, 128)),  # its TP=2 second rank, a prefill chunk
    (5, 16, 320, 192, 2, False, 64, (128, 128)),       # gate rows starting inside a block, partial blocks
    (90, 16, 200, 136, 4, True, 8, (16, 32)),          # small blocks, steps cut to them
]


@pytest.mark.parametrize("tokens,experts,hidden,inter,top_k,ep,start,block", BLOCK_CASES)
def test_block_fp8_fused_moe_matches_dequantized_reference(tokens, experts, hidden, inter, top_k, ep, start, block):
    from shardserve.kernels.moe import triton_moe
    torch.manual_seed(tokens + experts + start)
    w13, s13 = _block_experts(experts, inter, hidden, 2, start, block)
    w2, s2 = _block_experts(experts, hidden, inter, 1, 0, block)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = _routing(tokens, experts, top_k, ep)
    assert triton_moe.handles(x, w13, s13)
    _check(triton_moe.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2), x, w13, s13, w2, s2,
           weights, ids)


def test_fp8_fused_moe_time_against_bf16():
    """Not a gate (figures only, into $OUT; benchmarks/moe_fp8.py times them in CUDA graphs): Qwen3-30B-A3B's
    expert shapes, one layer, bf16 experts, FP8 with row scales and FP8 with 128 x 128 block scales."""
    from shardserve.kernels.moe import triton_moe
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    w13, s13 = _block_experts(experts, inter, hidden, 2, 0, (128, 128))
    w2, s2 = _block_experts(experts, hidden, inter, 1, 0, (128, 128))
    b13, b2 = reference.dequantize_experts(w13, s13).bfloat16(), reference.dequantize_experts(w2, s2).bfloat16()
    r13, rs13, r2, rs2 = _fp8_experts(experts, hidden, inter)
    rows = []
    for tokens in (1, 8, 64, 512, 2048):
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        weights, ids = _routing(tokens, experts, top_k, False)
        bf16 = _time_ms(lambda: triton_moe.fused_moe(x, b13, b2, weights, ids))
        row = _time_ms(lambda: triton_moe.fused_moe(x, r13, r2, weights, ids, w13_scale=rs13, w2_scale=rs2))
        blk = _time_ms(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2))
        rows.append(dict(tokens=tokens, bf16_ms=round(bf16, 4), fp8_rows_ms=round(row, 4), fp8_block_ms=round(blk, 4),
                         block_vs_bf16=round(bf16 / blk, 3), block_vs_rows=round(row / blk, 3)))
    report("moe_fp8_kernel", dict(E=experts, H=hidden, I=inter, top_k=top_k), rows)


def test_block_fp8_checkpoint_experts_serve_on_gpu(tmp_path, monkeypatch):
    """A tiny Qwen3-MoE block-scaled FP8 checkpoint (blocks of 32 x 32) on the GPU, with CUDA graphs:
    the experts stay E4M3 and run in the Triton kernel with their block scales; its prompt log-probs
    match the same checkpoint's CPU path (experts dequantized one at a time, fp32 math) up to bf16
    activations."""
    from tests.quantization.checkpoints import write_fp8_block_checkpoint
    from tests.tiny_models import make_tiny_checkpoint
    src = make_tiny_checkpoint(str(tmp_path / "src"), "qwen3_moe")
    write_fp8_block_checkpoint(src, str(tmp_path / "fp8"), (32, 32))
    gpu, cpu, calls = _gpu_and_cpu_prompt_logprobs(str(tmp_path / "fp8"), monkeypatch)
    assert calls and all(isinstance(s, reference.BlockScales) for s in calls), "block experts must run in Triton"
    diff = (gpu - cpu).abs().max().item()
    print(f"GPU (Triton, bf16) vs CPU (torch, fp32 math) block-FP8 prompt log-probs: max diff {diff:.4f}")
    assert diff < 0.15
