"""Compile StructuredOutputsParams into xgrammar grammars for one tokenizer, cached per spec.

The engine compiles at admission, in the front end (LLM.generate's caller thread, or a thread of
the server's pool for AsyncLLMEngine), so the engine loop never compiles. The compiled grammar
rides on the request's StructuredOutputsParams to the worker that samples (see `Grammar`)."""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import xgrammar as xgr

from shardserve.sampling_params import InvalidParameter, StructuredOutputsParams

_CACHE_SIZE = 256
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s*\S+:\d+:\s*")   # "[21:50:59] /project/cpp/x.cc:83: "


class Grammar:
    """A compiled grammar. Pickles as xgrammar's JSON (with its tokenizer info) for worker
    processes; each process rebuilds a tokenizer info once and reuses it."""

    _infos: dict[str, xgr.TokenizerInfo] = {}
    _lock = threading.Lock()

    def __init__(self, compiled: xgr.CompiledGrammar, info_key: str) -> None:
        self.compiled, self.info_key = compiled, info_key

    def __reduce__(self):
        return _load_grammar, (self.compiled.serialize_json(), self.info_key,
                               self.compiled.tokenizer_info.serialize_json())

    def matcher(self) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compiled)


def _load_grammar(grammar_json: str, info_key: str, info_json: str) -> Grammar:
    with Grammar._lock:
        info = Grammar._infos.get(info_key)
        if info is None:
            info = Grammar._infos[info_key] = xgr.TokenizerInfo.deserialize_json(info_json)
    return Grammar(xgr.CompiledGrammar.deserialize_json(grammar_json, info), info_key)


def tokenizer_info(backend: Any, vocab_size: int, stop_token_ids: list[int],
                   special_ids: frozenset[int] = frozenset()) -> xgr.TokenizerInfo:
    """backend: a `tokenizers.Tokenizer`. vocab_size: the model's (logits width), which may exceed the
    tokenizer's; ids past the tokenizer are never allowed. Special tokens are blanked so that a string
    in the output cannot spell one; stop tokens are allowed by id where the grammar may end."""
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size and idx not in special_ids:
            encoded[idx] = token
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, metadata["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=sorted(stop_token_ids) or None,
                             add_prefix_space=metadata["add_prefix_space"])


def _choice_grammar(choices: list[str]) -> str:
    # EBNF string literals take JSON's escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Thread-safe: compiles may run in several threads; the cache is an LRU of `_CACHE_SIZE` specs."""

    def __init__(self, backend: Any, vocab_size: int, stop_token_ids: frozenset[int],
                 special_ids: frozenset[int] = frozenset()) -> None:
        info = tokenizer_info(backend, vocab_size, list(stop_token_ids), special_ids)
        self.info_key = f"{id(self)}:{vocab_size}"
        self._compiler = xgr.GrammarCompiler(info, max_threads=4, cache_enabled=False)
        self._cache: OrderedDict[tuple, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """The compiled grammar for spec (cached); sets spec.compiled too. Raises InvalidParameter
        (a ValueError) naming what does not compile."""
        key = spec.cache_key()
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
        if grammar is None:
            grammar = Grammar(self._compile(spec), self.info_key)
            with self._lock:
                self._cache[key] = grammar
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        spec.compiled = grammar
        return grammar

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind, compact = spec.kind, spec.compact
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else spec.json
                if isinstance(schema, str):
                    schema = json.loads(schema)
                return self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=not compact,
                                                          max_whitespace_cnt=None if compact else 4)
            if kind == "regex":
                return self._compiler.compile_regex(spec.regex)
            if kind == "choice":
                return self._compiler.compile_grammar(_choice_grammar(spec.choice))
            return self._compiler.compile_grammar(spec.grammar)
        except Exception as e:   # xgrammar raises RuntimeError / ValueError with its parser's message
            what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                    "choice": "choice list", "grammar": "grammar"}[kind]
            text = str(e).strip()
            message = _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(e).__name__
            raise InvalidParameter(f"structured_outputs.{kind}: the {what} does not compile: {message}",
                                   "structured_outputs") from None
