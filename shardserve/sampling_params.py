"""SamplingParams with vLLM's field names and semantics, validated on construction."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

_GREEDY_EPS = 1e-5


class InvalidParameter(ValueError):
    """A ValueError that names the offending field (the API server reports it as `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regex, one of some strings, an EBNF grammar, or any
    JSON object (vLLM's names; exactly one of them). disable_any_whitespace: vLLM's switch; unset
    (None) or True gives compact JSON (no free whitespace runs), False lets the model put any
    whitespace between JSON tokens. The engine compiles the grammar at admission and keeps it
    in `compiled` (structured/compiler.py)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    compiled: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidParameter("structured_outputs needs exactly one of json, regex, choice, grammar or "
                                   f"json_object, got {given or 'none'}", "structured_outputs")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise InvalidParameter(f"structured_outputs.json is not valid JSON: {e}",
                                       "structured_outputs") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise InvalidParameter("structured_outputs.json must be a JSON schema (an object or its JSON text)",
                                   "structured_outputs")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise InvalidParameter("structured_outputs.choice must be a non-empty list of non-empty strings",
                                   "structured_outputs")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParameter(f"structured_outputs.{name} must be a non-empty string", "structured_outputs")

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def compact(self) -> bool:
        return self.disable_any_whitespace is not False

    def cache_key(self) -> tuple[str, str, bool]:
        """(kind, spec, compact): equal keys compile to the same grammar."""
        kind = self.kind
        spec = {"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                "json_object": True}[kind]
        text = spec if isinstance(spec, str) and kind != "json" else json.dumps(spec, sort_keys=True)
        if kind == "json" and isinstance(spec, str):
            text = json.dumps(json.loads(spec), sort_keys=True)
        return kind, text, self.compact


class RequestOutputKind(IntEnum):
    """Which RequestOutputs a request yields (vLLM's values): one after every step with everything so
    far (CUMULATIVE, what streaming and the server read), or only the finished one (FINAL_ONLY, what
    LLM.generate and LLM.chat ask for: no output objects built per step, whose token lists grow with
    the output)."""
    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16         # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None         # top-k logprobs per generated token (-1: whole vocabulary)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (-1: whole vocabulary)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None   # OpenAI's: added to the token's logit, in [-100, 100]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def bad(field_name: str, why: str) -> ValueError:
            return InvalidParameter(f"{field_name} {why}, got {getattr(self, field_name)!r}", field_name)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < -1):
                raise bad(name, "must be a non-negative integer (or -1 for the whole vocabulary)")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.logit_bias):
                raise bad("logit_bias", "must map non-negative token ids to biases")
            if any(not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
                raise bad("logit_bias", "values must be numbers in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def takes_drafts(self) -> bool:
        """Speculative decoding verifies drafts for this request: not with penalties or logprobs,
        which count what came before each position in ways a verification step does not reproduce."""
        return not self.uses_penalties and self.logprobs is None

    def for_child(self, index: int) -> "SamplingParams":
        """Parameters for the index-th of n samples: n=1, and a distinct seed if one was given."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
