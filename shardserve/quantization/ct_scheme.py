"""A compressed-tensors `quantization_config` (llm-compressor's checkpoints, `quant_method:
compressed-tensors`) read into the scheme of each of its linear layers, or refused naming what is
not supported. No torch here: the planner reads it too (planner/memory.py).

What the library writes (compressed-tensors 0.x `ModelCompressor.update_config`): `config_groups`,
each with `targets` (module types or names, "re:" for a regex), `weights` and `input_activations`
(`num_bits`, `type` int | float, `strategy` tensor | channel | group | block | token, `group_size`,
`block_structure`, `symmetric`, `dynamic`, `actorder`) and a `format` (or one `format` for all);
`ignore` (modules left in full precision); `quantization_status` ("compressed": weights stored
quantized); `kv_cache_scheme`; `sparsity_config` and `transform_config`.

Read here: config groups targeting the `Linear` type, module names or "re:" patterns (each layer
takes the scheme of the most specific target that matches it, as the library decides: `CtLayout`;
a layer no target matches stays in full precision), each group with
- FP8 weights (float, 8 bits, `float-quantized` or `naive-quantized`), strategy tensor, channel or
  block; activations FP8 dynamic per token, static per tensor (its `input_scale` is read and not
  used: activations are scaled per token here) or none (W8A16);
- INT4 weights (int, 4 bits, `pack-quantized`), strategy group or channel, symmetric or not,
  `actorder` none, "weight" or "static" (they change how the tool quantizes, not what it stores), or
  "group" (`true` in older configs: GPTQ's activation order, each input's group in `weight_g_idx`,
  as GPTQ's `desc_act`; written by the library before 0.20); no activation quantization.
- INT8 weights (int, 8 bits): `int-quantized` (symmetric or not) or `pack-quantized` (symmetric: the
  W8A16 preset), strategy tensor, channel or group, INT8 activations per token (dynamic) or per
  tensor (static: `input_scale` read, not used) or none (quantization/int8.py: kept INT8 on CUDA where
  symmetric per channel or tensor, else widened at load).
- FP4 weights (float, 4 bits): NVFP4 (`nvfp4-pack-quantized`, tensor_group of 16: the NVFP4A16 and
  NVFP4 presets) or MXFP4 (`mxfp4-pack-quantized`, group of 32), with FP4 activations or none
  (quantization/fp4.py: dequantized at load, activations not quantized).
`ignore` may name the LM head (which otherwise is quantized with the rest, as the library does when
it is not ignored), MoE routers (`mlp.gate`, `shared_expert_gate`: full precision here anyway) and
any other linear layers, by name or "re:" pattern: those stay in full precision
(`CtScheme.ignores`, applied by models/loader.place_schemes; the parts of a fused q/k/v or
gate/up all or none).
A `sparsity_config` whose `format` is "dense" (pruned weights, 2:4 or unstructured, stored as
ordinary tensors with their zeros: RedHatAI's `Sparse-*` models) is read as a plain checkpoint: the
kernels are dense, so the zeros cost what any weight costs; with no `config_groups` beside it the
model is full precision (`sparsity_only`). Everything else (other bit widths or layouts,
sparsity stored compressed: `sparse-24-bitmask`, `sparse-bitmask`, `marlin-24`; transforms,
targets naming other module types, output activations) is refused naming the key; so are, when the
model is built (models/loader.place_schemes), the parts of one fused layer in different schemes and
the experts of one MoE layer in different schemes (experts all in a group of their own, or all in
`ignore`, take that group's expert method or none)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from shardserve.quantization.stored import names_lm_head

_ROUTERS = re.compile(r"(^|[.*:])(gate|shared_expert_gate)\$?$")   # a MoE router's name, as ignore lists spell it


@dataclass(frozen=True)
class CtScheme:
    weights: str                          # "fp8", "int4", "int8", "nvfp4" or "mxfp4"
    strategy: str                         # tensor | channel | block (FP8); group | channel (INT4); + tensor (INT8);
    #                                       tensor_group (NVFP4); group (MXFP4)
    group_size: int | None = None         # INT4 / INT8 group strategy: inputs per scale
    symmetric: bool = True                # INT4 / INT8: no stored zero points
    packed: bool = False                  # INT8 pack-quantized (else int-quantized)
    actorder_group: bool = False          # INT4 group strategy: inputs' groups in `weight_g_idx`
    block: tuple[int, int] | None = None  # FP8 block strategy: [output rows, inputs] per scale
    lm_head: bool = False                 # the LM head is quantized too (not in `ignore`)
    ignore: tuple[str, ...] = ()          # other layers left in full precision (names or "re:" patterns)

    def ignores(self, name: str) -> bool:
        """Whether the checkpoint leaves the layer `name` (an HF module name, "model.layers.0.mlp.down_proj")
        in full precision: an `ignore` entry equal to it, or a "re:" pattern matching it from its start
        (the library's rule)."""
        return any(re.match(e[3:], name) if e.startswith("re:") else e == name for e in self.ignore)


def _refuse(what: str) -> ValueError:
    return ValueError(f"compressed-tensors checkpoint: {what} is not supported; supported are FP8 weights "
                      "(tensor, channel or block scales), INT4 pack-quantized weights (group or channel scales), "
                      "INT8 weights (int-quantized, or pack-quantized symmetric; tensor, channel or group scales) and "
                      "NVFP4 / MXFP4 weights, "
                      "in config groups targeting the Linear type, module names or 're:' patterns")


def _split_ignore(ignore: list[str]) -> tuple[bool, tuple[str, ...]]:
    """(whether `ignore` leaves the LM head in full precision, the entries naming other layers; MoE
    routers' are dropped: they are full precision here anyway)."""
    head = any(names_lm_head(name) for name in ignore)
    return head, tuple(n for n in ignore if not names_lm_head(n) and not _ROUTERS.search(n))


def _fp8(weights: dict[str, Any], inputs: dict[str, Any] | None, fmt: str) -> dict[str, Any]:
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(f"FP8 weights in format {fmt!r}")
    strategy = weights.get("strategy")
    out: dict[str, Any] = {"weights": "fp8", "strategy": strategy}
    if strategy == "block":
        block = weights.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise _refuse(f"FP8 block_structure {block!r}")
        out["block"] = (block[0], block[1])
    elif strategy not in ("tensor", "channel"):
        raise _refuse(f"FP8 weight strategy {strategy!r}")
    if inputs is not None and (inputs.get("type") != "float" or inputs.get("num_bits") != 8):
        raise _refuse(f"FP8 weights with {inputs.get('type')} {inputs.get('num_bits')}-bit activations")
    return out


def _int4(weights: dict[str, Any], inputs: dict[str, Any] | None, fmt: str) -> dict[str, Any]:
    if inputs is not None:
        raise _refuse(f"INT4 weights with {inputs.get('num_bits')}-bit activations (only weight-only W4A16 is)")
    if fmt != "pack-quantized":
        raise _refuse(f"INT4 weights in format {fmt!r}")
    strategy = weights.get("strategy")
    actorder = weights.get("actorder")
    if actorder not in (None, False, True, "group", "weight", "static"):
        raise _refuse(f"INT4 actorder {actorder!r}")
    out: dict[str, Any] = {"weights": "int4", "strategy": strategy, "symmetric": bool(weights.get("symmetric", True)),
                           "actorder_group": actorder in (True, "group")}
    if out["actorder_group"] and strategy != "group":
        raise _refuse(f"INT4 actorder 'group' with strategy {strategy!r}")
    if strategy == "group":
        size = weights.get("group_size")
        if not isinstance(size, int) or size <= 0:
            raise _refuse(f"INT4 group_size {size!r}")
        out["group_size"] = size
    elif strategy != "channel":
        raise _refuse(f"INT4 weight strategy {strategy!r}")
    return out


def _fp4(weights: dict[str, Any], inputs: dict[str, Any] | None, fmt: str) -> dict[str, Any]:
    """NVFP4 (an E4M3 scale per 16 inputs under an fp32 global scale: the NVFP4A16 and NVFP4 presets)
    or MXFP4 (an E8M0 scale per 32 inputs: MXFP4A16, MXFP4); FP4 activations (W4A4) are not applied
    here: the layers compute in the model's dtype on the dequantized weights (quantization/fp4.py)."""
    layouts = {"nvfp4-pack-quantized": ("nvfp4", "tensor_group", 16), "mxfp4-pack-quantized": ("mxfp4", "group", 32)}
    if fmt not in layouts:
        raise _refuse(f"FP4 weights in format {fmt!r}")
    kind, strategy, group = layouts[fmt]
    if (weights.get("strategy"), weights.get("group_size")) != (strategy, group):
        raise _refuse(f"{kind.upper()} weights with strategy {weights.get('strategy')!r} and group_size "
                      f"{weights.get('group_size')!r} ({strategy} of {group} is)")
    if not weights.get("symmetric", True):
        raise _refuse("asymmetric FP4 weights")
    if inputs is not None and (inputs.get("type"), inputs.get("num_bits")) != ("float", 4):
        raise _refuse(f"FP4 weights with {inputs.get('type')} {inputs.get('num_bits')}-bit activations")
    return {"weights": kind, "strategy": strategy, "group_size": group}


def _int8(weights: dict[str, Any], inputs: dict[str, Any] | None, fmt: str) -> dict[str, Any]:
    if inputs is not None and (inputs.get("type") != "int" or inputs.get("num_bits") != 8):
        raise _refuse(f"INT8 weights with {inputs.get('type')} {inputs.get('num_bits')}-bit activations")
    strategy, symmetric = weights.get("strategy"), bool(weights.get("symmetric", True))
    if fmt not in ("int-quantized", "pack-quantized"):
        raise _refuse(f"INT8 weights in format {fmt!r}")
    if fmt == "pack-quantized" and not symmetric:   # (zero points packed four to a word: not read)
        raise _refuse("INT8 pack-quantized asymmetric weights")
    if weights.get("actorder") in (True, "group"):
        raise _refuse("INT8 actorder 'group'")
    out = {"weights": "int8", "strategy": strategy, "symmetric": symmetric, "packed": fmt == "pack-quantized"}
    if strategy == "group":
        size = weights.get("group_size")
        if not isinstance(size, int) or size <= 0:
            raise _refuse(f"INT8 group_size {size!r}")
        out["group_size"] = size
    elif strategy not in ("tensor", "channel"):
        raise _refuse(f"INT8 weight strategy {strategy!r}")
    return out


def _check_sparsity_and_transforms(cfg: dict[str, Any]) -> None:
    sparsity = cfg.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise _refuse(f"sparsity_config format {sparsity.get('format')!r} (weights stored compressed by their "
                      "sparsity; 'dense', the weights stored whole with their zeros, is read)")
    if cfg.get("transform_config"):
        raise _refuse("transform_config")


def sparsity_only(cfg: dict[str, Any]) -> bool:
    """A config with no quantization (no `config_groups`), only a dense `sparsity_config`: the model
    loads as a full-precision one. Refuses compressed sparsity formats and transforms."""
    if cfg.get("config_groups"):
        return False
    _check_sparsity_and_transforms(cfg)
    return bool(cfg.get("sparsity_config"))


def _group_scheme(group: dict[str, Any], fmt: str) -> dict[str, Any]:
    """One config group's scheme fields (`fmt`: the group's format, else the config's)."""
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if group.get("output_activations"):
        raise _refuse("output_activations")
    if weights.get("dynamic"):
        raise _refuse("dynamic weight quantization")
    kind = (weights.get("type"), weights.get("num_bits"))
    if kind == ("float", 8):
        return _fp8(weights, inputs, fmt)
    if kind == ("int", 4):
        return _int4(weights, inputs, fmt)
    if kind == ("int", 8):
        return _int8(weights, inputs, fmt)
    if kind == ("float", 4):
        return _fp4(weights, inputs, fmt)
    raise _refuse(f"{kind[0]} {kind[1]}-bit weights")


def _check_target(target: Any) -> str:
    """"Linear" (every linear layer), a module name, or a "re:" pattern; other module types refused."""
    if not isinstance(target, str) or not (target == "Linear" or target.startswith("re:") or "." in target
                                           or target == "lm_head"):
        raise _refuse(f"target {target!r} (the Linear type, module names and 're:' patterns are)")
    return target


@dataclass(frozen=True)
class CtLayout:
    """Which scheme each linear layer of a checkpoint is stored in: its config groups' targets in the
    library's order of precedence (a module name, then "re:" patterns in sorted order, then the
    Linear type: compressed-tensors' `match_targets`), a target named by two groups taking the later
    group's scheme, as the library does."""
    targets: tuple[tuple[str, CtScheme], ...]
    default: CtScheme   # the Linear type's scheme, else the first group's: layers are built in it first

    def scheme_for(self, name: str) -> CtScheme | None:
        """The scheme of the layer `name` (an HF module name, "lm_head" for the head); None: full
        precision (in `ignore`, or matching no target)."""
        if (not self.default.lm_head) if name == "lm_head" else self.default.ignores(name):
            return None
        for target, scheme in self.targets:
            if target in ("Linear", name) or (target.startswith("re:") and re.match(target[3:], name)):
                return scheme
        return None

    @property
    def schemes(self) -> tuple[CtScheme, ...]:
        return tuple(dict.fromkeys(scheme for _, scheme in self.targets))


def parse(cfg: dict[str, Any]) -> CtLayout:
    status = cfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"quantization_status {status!r} (weights not stored quantized)")
    _check_sparsity_and_transforms(cfg)
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise _refuse("a config without config_groups")
    head_ignored, others = _split_ignore(cfg.get("ignore") or [])
    by_target: dict[str, CtScheme] = {}
    for group in groups.values():
        scheme = CtScheme(**_group_scheme(group, group.get("format") or cfg.get("format") or ""),
                          lm_head=not head_ignored, ignore=others)
        for target in group.get("targets") or []:
            by_target[_check_target(target)] = scheme
    if not by_target:
        raise _refuse("config groups without targets")
    order = sorted(by_target, key=lambda t: (t == "Linear", t.startswith("re:"), t))
    first = next(iter(by_target.values()))
    return CtLayout(tuple((t, by_target[t]) for t in order), by_target.get("Linear", first))


