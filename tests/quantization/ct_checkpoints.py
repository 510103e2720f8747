"""compressed-tensors checkpoints written by the compressed-tensors library itself, as llm-compressor
drives it (apply the scheme, set each layer's scales, compress, save, write the config), with
min-max scales instead of calibration; and HF transformers' model of such a checkpoint, decompressed
by the same library (the reference the tests compare against)."""
from __future__ import annotations

import os
import shutil

import torch


def _minmax_qparams(module: torch.nn.Module) -> None:
    """Scales (and zero points) from the weight's own range, per the module's weight strategy."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    args, w = module.quantization_scheme.weights, module.weight.data.float()
    global_scale = None
    if args.strategy == "tensor_group":   # NVFP4: a global scale from the whole weight, then group scales under it
        from compressed_tensors.quantization.utils.helpers import generate_gparam
        global_scale = generate_gparam(w.amin(), w.amax())
        module.weight_global_scale.data.copy_(global_scale)
    if args.strategy in ("group", "tensor_group"):
        v = w.unflatten(-1, (-1, args.group_size))
        lo, hi = v.amin(-1), v.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    else:   # block
        bn, bk = args.block_structure
        v = torch.nn.functional.pad(w, (0, -w.shape[1] % bk, 0, -w.shape[0] % bn))
        v = v.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk))
        lo, hi = v.amin((1, 3)), v.amax((1, 3))
    scale, zero = calculate_qparams(lo.clamp(max=0), hi.clamp(min=0), args, global_scale=global_scale)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    if hasattr(module, "input_scale"):   # a static activation scale (a calibration's; read and unused here)
        module.input_scale.data.fill_(0.05)


def write_ct_checkpoint(src: str, dst: str, scheme: str | dict | None, fmt: str | None,
                        ignore: tuple[str, ...] = ("lm_head",), dtype: torch.dtype = torch.bfloat16,
                        groups: dict[str, tuple[list[str], str | dict, str]] | None = None) -> str:
    """`src` (an HF checkpoint) quantized with a compressed-tensors preset scheme ("FP8_DYNAMIC",
    "W4A16", ...) or a scheme's fields, in `fmt` ("float-quantized", "pack-quantized"), on every
    Linear; or with several config groups, name -> (targets, scheme, format) (the library then
    writes a "mixed-precision" config)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)

    def group(targets: list[str], scheme: str | dict, fmt: str | None) -> QuantizationScheme:
        if isinstance(scheme, str):
            scheme = preset_name_to_scheme(scheme, targets)
        else:
            scheme = QuantizationScheme(targets=targets, **scheme)
        if fmt is not None:
            scheme.format = fmt
        return scheme
    config_groups = {name: group(*g) for name, g in groups.items()} if groups else {
        "group_0": group(["Linear"], scheme, None)}
    apply_quantization_config(model, QuantizationConfig(config_groups=config_groups, ignore=list(ignore)))
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is not None:
                _minmax_qparams(module)
    compressor = ModelCompressor.from_pretrained_model(model, None if groups else fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    if groups:   # (transformers reads mixed formats with the wrong compressor: the library's own reading, saved)
        compressor.decompress_model(model)
        _save_plain(model, os.path.join(dst, "decompressed"))
    for name in os.listdir(src):   # the tokenizer and chat template
        if name.startswith(("tokenizer", "special_tokens", "chat_template")) or name.endswith(".model"):
            shutil.copy(os.path.join(src, name), dst)
    return dst


def _save_plain(model: torch.nn.Module, dst: str) -> None:
    """A decompressed model saved as a plain HF checkpoint (no quantization_config)."""
    from transformers import AutoModelForCausalLM
    config = model.config.__class__.from_dict(model.config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = model.state_dict()
    with torch.no_grad():
        for name, tensor in plain.state_dict().items():
            tensor.copy_(weights[name])
    plain.save_pretrained(dst)


def hf_decompressed(path: str, dtype: torch.dtype = torch.float32):
    """HF transformers' model of a compressed-tensors checkpoint, its weights decompressed by the
    library, in a plain model of the same config: the weights only, never the library's activation
    quantization (which older transformers versions keep applying after decompressing)."""
    import inspect
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM, CompressedTensorsConfig
    # transformers 5 says dequantize=True, 4.x run_compressed=False
    dequantize = "dequantize" in inspect.signature(CompressedTensorsConfig.__init__).parameters
    config = CompressedTensorsConfig(**({"dequantize": True} if dequantize else {"run_compressed": False}))
    with warnings.catch_warnings():   # "the config's quantization_config is used": it is, with dequantize added
        warnings.simplefilter("ignore", UserWarning)
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=config)
    plain_config = AutoConfig.from_pretrained(path)
    del plain_config.quantization_config
    model = AutoModelForCausalLM.from_config(plain_config, dtype=dtype)
    weights = loaded.state_dict()
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(weights[name])
    return model.eval()


def _input_order(base: str, k: int) -> torch.Tensor:
    """A stand-in for GPTQ's activation order: a permutation of the k inputs, the same for every
    projection reading the same inputs (q / k / v, gate / up: GPTQ sorts by the inputs' Hessian)."""
    import re
    import zlib
    reader = re.sub(r"\.(q_proj|k_proj|v_proj)$", ".qkv", re.sub(r"\.(gate_proj|up_proj|w1|w3)$", ".gate_up", base))
    return torch.randperm(k, generator=torch.Generator().manual_seed(zlib.crc32(reader.encode())))


def _int4_tensors(base: str, t: torch.Tensor, group: int, symmetric: bool,
                  actorder: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One weight pack-quantized by the library's own quantize, dequantize and pack functions, group by
    group (min-max scales); with `actorder`, input k is in group g_idx[k] of a shuffled order, as
    llm-compressor's GPTQ with `actorder: group` stores it (`weight_g_idx`)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    args = QuantizationArgs(num_bits=4, type="int", strategy="channel", symmetric=symmetric)
    w = t.float()
    n, k = w.shape
    g_idx = torch.arange(k) // group
    if actorder:
        g_idx = torch.empty_like(g_idx).index_copy_(0, _input_order(base, k), g_idx)
    groups = -(-k // group)
    q, values = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k)
    scale, zero = torch.empty(n, groups), torch.empty(n, groups, dtype=torch.int8)
    for g in range(groups):
        cols = (g_idx == g).nonzero().squeeze(1)
        v = w[:, cols]
        s, z = calculate_qparams(v.amin(1, keepdim=True).clamp(max=0), v.amax(1, keepdim=True).clamp(min=0), args)
        s = s.to(torch.bfloat16).float()   # as stored
        q[:, cols] = quantize(x=v, scale=s, zero_point=z, args=args, dtype=torch.int8)
        values[:, cols] = dequantize(x_q=q[:, cols], scale=s, zero_point=z, args=args).float()
        scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
    tensors = {f"{base}.weight_packed": pack_to_int32(q, 4), f"{base}.weight_scale": scale.to(torch.bfloat16),
               f"{base}.weight_shape": torch.tensor(w.shape)}
    if not symmetric:
        tensors[f"{base}.weight_zero_point"] = pack_to_int32(zero, 4, packed_dim=0)
    if actorder:
        tensors[f"{base}.weight_g_idx"] = g_idx.to(torch.int32)
    return tensors, values


def write_ct_int4_checkpoint(src: str, dst: str, group: int, symmetric: bool = True, actorder: bool = False,
                             moe: bool = False) -> dict[str, torch.Tensor]:
    """`src` with every decoder linear (and with `moe` every expert projection, stored per expert as
    llm-compressor stores per-expert Linear layers: transformers 5 fuses the experts, which the
    library's model-level path then leaves alone) pack-quantized to INT4, tensor by tensor; the
    router stays full precision. Returns the values each quantized tensor holds, by HF name."""
    from tests.quantization.checkpoints import is_quantized_linear, write_quantized_checkpoint
    from tests.quantization.moe_checkpoints import EXPERT
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group, "symmetric": symmetric}
    if actorder:
        weights["actorder"] = "group"
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
              "ignore": ["lm_head", "re:.*mlp.gate$"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    return write_quantized_checkpoint(src, dst, lambda base, t: _int4_tensors(base, t, group, symmetric, actorder),
                                      config, select=lambda name: (moe and bool(EXPERT.search(name)))
                                      or is_quantized_linear(name))


def _int8_tensors(base: str, t: torch.Tensor, per_channel: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One weight as llm-compressor's W8A8 stores it (`int-quantized`, symmetric): min-max scales per
    output channel ([N, 1]) or per tensor ([1]), in bf16 as stored, and int8 values."""
    w = t.float()
    scale = ((w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)) / 127)
    scale = scale.to(torch.bfloat16).float()
    q = (w / scale).round().clamp(-127, 127).to(torch.int8)
    return {f"{base}.weight": q, f"{base}.weight_scale": scale.to(torch.bfloat16)}, q.float() * scale


def write_ct_int8_moe_checkpoint(src: str, dst: str, per_channel: bool = True) -> dict[str, torch.Tensor]:
    """`src` with every decoder linear and expert projection (stored per expert, as in
    write_ct_int4_checkpoint) in INT8 W8A8 (dynamic INT8 activations per token); the router and the
    LM head stay full precision. Returns the values each quantized tensor holds, by HF name."""
    from tests.quantization.checkpoints import is_quantized_linear, write_quantized_checkpoint
    from tests.quantization.moe_checkpoints import EXPERT
    config = {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
              "ignore": ["lm_head", "re:.*mlp.gate$"], "config_groups": {"group_0": {
                  "targets": ["Linear"],
                  "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                              "strategy": "channel" if per_channel else "tensor"},
                  "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                        "dynamic": True}}}}
    return write_quantized_checkpoint(src, dst, lambda base, t: _int8_tensors(base, t, per_channel), config,
                                      select=lambda name: bool(EXPERT.search(name)) or is_quantized_linear(name))


def block_checkpoint_as_compressed_tensors(path: str, block: tuple[int, int]) -> str:
    """A block-scaled FP8 checkpoint (tests/quantization/checkpoints.py's `write_fp8_block_checkpoint`)
    renamed into llm-compressor's FP8_BLOCK layout: the same values, `weight_scale` for
    `weight_scale_inv`, compressed-tensors' config (the block strategy, the router ignored)."""
    from safetensors.torch import load_file, save_file

    from tests.quantization.moe_checkpoints import _set_quantization_config
    file = os.path.join(path, "model.safetensors")
    save_file({name.removesuffix("_inv"): t for name, t in load_file(file).items()}, file)
    _set_quantization_config(path, {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head", "re:.*mlp.gate$"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "block", "block_structure": list(block)},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": block[1],
                                  "dynamic": True}}}})
    return path
