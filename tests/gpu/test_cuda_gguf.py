"""GGUF weights kept in their blocks on a GPU (quantization/gguf.py, kernels/quant/triton_gguf.py):
each kernel (the planes GEMV's three loops, dequantize for cuBLAS; Q4_0, Q4_1 and Q4_K on the W4A16
kernels, zero points and mins) and every type against dequantize-then-matmul, on sizes with a last
step past K, with a bias and over a fused layer whose parts differ in type; the gated gate_up form;
tiny GGUF Llamas kept in blocks (Q4_K with v and up in Q6_K, as Q4_K_M files mix them, on asking;
Q4_0 and Q4_K by default; the token embedding in blocks too) against the same file dequantized at
load: close log-probs (same greedy tokens in fp32), fewer weight bytes."""
from __future__ import annotations

import pytest
import torch

from shardserve.kernels.quant import gguf_layout, gguf_matmul, triton_gguf

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("GPU-only: needs CUDA and Triton", allow_module_level=True)
pytest.importorskip("gguf", reason="the GPU hosts lack the gguf package unless a run carries its wheel "
                                   "(CPU CI always has it)")


def _runs(type_name: str, n: int, k: int, seed: int = 0):
    """([one run: the weight as the layer holds it], the planes for the GEMV's loops, fp32 values)."""
    from tests.quantization.test_gguf_quant import _weights
    raw, ref = _weights(type_name, n, k, seed)
    raw = raw.cuda()
    return ([(slice(0, n), gguf_layout.gpu_weight(raw, type_name, k))], gguf_layout.to_planes(raw, type_name, k),
            ref.cuda())


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within the output's rounding: the kernels sum in fp32 in another order than cuBLAS."""
    assert got.shape == want.shape and not got.isnan().any()
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < 6e-3, err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 16, 40])
@pytest.mark.parametrize("type_name", gguf_layout.TYPES)
def test_kernels_match_dequantize_then_matmul(type_name, rows, dtype):
    n, k = 1000, 2304 if type_name.endswith("_K") else 4128   # 4128: the last step of 128 runs past K
    runs, planes, ref = _runs(type_name, n, k)
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    want = x.float() @ ref.to(dtype).float().T + bias.float()
    _close(gguf_matmul.matmul(x, runs, n, bias), want)
    for tiles in ((16, 4, 512, 4, 0), (64, 4, 256, 3, 1), (32, 4, 512, 3, 2)) if rows <= triton_gguf.GEMV_ROWS else ():
        _close(triton_gguf.gemv(x, planes, bias, tiles=tiles), want)   # every loop (Q4_0 too, planes)


@pytest.mark.parametrize("rows", [1, 3, 8, 64])
def test_fused_layer_of_several_types(rows):
    """Runs in the W4A16 layout (Q4_K: mins, Q4_0: zero points), as planes (Q6_K) and as dense rows (a
    type not kept: dequantized at load), each into its columns of one output."""
    (a, _, ref_a), (b, _, ref_b), (c, _, ref_c) = (_runs("Q4_K", 512, 1024), _runs("Q6_K", 256, 1024, seed=1),
                                                   _runs("Q4_0", 128, 1024, seed=2))
    ref_d = torch.randn(64, 1024, device="cuda") * 0.02
    runs = [(slice(0, 512), a[0][1]), (slice(512, 768), b[0][1]), (slice(768, 896), c[0][1]),
            (slice(896, 960), ref_d.bfloat16())]
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    want = x.float() @ torch.cat([ref_a, ref_b, ref_c, ref_d]).bfloat16().float().T
    _close(gguf_matmul.matmul(x, runs, 960), want)
    _close(gguf_matmul.matmul(x.float(), runs, 960), want)   # fp32 activations: IEEE products or dequantize + cuBLAS


@pytest.mark.parametrize("type_name", gguf_layout.INT4_TYPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_4_bit_gate_up_gated_form(rows, type_name):
    """A 4-bit gate_up on the W4A16 GEMV's gated form: silu(gate) * up, as matmul then SiLU-and-mul."""
    from types import SimpleNamespace
    runs, _, ref = _runs(type_name, 2 * 2048, 1024)
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    y = (x.float() @ ref.bfloat16().float().T)
    want = torch.nn.functional.silu(y[:, :2048]) * y[:, 2048:]
    got = gguf_matmul.gated(x, runs, SimpleNamespace(output_shard_sizes=[2048, 2048]))
    _close(got, want)
    assert gguf_matmul.gated(x.float(), runs, SimpleNamespace(output_shard_sizes=[2048, 2048])) is None


@pytest.mark.parametrize("qtype,mixed,keep,dtype", [
    ("Q4_K", "Q6_K", "0", "float32"),   # Q4_K_M-style, kept on asking (Q6_K): fused runs of two types
    ("Q4_0", None, None, "bfloat16"),   # kept by default: the W4A16 kernels (bf16 activations)
    ("Q4_K", None, None, "bfloat16"),   # the same, with mins
    ("Q4_K", "Q6_K", None, "bfloat16"),   # Q4_K_M-style by default: Q4_K kept, the Q6_K rows dense
])
def test_tiny_file_kept_in_blocks_against_it_dequantized(tmp_path, monkeypatch, qtype, mixed, keep, dtype):
    from shardserve.llm import LLM
    from shardserve.quantization.gguf import GgufLinearMethod
    from shardserve.sampling_params import SamplingParams
    from tests.models import gguf_files
    from tests.models.gguf_files import prompt_logprobs, random_prompt, write_gguf
    from tests.quantization.test_gguf_quant import _typed_add_tensor
    from tests.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama", hidden_size=256, intermediate_size=512)
    path = str(tmp_path / f"tiny-{qtype}.gguf")
    monkeypatch.setattr(gguf_files, "_add_tensor", _typed_add_tensor(gguf_files._add_tensor, qtype, mixed))
    write_gguf(ckpt, path, "Q8_0")
    prompt = random_prompt(5, 40)
    results = {}
    # kept (as asked), dequantized at load in the same dtype, and (bf16 runs) dequantized in fp32
    runs = [(keep, dtype), ("1", dtype)] + ([("1", "float32")] if dtype != "float32" else [])
    for dequantize, run_dtype in runs:
        if dequantize is None:
            monkeypatch.delenv("SHARDSERVE_GGUF_DEQUANTIZE", raising=False)
        else:
            monkeypatch.setenv("SHARDSERVE_GGUF_DEQUANTIZE", dequantize)
        llm = LLM(path, dtype=run_dtype, device="cuda", kv_cache_memory="64MiB", show_progress=False,
                  max_logprobs=-1)
        try:
            model = llm.engine.executor.worker.model_runner.model
            kept = {name: m.quant_method.type_name for name, m in model.named_modules()
                    if isinstance(getattr(m, "quant_method", None), GgufLinearMethod)}
            weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                               if ".layers." in name and "norm" not in name)
            tokens = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=16, temperature=0),
                                  use_tqdm=False)[0].outputs[0].token_ids
            results[(dequantize != "1", run_dtype)] = (kept, weight_bytes, prompt_logprobs(llm, prompt), list(tokens))
            embedding = {name for name, _ in model.model.embed_tokens.named_parameters()}
            # the (untied) token embedding stays in its blocks where the GPU keeps its type
            assert (embedding != {"weight"}) == (dequantize != "1" and (keep == "0" or qtype in ("Q4_0", "Q4_K"))), \
                embedding
        finally:
            llm.engine.shutdown()
    (kept, kept_bytes, ours, tokens) = results[(True, dtype)]
    (dense, dense_bytes, exact, dense_tokens) = results[(False, dtype)]
    fused = {t for n, t in kept.items() if n.endswith(("qkv_proj", "gate_up_proj"))}
    assert fused == ({f"{qtype}+{mixed}"} if mixed else {qtype}), kept
    assert {t for n, t in kept.items() if n.endswith(("o_proj", "down_proj"))} == {qtype}, kept
    assert not dense   # dequantized at load: plain linears
    # ~5 bits a weight against fp32's 32 or bf16's 16 (by default Q4_K_M's v and up rows stay bf16)
    bound = 0.25 if dtype == "float32" else 0.65 if mixed and keep is None else 0.35
    assert kept_bytes < bound * dense_bytes, (kept_bytes, dense_bytes)
    if dtype == "float32":
        assert (ours - exact).abs().max().item() < 1e-3
        assert tokens == dense_tokens
    else:   # bf16: the dequantized path rounds the weights to bf16, the kernels do not (Q4_K's scales
        # go to fp16): against the file's weights in fp32, no further off than that path (near-ties
        # may flip tokens, so those are not compared)
        fp32 = results[(False, "float32")][2]
        assert (ours - fp32).abs().max().item() <= 1.5 * (exact - fp32).abs().max().item() + 0.01


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="GPU-only: TP=2 over NCCL needs two CUDA GPUs (run on a 2-GPU machine)")
def test_tiny_file_kept_in_blocks_tp2_matches_tp1(tmp_path, monkeypatch):
    """A Q4_K_M-style file as the defaults keep it over TP=2: column-parallel layers keep their rows'
    blocks, row-parallel ones whole super-blocks of their inputs. fp32 (Q4_K as exact planes, Q6_K
    dense): TP=1's prompt log-probs up to summation order. bf16 (Q4_K on the W4A16 kernels): no
    further from TP=1's than TP=1's bf16 is from fp32, twice over (TP sums partial products in
    another order)."""
    import gc

    from shardserve.llm import LLM
    from tests.models import gguf_files
    from tests.models.gguf_files import prompt_logprobs, random_prompt, write_gguf
    from tests.quantization.test_gguf_quant import _typed_add_tensor
    from tests.tiny_models import make_tiny_checkpoint

    # 512 / 1024 wide: each rank's o_proj and down_proj inputs are whole 256-value super-blocks
    ckpt = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama", hidden_size=512, intermediate_size=1024)
    path = str(tmp_path / "tiny-Q4_K_M.gguf")
    monkeypatch.setattr(gguf_files, "_add_tensor", _typed_add_tensor(gguf_files._add_tensor, "Q4_K", "Q6_K"))
    write_gguf(ckpt, path, "Q8_0")
    monkeypatch.delenv("SHARDSERVE_GGUF_DEQUANTIZE", raising=False)
    prompt = random_prompt(7, 40)
    got = {}
    for dtype in ("float32", "bfloat16"):
        for tp in (1, 2):
            llm = LLM(path, dtype=dtype, device="cuda", kv_cache_memory="64MiB", show_progress=False,
                      max_logprobs=-1, tensor_parallel_size=tp)
            try:
                got[dtype, tp] = prompt_logprobs(llm, prompt)
            finally:
                llm.engine.shutdown()
                del llm
                gc.collect()
                torch.cuda.empty_cache()
    assert (got["float32", 2] - got["float32", 1]).abs().max().item() < 1e-3
    noise = (got["bfloat16", 1] - got["float32", 1]).abs().max().item()
    assert (got["bfloat16", 2] - got["bfloat16", 1]).abs().max().item() <= max(0.05, 2 * noise), noise


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_tiny_moe_file_experts_kept_on_gpu(tmp_path, monkeypatch, qtype):
    """GGUF MoE experts of a 4-bit type stay in blocks on CUDA (kernels/moe/int4_experts.py's layout,
    the fused INT4 MoE kernel; zero points or mins): fewer expert bytes, and in bf16 no further from
    the fp32 dequantized file than the bf16 dequantized path."""
    import gc

    from shardserve.layers.moe import FusedMoE
    from shardserve.llm import LLM
    from tests.models.gguf_files import prompt_logprobs, random_prompt

    # 256 wide: whole K-quant super-blocks along every expert input
    path = _moe_file(tmp_path, monkeypatch, qtype, moe_intermediate_size=256)
    prompt = random_prompt(11, 30)
    got = {}
    for dequantize, dtype in ((None, "bfloat16"), ("1", "bfloat16"), ("1", "float32")):
        _dequantize(monkeypatch, dequantize)
        llm = LLM(path, dtype=dtype, device="cuda", kv_cache_memory="64MiB", show_progress=False, max_logprobs=-1)
        try:
            model = llm.engine.executor.worker.model_runner.model
            moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
            # SHARDSERVE_GGUF_DEQUANTIZE=1: the loader hands dense experts over, no GGUF method at all
            assert moes and all(bool(m.quant_method and m.quant_method.int4) == (dequantize is None) for m in moes)
            held = sum(p.numel() * p.element_size() for m in moes for p in m.parameters())
            got[dequantize, dtype] = (held, prompt_logprobs(llm, prompt))
        finally:
            llm.engine.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    (kept_bytes, ours), (dense_bytes, dense), (_, fp32) = got[None, "bfloat16"], got["1", "bfloat16"], \
        got["1", "float32"]
    assert kept_bytes < 0.45 * dense_bytes, (kept_bytes, dense_bytes)
    noise = (dense - fp32).abs().max().item()
    assert (ours - fp32).abs().max().item() <= 1.5 * noise + 0.01, noise


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="GPU-only: TP=2 over NCCL needs two CUDA GPUs (run on a 2-GPU machine)")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
def test_tiny_moe_file_experts_kept_on_gpu_tp2_and_ep2(tmp_path, monkeypatch, qtype):
    """4-bit GGUF experts kept on CUDA, sliced over TP=2 (each rank's down inputs whole blocks:
    256 of a 512-wide intermediate) and whole over EP=2: in bf16 no further from one GPU's
    log-probs than one GPU's bf16 is from the fp32 dequantized file, twice over (TP sums partial
    products in another order)."""
    import gc

    from shardserve.llm import LLM
    from tests.models.gguf_files import prompt_logprobs, random_prompt

    path = _moe_file(tmp_path, monkeypatch, qtype, moe_intermediate_size=512)
    prompt = random_prompt(13, 30)
    got = {}
    runs = [("1", "float32", {}), (None, "bfloat16", {}), (None, "bfloat16", dict(tensor_parallel_size=2)),
            (None, "bfloat16", dict(tensor_parallel_size=2, enable_expert_parallel=True))]
    for dequantize, dtype, layout in runs:
        _dequantize(monkeypatch, dequantize)
        llm = LLM(path, dtype=dtype, device="cuda", kv_cache_memory="64MiB", show_progress=False, max_logprobs=-1,
                  enforce_eager=True, **layout)
        try:
            got[dtype, tuple(layout)] = prompt_logprobs(llm, prompt)
        finally:
            llm.engine.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    one = got["bfloat16", ()]
    noise = (one - got["float32", ()]).abs().max().item()
    for layout in (("tensor_parallel_size",), ("tensor_parallel_size", "enable_expert_parallel")):
        assert (got["bfloat16", layout] - one).abs().max().item() <= max(0.05, 2 * noise), (layout, noise)


def _moe_file(tmp_path, monkeypatch, qtype: str, moe_intermediate_size: int) -> str:
    """A tiny Qwen3-MoE GGUF file (hidden 256) whose stacked experts are `qtype`, the rest Q8_0."""
    from tests.models import gguf_files
    from tests.models.gguf_files import write_moe_gguf
    from tests.tiny_models import make_tiny_checkpoint

    original = gguf_files._add_tensor

    def add(w, gname, data, qtype_name):
        original(w, gname, data, qtype if gname.endswith("_exps.weight") else qtype_name)
    monkeypatch.setattr(gguf_files, "_add_tensor", add)
    ckpt = make_tiny_checkpoint(str(tmp_path / "ckpt"), "qwen3_moe", hidden_size=256,
                                moe_intermediate_size=moe_intermediate_size, intermediate_size=512)
    path = str(tmp_path / "tiny-moe.gguf")
    write_moe_gguf(ckpt, path, "Q8_0")
    return path


def _dequantize(monkeypatch, value: str | None) -> None:
    """SHARDSERVE_GGUF_DEQUANTIZE as given, or unset (the defaults) for None."""
    if value is None:
        monkeypatch.delenv("SHARDSERVE_GGUF_DEQUANTIZE", raising=False)
    else:
        monkeypatch.setenv("SHARDSERVE_GGUF_DEQUANTIZE", value)
