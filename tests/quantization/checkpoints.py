"""Quantized checkpoints written the way their tools write them, for the quantization tests, and the
real-weights SmolLM2 HF checkpoint they start from (made from the embedded GGUF by transformers)."""
from __future__ import annotations

import glob
import json
import os
import shutil

import torch

# A fixed English text for perplexity (four paragraphs, ~320 SmolLM2 tokens).
ENGLISH_TEXT = (
    "The river flows through the old town, past the market square and the church, and on towards the "
    "sea. In spring the fields along its banks are green, and farmers bring their goods to the town "
    "every week. Visitors come to see the bridge, which was built more than three hundred years ago.\n\n"
    "Most of the houses near the water are small and painted in bright colours. Fishermen used to "
    "live there, and some families still keep boats tied up behind their gardens. In the evening, "
    "people walk along the river path, and children feed the ducks that gather near the mill. The "
    "mill itself has not worked for many years, but the town council restored its wheel, and on "
    "summer weekends it turns again for the tourists.\n\n"
    "The school stands at the top of the hill, next to the library and the small museum. The museum "
    "tells the story of the town: how it grew from a village of a few hundred people into a busy "
    "market centre, how the railway arrived in the nineteenth century, and how the great flood of "
    "1953 changed the shape of the river. Old photographs show the streets under water and boats "
    "rowing past the shops.\n\n"
    "Today the town is quieter than it once was. Many young people move to the city to study or to "
    "find work, but some return when they have children of their own. They say that life by the "
    "river is slower, and that the air is cleaner. On market day, however, the square is as crowded "
    "as ever, and the sound of voices fills the streets from early morning until the last stall is "
    "packed away."
)

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def smollm2_hf_checkpoint(path: str) -> str:
    """SmolLM2-135M-Instruct as an HF safetensors checkpoint (bf16), from the embedded Q4_1 GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardserve.models.loader import default_model_path
    gguf = default_model_path()
    kw = dict(gguf_file=os.path.basename(gguf))
    # In float32 transformers dequantizes every tensor into plain Linear layers, but still marks the
    # model GGUF-quantized and refuses to save it: drop that mark, then save as bf16.
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), dtype=torch.float32, **kw)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(os.path.dirname(gguf), **kw).save_pretrained(path)
    return path


def _state_dict(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        tensors.update(load_file(file))
    return tensors


def is_quantized_linear(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR_SUFFIXES


def write_quantized_checkpoint(src: str, dst: str, quantize, quantization_config: dict,
                               select=is_quantized_linear) -> dict[str, torch.Tensor]:
    """`src` rewritten with every decoder linear (or every tensor name `select` picks) replaced by
    `quantize(base_name, weight) -> (tensors by full name, dequantized weight)`, the rest as it was,
    and `quantization_config` in config.json. Returns the dequantized weights by HF name (what the
    quantized model computes with)."""
    from safetensors.torch import save_file
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, f), dst)
    out, dequantized = {}, {}
    for name, t in _state_dict(src).items():
        if not select(name):
            out[name] = t
            continue
        tensors, dequantized[name] = quantize(name[:-len(".weight")], t)
        out.update(tensors)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dequantized


def _fp8_tensors(base: str, t: torch.Tensor, static: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    w = t.float()
    scale = w.abs().amax() / 448.0
    q = (w / scale).to(torch.float8_e4m3fn)
    tensors = {f"{base}.weight": q, f"{base}.weight_scale": scale.reshape(())}
    if static:
        tensors[f"{base}.input_scale"] = torch.tensor(0.05)
    return tensors, q.float() * scale


def _fp8_block_tensors(base: str, t: torch.Tensor,
                       block: tuple[int, int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One weight as DeepSeek-V3 / Qwen3-FP8 store it: E4M3 with one absmax scale per block of
    block[0] x block[1] (edge blocks partial), `weight_scale_inv` the multiplier back. Returns the
    tensors and the values they hold."""
    w, (bn, bk) = t.float(), block
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(-(-n // bn), -(-k // bk))
    values = torch.empty(n, k)
    for i in range(0, n, bn):
        for j in range(0, k, bk):
            tile = w[i:i + bn, j:j + bk]
            s = tile.abs().amax().clamp_min(1e-12) / 448.0
            q[i:i + bn, j:j + bk] = (tile / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            scale_inv[i // bn, j // bk] = s
            values[i:i + bn, j:j + bk] = q[i:i + bn, j:j + bk].float() * s
    return {f"{base}.weight": q, f"{base}.weight_scale_inv": scale_inv}, values


def write_fp8_block_checkpoint(src: str, dst: str, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """`src` as a block-scaled FP8 checkpoint (`weight_block_size`, dynamic activations; MoE experts
    too); returns the values it holds, by HF name."""
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return write_quantized_checkpoint(src, dst, lambda base, t: _fp8_block_tensors(base, t, block), config)


def write_fp8_checkpoint(src: str, dst: str, static: bool = True) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint as AutoFP8 / vLLM's `quant_method: fp8` write it: every decoder linear
    E4M3 with one `weight_scale` per tensor and (static: True) a static `input_scale`; the rest as it was."""
    return write_quantized_checkpoint(src, dst, lambda base, t: _fp8_tensors(base, t, static),
                                      {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"})


def hf_with_weights(path: str, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
    """HF transformers' model of `path` with the given tensors swapped in (the dequantized values)."""
    from tests.tiny_models import load_hf_model
    hf = load_hf_model(path, dtype)
    state = hf.state_dict()
    with torch.no_grad():
        for name, w in weights.items():
            state[name].copy_(w.to(dtype))
    return hf
