"""NVIDIA ModelOpt checkpoints (`quant_method: modelopt`: nvidia's `*-FP8` and `*-FP4` models). The
config sits in `hf_quant_config.json` (`{"quantization": {"quant_algo": ...}}`; models/loader.
load_hf_config reads it when config.json has no `quantization_config`) or, flat, in config.json.

- `quant_algo: FP8`: E4M3 `weight` with one fp32 `weight_scale` per tensor (per fused part) and a
  static `input_scale` (read, not used): quantization/fp8.py's per-tensor FP8 method and kernels;
  MoE experts per expert likewise (quantization/fp8_moe.py).
- `quant_algo: NVFP4` (`group_size` 16): `weight` uint8 [N, K / 2], two E2M1 values a byte, the lower
  nibble first; `weight_scale` E4M3 [N, K / 16]; `weight_scale_2` fp32 [1] per fused part, a
  multiplier (w = e2m1 * weight_scale * weight_scale_2); `input_scale` (read, not used):
  quantization/fp4.py's method, dequantized once after loading. NVFP4 MoE experts are refused.
- `kv_cache_quant_algo: FP8`: the KV-cache scales `k_proj.k_scale` / `v_proj.v_scale`
  (quantization/kv_scales.py, used with `--kv-cache-dtype fp8`).
- `exclude_modules`: layers left in 16 bits, by name (the module and what it holds) or `*` pattern.
Other `quant_algo`s (INT4_AWQ, W4A8_AWQ, MIXED_PRECISION, MXFP8 ...) are refused."""
from __future__ import annotations

import fnmatch
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

    def __init__(self, algo: str, exclude: tuple[str, ...]) -> None:
        self.algo = algo   # "FP8" | "NVFP4"
        self.fp8 = algo == "FP8"   # FP8 matmuls on CUDA (config.check_device)
        self.exclude = exclude

    @classmethod
    def from_quantization_config(cls, cfg: dict[str, Any]) -> "ModelOptConfig":
        cfg = modelopt_fields(cfg)
        algo = str(cfg.get("quant_algo") or "").upper()
        if algo not in ALGOS:
            raise ValueError(f"ModelOpt checkpoints with quant_algo={cfg.get('quant_algo')!r} are not supported; "
                             f"{' and '.join(ALGOS)} ones are")
        if algo == "NVFP4" and cfg.get("group_size", 16) != 16:
            raise ValueError(f"ModelOpt NVFP4 group_size={cfg['group_size']} is not supported; 16 is")
        kv = cfg.get("kv_cache_quant_algo")
        if kv not in (None, "FP8", "fp8"):
            raise ValueError(f"ModelOpt kv_cache_quant_algo={kv!r} is not supported; FP8 (or none) is")
        return cls(algo, tuple(cfg.get("exclude_modules") or ()))

    def linear_method(self, layer: LinearBase) -> LinearMethod:
        return Fp8LinearMethod(from_checkpoint=True) if self.fp8 else Fp4LinearMethod("nvfp4", modelopt=True)

    def ignores(self, name: str) -> bool:
        """ModelOpt's rule for `exclude_modules`: the module itself or one inside it, or a `*` pattern
        (models/loader.place_schemes asks)."""
        return any(fnmatch.fnmatchcase(name, key) or name == key or name.startswith(key + ".") for key in self.exclude)
