"""compressed-tensors checkpoints on CUDA: the weights stay FP8 / 4-bit on the GPU kernels (the LM
head too where the checkpoint quantizes it), bf16 with CUDA graphs, against HF transformers reading
the same files in fp32 (decompressed by the compressed-tensors library)."""
from __future__ import annotations

import gc

import pytest
import torch

from shardserve.llm import LLM
from shardserve.quantization.fp8 import quantize_tokens
from tests.models.test_parity import full_logprob_params, hf_logprobs, logprob_matrix, random_prompt
from tests.quantization.ct_checkpoints import hf_decompressed, write_ct_checkpoint
from tests.tiny_models import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("compressed_tensors")

def _token_rounded(x: torch.Tensor) -> torch.Tensor:
    """x with each token rounded to E4M3 at its own scale (what the FP8 prefill matmul multiplies)."""
    q, scale = quantize_tokens(x.reshape(-1, x.shape[-1]))
    return (q.float() * scale).view(x.shape).to(x.dtype)


def _logprobs_beside_hf(llm: LLM, hf, prompt: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(the prompt and 8 generated tokens, our log-prob rows over the whole vocabulary for them, HF's)."""
    out = llm.generate([prompt], full_logprob_params(max_tokens=8), use_tqdm=False)[0]
    ids = prompt + list(out.outputs[0].token_ids)
    ours = torch.cat([logprob_matrix(out.prompt_logprobs[1:]), logprob_matrix(out.outputs[0].logprobs)])
    return ids, ours, hf_logprobs(hf, ids)[:len(ids) - 1]


def _assert_within_rounded_hf(path: str, ids: list[int], ours: torch.Tensor, ref: torch.Tensor, prompt_len: int,
                              rounding, head: bool, name: str, rounded=None) -> None:
    """Prefill rounds the activations per token (W8A8), and decode reads the K/V it wrote: ours strays
    from HF on the checkpoint's weights (ref) no further than HF's own with that rounding of every
    linear's input (and the head's, where quantized), prompt rows and generated rows apart (as
    tests/gpu/test_cuda_fp8.py's tests; the first generated token's row is a prefill row). `rounding`
    may instead be a function of the module's name giving its rounding (None: none); `rounded`: the
    HF model to hook (default: HF reading the checkpoint)."""
    rounded = rounded if rounded is not None else hf_decompressed(path)
    for module_name, module in rounded.named_modules():
        if module_name.endswith("_proj") or (head and module_name == "lm_head"):
            fn = rounding(module_name) if getattr(rounding, "by_name", False) else rounding
            if fn is not None:
                module.register_forward_pre_hook(lambda _, args, fn=fn: (fn(args[0]),))
    bound_rows = hf_logprobs(rounded, ids)[:len(ids) - 1]
    for part in (slice(0, prompt_len), slice(prompt_len, None)):
        stray = (ours[part] - ref[part]).abs().mean()
        bound = (bound_rows[part] - ref[part]).abs().mean()
        assert stray < 1.25 * bound + 0.03, f"{name} strays {stray:.3f} nats from HF, HF rounded {bound:.3f}"


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x with each token rounded to INT8 at its own scale (what the INT8 prefill matmul multiplies)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    scale = (flat.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12)
    return ((flat / scale).round().clamp(-127, 127) * scale).view(x.shape).to(x.dtype)


W8A16_G32 = dict(weights=dict(num_bits=8, type="int", strategy="group", group_size=32))


@pytest.mark.parametrize("name,scheme,fmt", [("w8a8", "W8A8", "int-quantized"),
                                             ("w8a16-group", W8A16_G32, "pack-quantized")])
def test_int8_checkpoint_on_cuda_tracks_hf(tmp_path, name, scheme, fmt):
    """INT8 with its head, bf16, CUDA graphs on. W8A8 (symmetric, per channel) stays INT8: prefill rounds
    the activations to INT8 per token (the INT8 tensor cores), decode runs the FP8 GEMV's loops on the
    INT8 weight; it strays from HF on the checkpoint's weights no further than HF with that rounding.
    Group scales are widened at load (bf16 weights) and track HF as bf16 does."""
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama", hidden_size=256, intermediate_size=512)
    path = write_ct_checkpoint(src, str(tmp_path / name), scheme, fmt, ignore=())
    llm = LLM(path, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, show_progress=False, max_logprobs=-1)
    kept = name == "w8a8"
    try:
        prompt = random_prompt(1, 40)
        ids, ours, ref = _logprobs_beside_hf(llm, hf_decompressed(path), prompt)
        if kept:
            _assert_within_rounded_hf(path, ids, ours, ref, len(prompt), _int8_rounded, True, name)
        else:
            diff = (ours - ref).abs().max()
            assert diff < 0.15, f"INT8 log-probs on CUDA are {diff:.3f} away from HF on the same checkpoint"
        runner = llm.engine.executor.worker.model_runner
        held = torch.int8 if kept else torch.bfloat16
        assert runner.model.model.layers[0].self_attn.qkv_proj.weight.dtype == held
        assert runner.model.lm_head.linear.weight.dtype == held and runner.wants_graphs()
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


W4A16_G64 = dict(weights=dict(num_bits=4, type="int", strategy="group", group_size=64, symmetric=True))


# (A static-activation scheme loads as FP8-dynamic does, its input_scale read and dropped, then runs the
# per-tensor FP8 checkpoints' kernels; tests/quantization/test_compressed_tensors.py covers its loading.)
@pytest.mark.parametrize("name,scheme,fmt,head", [
    ("fp8", "FP8_DYNAMIC", "float-quantized", True),
    ("fp8-block", "FP8_BLOCK", "float-quantized", False),
    ("w4a16", W4A16_G64, "pack-quantized", True),
    ("nvfp4", "NVFP4A16", "nvfp4-pack-quantized", True),   # with SHARDSERVE_FP4_KERNELS=1: kept 4-bit
    ("mxfp4", "MXFP4A16", "mxfp4-pack-quantized", False),   # (kernels/quant/triton_fp4.py)
])
def test_model_on_cuda_tracks_hf(tmp_path, monkeypatch, name, scheme, fmt, head):
    monkeypatch.setenv("SHARDSERVE_FP4_KERNELS", "1")
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama", hidden_size=256, intermediate_size=512)
    path = write_ct_checkpoint(src, str(tmp_path / name), scheme, fmt, ignore=() if head else ("lm_head",))
    if fmt.endswith("fp4-pack-quantized"):   # HF on the values the library unpacks (tests/quantization/test_fp4.py)
        from tests.quantization.checkpoints import hf_with_weights
        from tests.quantization.test_fp4 import _values
        hf = hf_with_weights(src, _values(path))
    else:
        hf = hf_decompressed(path)
    held = {"float-quantized": torch.float8_e4m3fn}.get(fmt, torch.int32)   # INT4 and FP4: int32 words
    llm = LLM(path, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, show_progress=False, max_logprobs=-1)
    try:
        prompt = random_prompt(1, 40)
        ids, ours, ref = _logprobs_beside_hf(llm, hf, prompt)
        if name == "fp8":
            _assert_within_rounded_hf(path, ids, ours, ref, len(prompt), _token_rounded, head, name)
        else:   # W4A16, FP4, FP8 blocks' decode rows (W8A16; their prefill rounds activations on down_proj only at
            # this size): bf16 against fp32 over the whole vocabulary, as tests/quantization/test_int4.py's CUDA test
            rows = slice(len(prompt), None) if held == torch.float8_e4m3fn else slice(None)
            diff = (ours[rows] - ref[rows]).abs().max()
            # an FP4 head: bf16 logits from E2M1 weights stray up to ~0.15 on some GPUs (0.153 on an H200)
            bound = 0.2 if name == "nvfp4" and head else 0.15
            assert diff < bound, f"{name} log-probs on CUDA are {diff:.3f} away from HF on the same checkpoint"
        runner = llm.engine.executor.worker.model_runner
        weight = {"pack-quantized": "qweight", "float-quantized": "weight"}.get(fmt, "fp4_words")
        qkv = runner.model.model.layers[0].self_attn.qkv_proj
        assert getattr(qkv, weight).dtype == held and runner.wants_graphs()
        if head:
            assert getattr(runner.model.lm_head.linear, weight).dtype == held
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_modelopt_nvfp4_kept_4bit_on_cuda_tracks_hf(tmp_path, monkeypatch):
    """ModelOpt's NVFP4 names and its multiplier `weight_scale_2` on the 4-bit kernel
    (SHARDSERVE_FP4_KERNELS=1): against HF on the values the checkpoint holds, bf16 with CUDA graphs."""
    from tests.quantization.checkpoints import hf_with_weights
    from tests.quantization.test_fp4 import _values
    from tests.quantization.test_modelopt import _as_modelopt_nvfp4
    monkeypatch.setenv("SHARDSERVE_FP4_KERNELS", "1")
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama", hidden_size=256, intermediate_size=512)
    path = write_ct_checkpoint(src, str(tmp_path / "modelopt"), "NVFP4A16", "nvfp4-pack-quantized")
    hf = hf_with_weights(src, _values(path))   # the values, read under compressed-tensors' names first
    _as_modelopt_nvfp4(path)
    llm = LLM(path, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, show_progress=False, max_logprobs=-1)
    try:
        runner = llm.engine.executor.worker.model_runner
        assert runner.model.model.layers[0].mlp.gate_up_proj.fp4_words.dtype == torch.int32 and runner.wants_graphs()
        _, ours, ref = _logprobs_beside_hf(llm, hf, random_prompt(2, 40))
        diff = (ours - ref).abs().max()
        assert diff < 0.15, f"ModelOpt NVFP4 log-probs on CUDA are {diff:.3f} away from HF on its values"
    finally:   # (tests/conftest.py frees the GPU memory after each test)
        llm.engine.shutdown()


@pytest.mark.parametrize("layout", ["tp2", "fp32"])
def test_fp4_switch_over_tp2_and_in_fp32(tmp_path, monkeypatch, layout):
    """SHARDSERVE_FP4_KERNELS=1 over TP=2 (each rank's row-parallel inputs whole scale groups): the
    4-bit kernels on both GPUs, against HF as closely as one GPU; in fp32 the layers are dequantized
    instead (the kernels take 16-bit activations only), and track HF in fp32 closely."""
    if layout == "tp2" and torch.cuda.device_count() < 2:
        pytest.skip(f"TP=2 needs 2 GPUs; this machine has {torch.cuda.device_count()}")
    from tests.quantization.checkpoints import hf_with_weights
    from tests.quantization.test_fp4 import _values
    monkeypatch.setenv("SHARDSERVE_FP4_KERNELS", "1")
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama", hidden_size=256, intermediate_size=512)
    path = write_ct_checkpoint(src, str(tmp_path / "nvfp4"), "NVFP4A16", "nvfp4-pack-quantized",
                               dtype=torch.bfloat16 if layout == "tp2" else torch.float32)   # the unquantized tensors
    hf = hf_with_weights(src, _values(path))
    kwargs = dict(tensor_parallel_size=2, dtype="bfloat16") if layout == "tp2" else dict(dtype="float32")
    llm = LLM(path, device="cuda", gpu_memory_utilization=0.3, show_progress=False, max_logprobs=-1, **kwargs)
    try:
        _, ours, ref = _logprobs_beside_hf(llm, hf, random_prompt(3, 40))
        diff = (ours - ref).abs().max()
        assert diff < (0.15 if layout == "tp2" else 0.01), f"NVFP4 {layout} log-probs are {diff:.4f} away from HF"
        if layout == "fp32":
            qkv = llm.engine.executor.worker.model_runner.model.model.layers[0].self_attn.qkv_proj
            assert not hasattr(qkv, "fp4_words") and qkv.weight.dtype == torch.float32
    finally:   # (tests/conftest.py frees the GPU memory after each test)
        llm.engine.shutdown()


def test_activation_order_on_cuda_tracks_hf(tmp_path):
    """`actorder: group` W4A16 (inputs' groups in `weight_g_idx`): the inputs sorted by group once at
    load, so the W4A16 kernels run it as a plain grouped layer, against HF on the checkpoint's values."""
    from tests.quantization.ct_checkpoints import write_ct_int4_checkpoint
    from tests.quantization.moe_checkpoints import write_with_weights
    from tests.tiny_models import load_hf_model
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama", hidden_size=256, intermediate_size=512)
    values = write_ct_int4_checkpoint(src, str(tmp_path / "ct"), 64, symmetric=False, actorder=True)
    hf = load_hf_model(write_with_weights(src, str(tmp_path / "values"), values))
    llm = LLM(str(tmp_path / "ct"), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, show_progress=False,
              max_logprobs=-1)
    try:
        _, ours, ref = _logprobs_beside_hf(llm, hf, random_prompt(2, 40))
        diff = (ours - ref).abs().max()
        assert diff < 0.15, f"actorder W4A16 log-probs on CUDA are {diff:.3f} away from HF on the same values"
        qkv = llm.engine.executor.worker.model_runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.qweight.dtype == torch.int32 and qkv.int4_perm is not None
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("experts", ["int4", "int4-actorder", "fp8-block", "int8", "int4-own-group", "nvfp4"])
def test_moe_experts_serve_on_gpu(tmp_path, experts):
    """A tiny Qwen3-MoE with compressed-tensors experts and linears on the GPU: INT4 experts stay 4-bit
    in the INT4 MoE kernels' layout (with activation order too, and in a config group of their own
    beside FP8 linears), FP8-block ones E4M3 with their `weight_scale` blocks, INT8 (W8A8) ones widened
    to bf16 (INT8 on the CPU), NVFP4 ones dequantized to plain experts; its prompt log-probs match the
    same checkpoint's CPU path (checked against HF in tests/quantization) up to bf16, as
    test_cuda_moe_int4.py's GPTQ test."""
    from shardserve import SamplingParams
    from shardserve.layers.moe import FusedMoE
    from tests.quantization.checkpoints import write_fp8_block_checkpoint
    from tests.quantization.ct_checkpoints import (
        block_checkpoint_as_compressed_tensors,
        write_ct_int4_checkpoint,
        write_ct_int8_moe_checkpoint,
    )
    from tests.quantization.test_ct_mixed import _moe_mixed
    from tests.quantization.test_fp4 import write_fp4_moe_checkpoint
    src = make_tiny_checkpoint(str(tmp_path / "src"), "qwen3_moe")
    path = str(tmp_path / "ct")
    if experts == "fp8-block":
        write_fp8_block_checkpoint(src, path, (32, 32))
        block_checkpoint_as_compressed_tensors(path, (32, 32))
    elif experts == "int8":
        write_ct_int8_moe_checkpoint(src, path)
    elif experts == "int4-own-group":
        _moe_mixed(src, path, "re:.*mlp\\.experts\\..*")
    elif experts == "nvfp4":
        write_fp4_moe_checkpoint(src, path, "nvfp4")
    else:
        write_ct_int4_checkpoint(src, path, 32, actorder=experts == "int4-actorder", moe=True)
    held = {"fp8-block": {"cuda": torch.float8_e4m3fn, "cpu": torch.float8_e4m3fn},
            "int8": {"cuda": torch.bfloat16, "cpu": torch.int8},
            "nvfp4": {"cuda": torch.bfloat16, "cpu": None}}.get(experts, {"cuda": torch.int32, "cpu": torch.int32})
    prompt = list(range(3, 15))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    lps = []
    for device in ("cuda", "cpu"):
        llm = LLM(path, dtype="bfloat16", device=device, show_progress=False,
                  **(dict(gpu_memory_utilization=0.3) if device == "cuda" else dict(kv_cache_memory="16MiB")))
        try:
            model = llm.engine.executor.worker.model_runner.model
            layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
            weights = [m.w13_qweight if experts.startswith("int4") else m.w13_weight for m in layers]
            assert layers and (held[device] is None   # nvfp4 on the CPU: the CPU's compute dtype
                               or all(w.dtype == held[device] for w in weights))
            assert experts != "nvfp4" or all(m.quant_method is None for m in layers)
            if experts == "int4-own-group" and device == "cuda":   # the linears in the `Linear` group's FP8
                assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            lps.append(torch.tensor([row[t].logprob for row, t in zip(out.prompt_logprobs[1:], prompt[1:])]))
        finally:
            llm.engine.shutdown()
            del llm
            gc.collect()
    torch.cuda.empty_cache()
    diff = (lps[0] - lps[1]).abs().max().item()
    assert diff < 0.15, f"{experts} MoE prompt log-probs on CUDA are {diff:.3f} away from the CPU path's"


def test_mixed_precision_checkpoint_on_cuda_tracks_hf(tmp_path):
    """Several config groups on the GPU kernels: FP8-dynamic attention (E4M3, prefill rounding its
    inputs per token), W4A16 MLP (4-bit), a W8A8 head (INT8), bf16 with CUDA graphs; it strays from HF
    on the library's decompressed weights no further than HF with each layer's own input rounding."""
    from transformers import AutoModelForCausalLM

    from tests.quantization.test_ct_mixed import MIXED
    groups = {**MIXED, "mlp": (["re:.*mlp.*"], W4A16_G64, "pack-quantized")}
    groups.pop("one layer")
    src = make_tiny_checkpoint(str(tmp_path / "src"), "llama", hidden_size=256, intermediate_size=512)
    path = write_ct_checkpoint(src, str(tmp_path / "ct"), None, None, ignore=(), groups=groups)
    hf = AutoModelForCausalLM.from_pretrained(f"{path}/decompressed", dtype=torch.float32).eval()
    llm = LLM(path, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, show_progress=False, max_logprobs=-1)
    try:
        runner = llm.engine.executor.worker.model_runner
        layer = runner.model.model.layers[0]
        assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
        assert layer.mlp.gate_up_proj.qweight.dtype == torch.int32
        assert runner.model.lm_head.linear.weight.dtype == torch.int8 and runner.wants_graphs()
        prompt = random_prompt(1, 40)
        ids, ours, ref = _logprobs_beside_hf(llm, hf, prompt)

        def rounding(name: str):
            return _token_rounded if ".self_attn." in name else _int8_rounded if name == "lm_head" else None
        rounding.by_name = True
        reference = AutoModelForCausalLM.from_pretrained(f"{path}/decompressed", dtype=torch.float32).eval()
        _assert_within_rounded_hf(path, ids, ours, ref, len(prompt), rounding, True, "mixed", rounded=reference)
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
