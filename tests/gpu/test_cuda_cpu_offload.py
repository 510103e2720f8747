"""--cpu-offload-gb on a GPU: layers streamed from pinned CPU memory give the tokens of the model
held whole on the GPU (fp32, so bit for bit), with real checkpoints, FP8 quantization at load and
random weights; and the GPU holds the offloaded bytes less two slots."""
from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + j) % 300 for j in range(n)] for i, n in enumerate((5, 40, 130))]


def _run(path: str, offload_gb: float, **kw):
    from shardserve import LLM, SamplingParams
    llm = LLM(path, device="cuda", kv_cache_memory="64MiB", show_progress=False, cpu_offload_gb=offload_gb,
              async_scheduling=False, **kw)
    try:
        runner = llm.engine.executor.worker.model_runner
        offload = runner.model.cpu_offload
        layers = runner.model.model.layers
        if offload_gb:
            assert offload is not None and offload.count >= 3
            assert all(h.is_pinned() for h in offload.host)
            assert all(p.is_cuda for p in layers.parameters())   # views of the GPU slots
            assert runner.config.model_config.enforce_eager
        else:
            assert offload is None
        # GPU bytes behind the parameters (the slots once each, however many layers view them); not
        # memory_allocated, which also counts what earlier engines in this process left in caches
        held = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                    for p in runner.model.parameters() if p.is_cuda}.values())
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        tokens = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params, use_tqdm=False)]
        return tokens, held, offload.offloaded_bytes - offload.slot_bytes if offload else 0
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("kw", [dict(dtype="float32"), dict(dtype="bfloat16", quantization="fp8"),
                                dict(dtype="float32", load_format="dummy")], ids=["fp32", "fp8", "dummy"])
def test_offloaded_layers_give_the_resident_models_tokens(tmp_path, kw):
    from tests.tiny_models import make_tiny_checkpoint
    if kw.get("quantization") == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama", hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8)
    layer_gb = (4 * 256 * 256 * 3 / 4 + 3 * 256 * 512) * 4 / (1 << 30)   # fp32 bytes of one layer's matrices
    resident, held_all, _ = _run(path, 0, enforce_eager=True, **kw)   # offloading runs eagerly
    offloaded, held_less, freed = _run(path, 4.5 * layer_gb, **kw)   # five of the eight layers
    assert offloaded == resident
    assert freed > 0 and abs(held_all - held_less - freed) <= 0.01 * freed, (held_all, held_less, freed)
