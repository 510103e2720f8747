"""INT4 (GPTQ / AWQ) experts in the Triton fused MoE (kernels/moe/triton_moe_int4.py): 4-bit words
unpacked in registers with group scales and zeros, bf16 / fp16 activations, against dequantize-then-
reference in fp32 (kernels/moe/reference.py); decode and prefill sizes, expert parallelism's -1
picks, activation order (g_idx per expert), a TP split that cuts a group, odd sizes, tile shapes,
CUDA-graph replay; then a tiny GPTQ Qwen3-MoE served on the GPU against its CPU path. Figures (bf16
vs INT4 kernel time) go to $OUT if set."""
from __future__ import annotations

import gc

import pytest
import torch

from shardserve.kernels.moe import reference
from shardserve.kernels.moe.int4_experts import Int4Experts, pack_along_k
from tests.gpu.cuda_timing import report
from tests.gpu.cuda_timing import time_ms as _time_ms

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("GPU-only: needs CUDA and Triton", allow_module_level=True)


def _int4(experts: int, n: int, k: int, group: int, desc_act: bool = False, phase: int = 0) -> Int4Experts:
    """Random experts [E, N, K]: values 0..15, zeros around 8, fp16 scales ~ 1 / (8 sqrt(K)).
    phase: this rank's inputs start `phase` inputs into their first group (a TP cut)."""
    groups = -(-(k + phase) // group)
    q = torch.randint(0, 16, (experts, n, k), device="cuda")
    words = torch.stack([pack_along_k(w) for w in q])
    zeros = torch.randint(6, 11, (experts, groups, n), device="cuda").to(torch.uint8)
    scales = (torch.rand(experts, groups, n, device="cuda") + 0.5) / (8 * k ** 0.5)
    if desc_act:
        index = torch.stack([torch.randperm(k, device="cuda") * groups // k for _ in range(experts)])
    else:
        index = ((torch.arange(k, device="cuda") + phase) // group).expand(experts, k)
    return Int4Experts(words, scales.half(), zeros, index.to(torch.int32), group_size=0 if desc_act else group,
                       group_phase=0 if desc_act else phase)


def _routing(tokens: int, experts: int, top_k: int, ep: bool) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = reference.route_topk(torch.randn(tokens, experts, device="cuda"), top_k, True)
    if ep:   # about 40% of the picks live on another expert-parallel rank
        ids = torch.where(torch.rand(ids.shape, device="cuda") < 0.4, -1, ids)
    return weights, ids


def _check(got: torch.Tensor, x: torch.Tensor, w13: Int4Experts, w2: Int4Experts, weights, ids) -> None:
    # The kernel rounds each dequantized weight to the activations' dtype before the dot: so does this.
    want = reference.fused_moe(x.float(), w13.dequantize_all(x.dtype), w2.dequantize_all(x.dtype), weights, ids)
    scale = max(want.abs().max().item(), 1e-3)
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * scale, f"max error {err:.4g} at output scale {scale:.4g}"
    assert got.dtype == x.dtype and got.shape == x.shape


CASES = [  # tokens, experts, hidden, inter, top_k, ep, group, desc_act, phase of w2's inputs
    (1, 8, 256, 128, 2, False, 128, False, 0),
    (3, 128, 2048, 768, 8, False, 128, False, 0),    # Qwen3-30B-A3B at decode
    (7, 16, 384, 192, 1, True, 64, True, 0),         # activation order, each expert its own
    (100, 32, 256, 128, 4, True, 32, False, 0),
    (600, 64, 320, 200, 8, False, 128, False, 0),    # sizes no tile divides, a shorter last group
    (300, 8, 4096, 448, 2, True, 128, False, 64),    # Mixtral-like at TP=4 of 1792: w2's groups cut
]


# The vector kernel (regular groups only: desc_act falls back to tiles), the tiles with one scale row
# per block, and the tiles with the per-input group lookup.
KERNELS = {"vec": {"VEC": True}, "aligned": {"VEC": False, "ALIGNED_GROUPS": True},
           "per_input": {"VEC": False, "ALIGNED_GROUPS": False}}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("tokens,experts,hidden,inter,top_k,ep,group,desc_act,phase", CASES)
def test_int4_fused_moe_matches_dequantized_reference(tokens, experts, hidden, inter, top_k, ep, group, desc_act,
                                                      phase, kernel):
    from shardserve.kernels.moe import triton_moe, triton_moe_int4
    torch.manual_seed(tokens * 7 + experts)
    w13 = _int4(experts, 2 * inter, hidden, group, desc_act)
    w2 = _int4(experts, hidden, inter, group, desc_act, phase)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = _routing(tokens, experts, top_k, ep)
    assert triton_moe_int4.handles(x, w13)
    cfg = {**triton_moe.default_config(tokens, experts, top_k), **KERNELS[kernel]}
    _check(triton_moe_int4.fused_moe(x, w13, w2, weights, ids, config=cfg), x, w13, w2, weights, ids)


@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_int4_fused_moe_any_tile_config_fp16(block_m):
    from shardserve.kernels.moe import triton_moe_int4
    torch.manual_seed(block_m)
    cfg = dict(BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=4, num_warps=4, num_stages=2,
               down=dict(BLOCK_SIZE_N=64, BLOCK_SIZE_K=32))
    w13, w2 = _int4(16, 272, 200, 32), _int4(16, 200, 136, 32)
    x = torch.randn(90, 200, device="cuda").to(torch.float16)
    weights, ids = _routing(90, 16, 4, True)
    _check(triton_moe_int4.fused_moe(x, w13, w2, weights, ids, config=cfg), x, w13, w2, weights, ids)


@pytest.mark.parametrize("vec", [True, False])
def test_int4_fused_moe_replays_in_cuda_graph(vec):
    from shardserve.kernels.moe import triton_moe, triton_moe_int4
    torch.manual_seed(5)
    w13, w2 = _int4(64, 512, 512, 128), _int4(64, 512, 256, 128)
    x = torch.randn(4, 512, device="cuda").to(torch.bfloat16)
    weights, ids = _routing(4, 64, 4, False)
    cfg = {**triton_moe.default_config(4, 64, 4), "VEC": vec}
    run = lambda: triton_moe_int4.fused_moe(x, w13, w2, weights, ids, config=cfg)   # noqa: E731
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
        _check(out.clone(), x, w13, w2, weights, ids)


def test_int4_fused_moe_time_against_bf16():
    """Not a gate (figures only, into $OUT): Qwen3-30B-A3B's expert shapes, one layer, bf16 vs INT4,
    both with the default (untuned) tiles."""
    from shardserve.kernels.moe import triton_moe, triton_moe_int4
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    w13, w2 = _int4(experts, 2 * inter, hidden, 128), _int4(experts, hidden, inter, 128)
    b13, b2 = w13.dequantize_all(torch.bfloat16), w2.dequantize_all(torch.bfloat16)
    rows = []
    for tokens in (1, 8, 64, 512):
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        weights, ids = _routing(tokens, experts, top_k, False)
        cfg = triton_moe.default_config(tokens, experts, top_k)
        bf16 = _time_ms(lambda: triton_moe.fused_moe(x, b13, b2, weights, ids, config=cfg))
        row = dict(tokens=tokens, bf16_ms=round(bf16, 4))
        for aligned in (True, False):   # one scale row per block, or the per-input lookup desc_act needs
            int4 = _time_ms(lambda: triton_moe_int4.fused_moe(x, w13, w2, weights, ids,
                                                              config={**cfg, "ALIGNED_GROUPS": aligned}))
            key = "aligned" if aligned else "per_input_groups"
            row[f"int4_{key}_ms"], row[f"speedup_{key}"] = round(int4, 4), round(bf16 / int4, 3)
        rows.append(row)
    report("moe_int4_kernel", dict(E=experts, H=hidden, I=inter, top_k=top_k), rows)


def test_int4_experts_serve_on_gpu(tmp_path, monkeypatch):
    """A tiny GPTQ Qwen3-MoE (group 32, experts and dense layers INT4) on the GPU: the experts stay
    packed and go through the Triton kernel; its prompt log-probs match the same checkpoint's CPU path
    (torch, one expert dequantized at a time) up to bf16 activations."""
    from shardserve import LLM, SamplingParams
    from shardserve.kernels.moe import triton_moe_int4
    from shardserve.layers.moe import FusedMoE
    from tests.quantization.moe_checkpoints import write_int4_moe_checkpoint
    from tests.tiny_models import make_tiny_checkpoint
    calls = []
    fused = triton_moe_int4.fused_moe
    monkeypatch.setattr(triton_moe_int4, "fused_moe", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    src = make_tiny_checkpoint(str(tmp_path / "src"), "qwen3_moe")
    write_int4_moe_checkpoint(src, str(tmp_path / "gptq"), "gptq", 32, sym=True)
    prompt = list(range(3, 15))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    lps = []
    for device in ("cuda", "cpu"):
        llm = LLM(str(tmp_path / "gptq"), dtype="bfloat16", device=device, show_progress=False,
                  **(dict(enforce_eager=True, gpu_memory_utilization=0.3) if device == "cuda" else
                     dict(kv_cache_memory="16MiB")))
        model = llm.engine.executor.worker.model_runner.model
        assert all(m.w13_qweight.dtype == torch.int32 for m in model.modules() if isinstance(m, FusedMoE))
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        lps.append(torch.tensor([row[t].logprob for row, t in zip(out.prompt_logprobs[1:], prompt[1:])]))
        llm.engine.shutdown()
        del llm, model
        gc.collect()
    torch.cuda.empty_cache()
    assert calls, "the INT4 experts must run in the Triton kernel"
    diff = (lps[0] - lps[1]).abs().max().item()
    print(f"GPU (Triton, bf16) vs CPU (torch) INT4 prompt log-probs: max diff {diff:.4f}")
    assert diff < 0.15
