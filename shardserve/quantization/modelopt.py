"""NVIDIA ModelOpt checkpoints (`quant_method: modelopt`: nvidia's `*-FP8` and `*-FP4` models). The
config sits in `hf_quant_config.json` (`{"quantization": {"quant_algo": ...}}`; models/loader.
load_hf_config reads it when config.json has no `quantization_config`) or, flat, in config.json.

- `quant_algo: FP8`: E4M3 `weight` with one fp32 `weight_scale` per tensor (per fused part) and a
  static `input_scale` (read, not used): quantization/fp8.py's per-tensor FP8 method and kernels;
  MoE experts per expert likewise (quantization/fp8_moe.py).
- `quant_algo: NVFP4` (`group_size` 16): `weight` uint8 [N, K / 2], two E2M1 values a byte, the lower
  nibble first; `weight_scale` E4M3 [N, K / 16]; `weight_scale_2` fp32 [1] per fused part, a
  multiplier (w = e2m1 * weight_scale * weight_scale_2); `input_scale` (read, not used):
  quantization/fp4.py's method, dequantized once after loading (kept 4-bit on CUDA with
  SHARDSERVE_FP4_KERNELS=1); MoE experts dequantized too (quantization/fp4_moe.py).
- `kv_cache_quant_algo: FP8`: the KV-cache scales `k_proj.k_scale` / `v_proj.v_scale`
  (quantization/kv_scales.py, used with `--kv-cache-dtype fp8`).
- `exclude_modules`: layers left in 16 bits, by name (the module and what it holds) or `*` pattern.
- `quant_algo: MIXED_PRECISION` (ModelOpt's per-layer export, e.g. FP8 attention and NVFP4 MLP):
  `quantized_layers` maps each quantized layer's name (or a module holding it) to its own
  `quant_algo`, FP8 or NVFP4; layers it does not name are stored in 16 bits. Layers are built in
  the most common algorithm and models/loader.place_schemes gives the others theirs (`scheme_for`).
Other `quant_algo`s (INT4_AWQ, W4A8_AWQ, MXFP8 ...) are refused."""
from __future__ import annotations

import fnmatch
from collections import Counter
from typing import Any

from shardserve.layers.linear import LinearBase, LinearMethod
from shardserve.quantization.fp4 import Fp4LinearMethod
from shardserve.quantization.fp8 import Fp8LinearMethod
from shardserve.quantization.stored import modelopt_fields

ALGOS = ("FP8", "NVFP4")


class ModelOptConfig:
    name = "modelopt"
    lm_head = False
    block = None
    from_checkpoint = True

    def __init__(self, algo: str, exclude: tuple[str, ...], layers: dict[str, str] | None = None) -> None:
        self.algo = algo   # "FP8" | "NVFP4": the layers' (MIXED_PRECISION: the one they are built in)
        self.exclude = exclude
        self.layers = layers   # MIXED_PRECISION: each quantized layer's algorithm by name; else None
        self.fp8_matmuls = "FP8" in {algo, *(layers or {}).values()}   # FP8 matmuls on CUDA (config.check_device)

    @classmethod
    def from_quantization_config(cls, cfg: dict[str, Any]) -> "ModelOptConfig":
        cfg = modelopt_fields(cfg)
        kv = cfg.get("kv_cache_quant_algo")
        if kv not in (None, "FP8", "fp8"):
            raise ValueError(f"ModelOpt kv_cache_quant_algo={kv!r} is not supported; FP8 (or none) is")
        exclude = tuple(cfg.get("exclude_modules") or ())
        if str(cfg.get("quant_algo")).upper() != "MIXED_PRECISION":
            return cls(_algo(cfg, cfg, "quant_algo"), exclude)
        layers = {name: _algo(spec, cfg, f"quantized_layers[{name!r}].quant_algo")
                  for name, spec in (cfg.get("quantized_layers") or {}).items()}
        if not layers:
            raise ValueError("ModelOpt MIXED_PRECISION checkpoint without quantized_layers")
        return cls(Counter(layers.values()).most_common(1)[0][0], exclude, layers)

    @property
    def scheme(self) -> str:
        """The algorithm layers are built in (models/loader.place_schemes compares)."""
        return self.algo

    def scheme_for(self, name: str) -> str | None:
        """Layer `name`'s algorithm, None where it is stored in 16 bits (`exclude_modules`, or a
        MIXED_PRECISION checkpoint's `quantized_layers` not naming it or a module holding it)."""
        if self.ignores(name):
            return None
        if self.layers is None:
            return self.algo
        holders = [key for key in self.layers if _holds(key, name)]
        return self.layers[max(holders, key=len)] if holders else None   # the most specific entry

    def linear_method(self, layer: LinearBase, scheme: str | None = None) -> LinearMethod:
        if (scheme or self.algo) == "FP8":
            return Fp8LinearMethod(from_checkpoint=True)
        return Fp4LinearMethod("nvfp4", modelopt=True)

    def ignores(self, name: str) -> bool:
        """ModelOpt's rule for `exclude_modules`: the module itself or one inside it, or a `*` pattern."""
        return any(fnmatch.fnmatchcase(name, key) or _holds(key, name) for key in self.exclude)


def _holds(module: str, name: str) -> bool:
    """Whether module `module` is layer `name` or holds it."""
    return name == module or name.startswith(module + ".")


def _algo(spec: dict[str, Any], cfg: dict[str, Any], what: str) -> str:
    """A (layer's) `quant_algo`, checked: FP8, or NVFP4 in groups of 16 (the layer's or the config's)."""
    algo = str(spec.get("quant_algo") or "").upper()
    if algo not in ALGOS:
        raise ValueError(f"ModelOpt checkpoints with {what}={spec.get('quant_algo')!r} are not supported; "
                         f"{' and '.join(ALGOS)} ones are (and MIXED_PRECISION of them)")
    group = spec.get("group_size", cfg.get("group_size", 16))
    if algo == "NVFP4" and group != 16:
        raise ValueError(f"ModelOpt NVFP4 group_size={group} is not supported; 16 is")
    return algo
