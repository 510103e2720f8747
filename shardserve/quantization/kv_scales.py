"""Where checkpoints keep an attention layer's KV-cache scales (vLLM's `k_scale` / `v_scale`, read
by `--kv-cache-dtype fp8`), as their tools spell them, mapped onto the layer's `attn.k_scale` /
`attn.v_scale` (layers/attention/layer.py):

- `...self_attn.k_scale` / `.v_scale` (llm-compressor, vLLM's own);
- `...self_attn.k_proj.k_scale` / `v_proj.v_scale` (ModelOpt, AutoFP8);
- `...self_attn.k_proj.output_scale` / `v_proj.output_scale` (compressed-tensors' KV scheme);
- `...self_attn.kv_scale` (the older single scale): both.

Query and attention-probability scales (`q_scale`, `prob_scale`, `q_proj.output_scale`) are for
FP8 attention math, which is not done here: read as nothing.
"""
from __future__ import annotations

_TARGETS = (   # suffix after `.self_attn`, scales it gives (longest suffixes first)
    (".k_proj.k_scale", "k"), (".v_proj.v_scale", "v"),
    (".k_proj.output_scale", "k"), (".v_proj.output_scale", "v"), (".q_proj.output_scale", ""),
    (".kv_scale", "kv"), (".k_scale", "k"), (".v_scale", "v"), (".q_scale", ""), (".prob_scale", ""),
)


def kv_scale_targets(checkpoint_name: str) -> list[str] | None:
    """The attention scales a checkpoint tensor fills (`<...>.self_attn.attn.k_scale`, ...), [] for
    one that is read as nothing, None for a tensor that is no KV-cache scale."""
    attn = checkpoint_name.rfind(".self_attn.")
    if attn < 0:
        return None
    prefix, rest = checkpoint_name[:attn + len(".self_attn")], checkpoint_name[attn + len(".self_attn"):]
    for suffix, kinds in _TARGETS:
        if rest == suffix:
            return [f"{prefix}.attn.{kind}_scale" for kind in kinds]
    return None
