"""SamplingParams validation (errors name the field at fault) and per-sample children."""
from __future__ import annotations

import math

import pytest

from shardserve.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("n", 0),
    ("n", -1),
    ("n", 1.5),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", math.nan),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.nan),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 3.0),
    ("min_tokens", -1),
    ("logprobs", -2),
    ("logprobs", 1.5),
    ("prompt_logprobs", -3),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [3]),
    ("stop_token_ids", [5, -1]),
    ("stop_token_ids", ["7"]),
])
def test_invalid_value_raises_naming_the_field(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert message.startswith(field), message
    assert f"got {value!r}" in message                      # and what it got


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens .*max_tokens=4"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(temperature=0.0),
    dict(top_p=1.0, top_k=-1, min_p=1.0),
    dict(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.01),
    dict(max_tokens=None),
    dict(max_tokens=1, min_tokens=1),
    dict(logprobs=-1, prompt_logprobs=0),
    dict(stop="x", stop_token_ids=[0]),
    dict(n=4, seed=0),
])
def test_valid_values_accepted(kwargs):
    SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert p.stop_strings == [] and p.stop_token_ids == []
    assert not p.greedy and not p.uses_penalties
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="END").stop_strings == ["END"]
    assert SamplingParams(stop=("a", "b")).stop_strings == ["a", "b"]
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=0.5).uses_penalties


def test_stop_token_ids_copied():
    ids = [1, 2]
    p = SamplingParams(stop_token_ids=ids)
    ids.append(3)
    assert p.stop_token_ids == [1, 2]


def test_for_child_seeds():
    parent = SamplingParams(n=3, seed=100, temperature=0.7, stop=["x"], max_tokens=9)
    children = [parent.for_child(i) for i in range(3)]
    assert [c.seed for c in children] == [100, 101, 102]
    assert all(c.n == 1 for c in children)
    assert all((c.temperature, c.stop_strings, c.max_tokens) == (0.7, ["x"], 9) for c in children)
    assert parent.n == 3 and parent.seed == 100            # the parent is untouched
    assert children[0] is not parent


def test_for_child_without_seed_stays_unseeded():
    parent = SamplingParams(n=2)
    assert [parent.for_child(i).seed for i in range(2)] == [None, None]
