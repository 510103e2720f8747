"""Structured outputs on a tiny random model (a byte-level tokenizer smaller than the model's vocab):
grammars hold whatever the weights say, across worker processes (TP=2: grammars pickled to the
sampling rank) and across preemption (the matcher replays the tokens a resumed request has)."""
from __future__ import annotations

import json
import re

import pytest

from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}


def _params(seed: int, **spec) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                          structured_outputs=StructuredOutputsParams(**spec))


def _check(outs) -> None:
    for out, kind in zip(outs, ["choice", "regex", "json"] * (len(outs) // 3)):
        c = out.outputs[0]
        if kind == "choice":
            assert c.text in ("red", "green", "blue") and c.finish_reason == "stop"
        elif kind == "regex":
            assert re.fullmatch(r"[a-c]{20}\d{1,3}", c.text) and c.finish_reason == "stop"
        elif c.finish_reason == "stop":
            assert set(json.loads(c.text)) == {"a", "b"}
        else:   # random weights may write a long integer: a prefix, cut by length
            assert c.finish_reason == "length" and c.text.startswith('{"') and " " * 3 not in c.text


def _batch(n: int):
    prompts = [[1, 2, 3 + i] for i in range(n)]
    specs = [dict(choice=["red", "green", "blue"]), dict(regex=r"[a-c]{20}\d{1,3}"), dict(json=SCHEMA)]
    return prompts, [_params(i, **specs[i % 3]) for i in range(n)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "llama"), "llama")


def test_tensor_parallel_workers(checkpoint):
    llm = LLM(checkpoint, kv_cache_memory="16MiB", show_progress=False, tensor_parallel_size=2)
    try:
        _check(llm.generate(*_batch(6), use_tqdm=False))
    finally:
        llm.engine.shutdown()


def test_preempted_requests_keep_their_grammar(checkpoint):
    # 8 blocks of 16 tokens for 12 requests of up to 43 tokens: the scheduler must preempt.
    llm = LLM(checkpoint, num_gpu_blocks_override=9, block_size=16, show_progress=False, max_model_len=64)
    try:
        _check(llm.generate(*_batch(12), use_tqdm=False))
        assert llm.engine.stats().num_preemptions > 0
    finally:
        llm.engine.shutdown()


def test_async_scheduling_matches_sync(checkpoint):
    """With async scheduling a step's bitmask is built before the previous token reaches the
    scheduler: the worker advances the matchers itself. Greedy outputs equal the synchronous run's."""
    prompts, params = _batch(6)
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=p.structured_outputs) for p in params]
    texts = []
    for async_scheduling in (False, True):
        llm = LLM(checkpoint, kv_cache_memory="16MiB", show_progress=False, async_scheduling=async_scheduling)
        try:
            assert llm.engine.async_scheduling == async_scheduling
            outs = llm.generate(prompts, params, use_tqdm=False)
            _check(outs)
            texts.append([(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs])
        finally:
            llm.engine.shutdown()
    assert texts[0] == texts[1]
