"""The decoder layers as one native call (models/cpu_stack.py, kernels/cpu/csrc/decoder_stack.c)
give the very bits of the per-module path (SHARDSERVE_CPU_DECODER_STACK=0): prompt log-probs over
the whole vocabulary and greedy tokens, with chunked prefills beside decodes, for each kind of
layer and matmul it takes (packed fp32 and bf16 panels, FP8 / INT8 weights widened at load, GGUF
blocks with int8 and fp32 activations, fused layers of two GGUF types, fp8 and bf16 KV pools,
sliding windows, QKV bias, per-head q/k norms, MoE layers with GGUF experts); and it steps aside
where it does not apply."""
from __future__ import annotations

import pytest
import torch

from shardserve.kernels.cpu import cpu_ops, quant_ops
from shardserve.llm import LLM
from shardserve.models import cpu_stack
from shardserve.sampling_params import SamplingParams
from tests.models.gguf_files import random_prompt, write_gguf
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels unavailable")

PROMPTS = [random_prompt(s, n) for s, n in ((1, 40), (2, 5), (3, 70), (4, 17))]


def _run(path: str, monkeypatch, stack: bool, inspect=None, **kwargs) -> tuple[list, object]:
    """Greedy outputs of PROMPTS (whole-vocabulary log-probs) and the model's stack decision
    (inspect: called with the model before serving)."""
    monkeypatch.setenv(cpu_stack.SWITCH, "1" if stack else "0")
    # A small token budget: prompts are chunked and their chunks share steps with other decodes.
    llm = LLM(path, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1, max_num_batched_tokens=32,
              enable_prefix_caching=False, **kwargs)
    try:
        if inspect is not None:
            inspect(llm.engine.executor.worker.model_runner.model)
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=-1, logprobs=-1)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        model = llm.engine.executor.worker.model_runner.model
        used = model.model._cpu_stack is not None and model.model._cpu_stack.stack is not None
        rows = [(o.outputs[0].token_ids,
                 [{t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs[1:] + o.outputs[0].logprobs])
                for o in outs]
        return rows, used
    finally:
        llm.engine.shutdown()


def _assert_same_bits(path: str, monkeypatch, inspect=None, **kwargs) -> None:
    # The stack serves fp32 math (the default CPU path); native half precision never reaches it
    # (test_stack_steps_aside_where_it_does_not_apply), also when make test forces that path.
    monkeypatch.setenv("SHARDSERVE_CPU_NATIVE_HALF", "0")
    fused, used = _run(path, monkeypatch, True, inspect, **kwargs)
    per_module, unused = _run(path, monkeypatch, False, **kwargs)
    assert used and not unused
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(fused, per_module):
        assert tokens_a == tokens_b
        for a, b in zip(lps_a, lps_b):
            ids = sorted(a)
            assert ids == sorted(b)
            assert torch.equal(torch.tensor([a[i] for i in ids]), torch.tensor([b[i] for i in ids]))


@pytest.mark.parametrize("arch,overrides,dtype,kv", [
    ("llama", {}, "float32", "auto"),                       # fp32 panels, fp32 pool
    ("llama", {}, "bfloat16", "fp8"),                       # bf16 panels, fp8 pool (k/v scales)
    ("mistral", {"sliding_window": 8}, "bfloat16", "auto"),  # a window shorter than the prompts, bf16 pool
    ("qwen2", {}, "float32", "auto"),                       # QKV bias, tied embeddings
    ("qwen3", {}, "bfloat16", "auto"),                      # per-head q/k norms
])
def test_stack_gives_the_module_path_bits(tmp_path, monkeypatch, arch, overrides, dtype, kv):
    path = make_tiny_checkpoint(str(tmp_path / arch), arch, **overrides)
    _assert_same_bits(path, monkeypatch, dtype=dtype, kv_cache_dtype=kv)


@pytest.mark.parametrize("quant", ["fp8", "int8"])
def test_stack_takes_weights_widened_at_load(tmp_path, monkeypatch, quant):
    """`-q fp8` and a compressed-tensors INT8 checkpoint, widened after loading on the CPU, run as
    plain packed layers in the stack."""
    path = make_tiny_checkpoint(str(tmp_path / "llama"), "llama")
    kwargs = {"quantization": "fp8"} if quant == "fp8" else {}
    if quant == "int8":
        pytest.importorskip("compressed_tensors")
        from tests.quantization.ct_checkpoints import write_ct_checkpoint
        path = write_ct_checkpoint(path, str(tmp_path / "w8a8"), "W8A8", "int-quantized", dtype=torch.float32)
    _assert_same_bits(path, monkeypatch, dtype="float32", **kwargs)


@pytest.mark.skipif(not quant_ops.available(), reason="GGUF CPU kernels unavailable")
@pytest.mark.parametrize("act", ["int16", "fp32"])
def test_stack_gives_the_module_path_bits_on_gguf_blocks(tmp_path, monkeypatch, act):
    """Q8_0 blocks: the int8-activation kernels (plain and the gated gate/up) or the fp32 ones, called
    from C through the quant library's function pointers."""
    monkeypatch.setenv("SHARDSERVE_GGUF_DEQUANTIZE", "0")
    monkeypatch.setenv(quant_ops.ACTIVATIONS_SWITCH, act)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(make_tiny_checkpoint(str(tmp_path / "ckpt"), "smollm2"), path, "Q8_0")
    _assert_same_bits(path, monkeypatch, dtype="float32")


@pytest.mark.skipif(not quant_ops.available(), reason="GGUF CPU kernels unavailable")
@pytest.mark.parametrize("act", ["int16", "fp32"])
def test_stack_gives_the_module_path_bits_on_mixed_gguf_types(tmp_path, monkeypatch, act):
    """Q4_K with v and up in Q6_K (Q4_K_M's mix): fused q/k/v and gate/up of two types, each a chain
    of one kernel call per run of rows in C, and gate/up then SiLU-and-mul (no gated kernel)."""
    from tests.models import gguf_files
    from tests.quantization.test_gguf_quant import _typed_add_tensor
    monkeypatch.setenv("SHARDSERVE_GGUF_DEQUANTIZE", "0")
    monkeypatch.setenv(quant_ops.ACTIVATIONS_SWITCH, act)
    path = str(tmp_path / "tiny.gguf")
    ckpt = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama", hidden_size=256, intermediate_size=512)
    monkeypatch.setattr(gguf_files, "_add_tensor", _typed_add_tensor(gguf_files._add_tensor, "Q4_K", "Q6_K"))
    write_gguf(ckpt, path, "Q8_0")

    def kept_in_runs(model) -> None:
        types = {(name.rsplit(".", 1)[1], m.quant_method.type_name) for name, m in model.named_modules()
                 if name.endswith(("qkv_proj", "gate_up_proj", "o_proj", "down_proj"))}
        assert types == {("qkv_proj", "Q4_K+Q6_K"), ("gate_up_proj", "Q4_K+Q6_K"), ("o_proj", "Q4_K"),
                         ("down_proj", "Q4_K")}
    _assert_same_bits(path, monkeypatch, kept_in_runs, dtype="float32")


def test_stack_steps_aside_where_it_does_not_apply(tmp_path, monkeypatch):
    """OLMoE's q/k norms over all heads are not in the C stack, nor are experts other than GGUF blocks
    (Qwen3-MoE's fp32 experts): the modules run (and match HF, test_parity); bf16 activations (native
    half precision) never reach it; a bad switch value is refused."""
    for arch in ("olmoe", "qwen3_moe"):
        _, used = _run(make_tiny_checkpoint(str(tmp_path / arch), arch), monkeypatch, True)
        assert not used
    monkeypatch.setenv("SHARDSERVE_CPU_NATIVE_HALF", "1")
    llama = make_tiny_checkpoint(str(tmp_path / "llama"), "llama")
    _, used = _run(llama, monkeypatch, True, dtype="bfloat16")
    assert not used
    monkeypatch.setenv(cpu_stack.SWITCH, "2")
    with pytest.raises(ValueError, match=cpu_stack.SWITCH):
        cpu_stack.enabled()


def _tie_routers(ckpt: str) -> None:
    """Every router's rows made equal in threes (experts 0-2, 3-5, ...): each token's scores tie, and
    with top-2 a tie across the second pick where a group of three leads (torch.topk decides it)."""
    import glob

    from safetensors.torch import load_file, save_file
    for shard in glob.glob(f"{ckpt}/*.safetensors"):
        tensors = load_file(shard)
        for name, t in tensors.items():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                for e in range(t.shape[0]):
                    t[e] = t[e - e % 3]
        save_file(tensors, shard, metadata={"format": "pt"})


@pytest.mark.skipif(not quant_ops.available(), reason="GGUF CPU kernels unavailable")
@pytest.mark.parametrize("arch,experts,tied", [("qwen3_moe", 8, False), ("mixtral", 4, False), ("mixtral", 4, True)])
def test_stack_gives_the_module_path_bits_on_gguf_moe(tmp_path, monkeypatch, arch, experts, tied):
    """MoE layers with Q8_0 experts in their blocks (Qwen3-MoE: a dense layer between, renormalised
    top-2 of 8; Mixtral: top-2 of 4): the router, torch's routing redone in C (csrc/moe_route.c)
    and the experts' one kernel call inside the stack. Tied router scores: the rows tied across
    the k-th pick go to torch.topk itself, the rest stay in C."""
    from shardserve.kernels.cpu import moe_route
    from tests.models.gguf_files import write_moe_gguf
    monkeypatch.setenv("SHARDSERVE_GGUF_DEQUANTIZE", "0")
    ckpt = make_tiny_checkpoint(str(tmp_path / "ckpt"), arch)
    if tied:
        _tie_routers(ckpt)
    path = str(tmp_path / "tiny.gguf")
    write_moe_gguf(ckpt, path, "Q8_0")
    moe_route.matches_torch(experts, 2, True)   # the stack's check of the C routing, done before counting
    before = moe_route.torch_topk_rows
    _assert_same_bits(path, monkeypatch, dtype="float32")
    assert (moe_route.torch_topk_rows > before) == tied
