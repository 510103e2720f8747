"""Structured outputs offline on the embedded SmolLM2: JSON schema, choice, regex, json_object,
EBNF, a mixed batch, bad specs, and the spec validation of StructuredOutputsParams."""
from __future__ import annotations

import json
import pickle
import re

import jsonschema
import pytest
import torch

from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams, StructuredOutputsParams
from shardserve.structured.bitmask import GrammarBitmask

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer with the city name only."}]


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _greedy(max_tokens: int, **spec) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec) if spec else None)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(max_model_len=1024, kv_cache_memory="128MiB", show_progress=False)
    yield llm
    llm.engine.shutdown()


def test_mixed_batch(llm):
    """One batch: schema, choice, regex, json_object and an unconstrained request, which must come
    out exactly as it does alone."""
    prompts = [_chat("Give a person's name and age as JSON."), FRANCE, _chat("Give a phone number."),
               _chat("Describe a cat as a JSON object."), FRANCE]
    params = [_greedy(32, json=SCHEMA), _greedy(8, choice=["Paris", "London"]), _greedy(16, regex=r"\d{3}-\d{4}"),
              _greedy(24, json_object=True), _greedy(16)]
    person, city, phone, cat, free = (o.outputs[0] for o in llm.chat(prompts, params, use_tqdm=False))
    assert person.finish_reason == "stop"
    jsonschema.validate(json.loads(person.text), SCHEMA)
    assert city.text == "Paris" and city.finish_reason == "stop"
    assert re.fullmatch(r"\d{3}-\d{4}", phone.text) and phone.finish_reason == "stop"
    if cat.finish_reason == "stop":   # complete JSON, or the length limit says why not
        assert isinstance(json.loads(cat.text), dict)
    else:
        assert cat.finish_reason == "length" and cat.text.startswith("{") and "\n\n" not in cat.text
    (alone,) = llm.chat([FRANCE], _greedy(16), use_tqdm=False)
    assert free.text == alone.outputs[0].text and free.token_ids == alone.outputs[0].token_ids


def test_grammar_and_sampling(llm):
    """An EBNF grammar, with temperature sampling (the bitmask comes before temperature / top-p), and
    min_tokens past the grammar's end (the grammar wins: EOS is not blocked)."""
    grammar = 'root ::= "yes" | "no" | "maybe"'
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_tokens=8, n=3, min_tokens=4,
                            structured_outputs=StructuredOutputsParams(grammar=grammar))
    (out,) = llm.chat([_chat("Is the sky blue?")], params, use_tqdm=False)
    assert all(c.text in ("yes", "no", "maybe") and c.finish_reason == "stop" for c in out.outputs)


@pytest.mark.parametrize("spec, needle", [
    (dict(json={"type": "nope"}), "JSON schema does not compile"),
    (dict(regex="(("), "regex does not compile"),
    (dict(grammar="root ::= "), "grammar does not compile"),
])
def test_bad_spec_is_a_value_error_and_engine_keeps_working(llm, spec, needle):
    with pytest.raises(ValueError, match=needle):
        llm.generate(["Hi"], _greedy(4, **spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate(["Hi"], _greedy(2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("kwargs", [{}, {"json": SCHEMA, "regex": "a"}, {"json_object": False},
                                    {"choice": []}, {"choice": ["a", 1]}, {"json": "{not json"}, {"regex": ""}])
def test_params_need_exactly_one_valid_kind(kwargs):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kwargs)


def test_params_from_dict_and_cache_key():
    p = SamplingParams(structured_outputs={"json": json.dumps(SCHEMA)})
    assert p.structured_outputs.kind == "json" and p.structured_outputs.compact
    assert p.structured_outputs.cache_key() == StructuredOutputsParams(json=SCHEMA).cache_key()
    assert not StructuredOutputsParams(json_object=True, disable_any_whitespace=False).compact


def test_compiled_grammar_pickles_and_masks(llm):
    """What a worker process receives: the grammar survives pickling, and the bitmask leaves only
    the allowed tokens (here, prefixes of the two choices) in a float32 and a bf16 row."""
    params = _greedy(4, choice=["Paris", "London"])
    llm.engine.compile_structured(params)
    spec = pickle.loads(pickle.dumps(params)).structured_outputs
    tok = llm.get_tokenizer()
    vocab = llm.engine.config.model_config.vocab_size

    class State:
        req_id, token_ids, num_prompt_tokens, sampling_params = "r", [1], 1, SamplingParams(structured_outputs=spec)

    free = type("Free", (), {"req_id": "f", "sampling_params": SamplingParams()})()
    for dtype in (torch.float32, torch.bfloat16):
        masker = GrammarBitmask(vocab, torch.device("cpu"))
        logits, rows = masker.mask_logits(torch.zeros(2, vocab, dtype=dtype), [free, State()])
        assert rows == [1] and torch.isfinite(logits[0]).all()
        allowed = {tok.decode([i]) for i in torch.isfinite(logits[1]).nonzero().flatten().tolist()}
        assert {"Paris", "London"} <= allowed and all("Paris".startswith(a) or "London".startswith(a)
                                                      for a in allowed)
