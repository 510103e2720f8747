"""What a checkpoint's stored `quantization_config` says about its weights, without torch (the
planner and the benchmarks read it): the linears' weight type and whether the LM head is quantized."""
from __future__ import annotations

from typing import Any


def _ct_weights(q: dict[str, Any]) -> dict[str, Any]:
    """compressed-tensors: the first config group's weight arguments (quantization/ct_scheme.py)."""
    groups = q.get("config_groups") or {}
    return (next(iter(groups.values()), None) or {}).get("weights") or {}


def weight_dtype(q: dict[str, Any] | None) -> str | None:
    """"fp8", "int4" or "int8" for the linears of a quantized checkpoint as a GPU holds them; None for
    other formats (and for INT8 layouts widened at load)."""
    q = q or {}
    method = str(q.get("quant_method", "")).lower()
    if method in ("fp8", "fbgemm_fp8"):
        return "fp8"
    bits = q.get("bits")
    if method == "compressed-tensors":
        w = _ct_weights(q)
        if (w.get("type"), w.get("num_bits")) == ("float", 8):
            return "fp8"
        if (w.get("type"), w.get("num_bits")) == ("int", 8):   # held INT8 on GPUs only symmetric per channel
            # or tensor; else widened to the compute dtype at load (quantization/int8.py)
            return "int8" if w.get("symmetric", True) and w.get("strategy") in ("tensor", "channel") else None
        bits = w.get("num_bits") if w.get("type") == "int" else None
    if method in ("gptq", "awq", "compressed-tensors") and bits == 4:
        return "int4"
    return None   # (8-bit GPTQ is dequantized at load, quantization/int4.py)


def names_lm_head(entry: str) -> bool:
    """A compressed-tensors `ignore` entry naming the LM head ("lm_head", "re:.*lm_head$")."""
    return entry.removeprefix("re:").lstrip(".*").rstrip("$") == "lm_head"


def head_quantized(q: dict[str, Any] | None) -> bool:
    """GPTQ's `lm_head: true`; compressed-tensors: a head its `ignore` list does not name."""
    q = q or {}
    if str(q.get("quant_method", "")).lower() == "compressed-tensors":
        return bool(_ct_weights(q)) and not any(names_lm_head(name) for name in q.get("ignore") or [])
    return bool(q.get("lm_head"))
