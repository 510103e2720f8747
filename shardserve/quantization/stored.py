"""What a checkpoint's stored `quantization_config` says about its weights, without torch (the
planner and the benchmarks read it): the linears' weight type and whether the LM head is quantized."""
from __future__ import annotations

import os
import re
from typing import Any


def fp4_kept_on_gpus() -> bool:
    """SHARDSERVE_FP4_KERNELS=1: FP4 (NVFP4 / MXFP4) linears stay 4-bit on CUDA, on
    kernels/quant/triton_fp4_gemv.py and triton_fp4.py (about 2.7x less weight memory, a faster
    batch-1 decode than bf16, a slower first token: docs/models.md); by default they are
    dequantized at load, as on the CPU (quantization/fp4.py)."""
    return os.environ.get("SHARDSERVE_FP4_KERNELS", "0") == "1"


def _ct_groups(q: dict[str, Any]) -> list[dict[str, Any]]:
    """compressed-tensors: the config groups (quantization/ct_scheme.py)."""
    return list((q.get("config_groups") or {}).values())


def _ct_dtype(w: dict[str, Any]) -> str | None:
    """A compressed-tensors group's weight type as a GPU holds it (None: widened to 16 bits at load)."""
    kind = (w.get("type"), w.get("num_bits"))
    if kind == ("float", 8):
        return "fp8"
    if kind == ("int", 8):   # held INT8 on GPUs only symmetric per channel or tensor, else widened at load
        return "int8" if w.get("symmetric", True) and w.get("strategy") in ("tensor", "channel") else None
    if kind == ("float", 4):
        return "fp4" if fp4_kept_on_gpus() else None
    return "int4" if kind == ("int", 4) else None


_WIDTH = {"int4": 0, "fp4": 1, "int8": 2, "fp8": 2, None: 3}


def modelopt_fields(q: dict[str, Any]) -> dict[str, Any]:
    """A ModelOpt config's keys in one dict: hf_quant_config.json nests them under "quantization",
    a config.json's `quantization_config` holds them flat."""
    return {**q, **(q.get("quantization") or {})}


def _modelopt_algos(q: dict[str, Any]) -> set[str]:
    """A ModelOpt config's algorithms: its `quant_algo`, or MIXED_PRECISION's per layer."""
    fields = modelopt_fields(q)
    if str(fields.get("quant_algo")).upper() == "MIXED_PRECISION":
        return {str(s.get("quant_algo")).upper() for s in (fields.get("quantized_layers") or {}).values()}
    return {str(fields.get("quant_algo")).upper()}


def weight_dtype(q: dict[str, Any] | None) -> str | None:
    """"fp8", "int4", "int8" or "fp4" (NVFP4 / MXFP4 with SHARDSERVE_FP4_KERNELS=1) for the linears of a
    quantized checkpoint as a GPU holds them; None for other formats (and for INT8 layouts widened and
    FP4 ones dequantized at load). A checkpoint with layers in several schemes (compressed-tensors
    groups, GPTQ's `dynamic`, ModelOpt's MIXED_PRECISION) counts at its widest (the planner then
    never plans less than it holds). Layers a checkpoint leaves unquantized (its ignore list,
    `modules_to_not_convert`, a "-:" override) are not counted wider: they are usually a few (the
    head, the routers); MoE experts stored apart from the linears are sized on their own
    (planner/catalog.checkpoint_expert_bytes)."""
    q = q or {}
    method = str(q.get("quant_method", "")).lower()
    if method in ("fp8", "fbgemm_fp8") or (method == "modelopt" and _modelopt_algos(q) == {"FP8"}):
        return "fp8"
    if method == "modelopt" and _modelopt_algos(q) == {"NVFP4"} and fp4_kept_on_gpus():
        return "fp4"
    if method == "compressed-tensors":
        dtypes = [_ct_dtype(g.get("weights") or {}) for g in _ct_groups(q)]
        return max(dtypes, key=_WIDTH.__getitem__) if dtypes else None
    # GPTQModel's per-module overrides (`dynamic`): 8-bit layers are the widest, held at 16 bits
    wider = any(isinstance(o, dict) and o.get("bits", 4) != 4 for o in (q.get("dynamic") or {}).values())
    if method in ("gptq", "awq") and q.get("bits") == 4 and not wider:
        return "int4"
    return None   # (8-bit GPTQ is dequantized at load, quantization/int4.py)


def left_out_patterns(cfg: dict[str, Any], *keys: str) -> tuple[str, ...]:
    """The `left_out` patterns under `keys` of a quantization_config, each checked to be a regular
    expression (a bad one is refused at start-up, naming the key)."""
    patterns = []
    for key in keys:
        for pattern in cfg.get(key) or ():
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise ValueError(f"quantization_config.{key} entry {pattern!r} is not a regular expression: {e}") \
                    from None
            patterns.append(pattern)
    return tuple(patterns)


def left_out(name: str, patterns: tuple[str, ...]) -> bool:
    """transformers' rule for `modules_to_not_convert` (FP8, FBGEMM FP8 and AWQ checkpoints): a pattern
    leaves module `name` unquantized where it matches from the start up to a module boundary, as a
    regex with that boundary, or as a suffix ("mlp.gate" leaves the router, not "mlp.gate_proj"; a
    full name, vLLM's rule for `ignored_layers`, is all three)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{key}){boundary}", name) or name.endswith(key) for key in patterns)


def names_lm_head(entry: str) -> bool:
    """A compressed-tensors `ignore` entry naming the LM head ("lm_head", "re:.*lm_head$")."""
    return entry.removeprefix("re:").lstrip(".*").rstrip("$") == "lm_head"


def _targets_lm_head(target: str) -> bool:
    return target in ("Linear", "lm_head") or (target.startswith("re:") and re.match(target[3:], "lm_head") is not None)


def head_quantized(q: dict[str, Any] | None) -> bool:
    """GPTQ's `lm_head: true`; compressed-tensors: a head some group targets and `ignore` does not name."""
    q = q or {}
    if str(q.get("quant_method", "")).lower() == "compressed-tensors":
        targeted = any(_targets_lm_head(t) for g in _ct_groups(q) for t in g.get("targets") or [])
        return targeted and not any(names_lm_head(name) for name in q.get("ignore") or [])
    return bool(q.get("lm_head"))
