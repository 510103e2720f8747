"""Structured outputs through the official `openai` client against a real `shardserve serve`:
response_format json_schema / json_object, vLLM's structured_outputs extra body on chat and
completions, and a bad schema as a 400 after which the server keeps answering."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.server.server_process import post, server_fixture

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer with the city name only."}]


server = server_fixture("--kv-cache-memory", "128MiB", "--max-model-len", "1024", "--max-num-seqs", "8")


def test_response_format_json_schema_and_json_object(client):
    messages = [{"role": "user", "content": "Give a person's name and age as JSON."}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=48, stream=True,
                                            response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.startswith("{") and "\n\n" not in text


def test_structured_outputs_extra_body(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=8,
                                       extra_body={"structured_outputs": {"choice": ["Paris", "London"]}})
    assert r.choices[0].message.content == "Paris"
    r = client.completions.create(model=MODEL, prompt="My phone number is ", temperature=0, max_tokens=16,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="A person as JSON: ", temperature=0, max_tokens=40,
                                  extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.completions.create(model=MODEL, prompt="Answer yes or no: is fire hot?", temperature=0, max_tokens=4,
                                  extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no")


def test_bad_schema_is_a_400_and_the_server_keeps_serving(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=FRANCE, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert "JSON schema does not compile" in str(e.value)
    status, body = post(server.url + "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4,
                                                         "structured_outputs": {"regex": "a", "choice": ["b"]}})[:2]
    assert status == 400 and body["error"]["param"] == "structured_outputs" and body["error"]["code"] == 400
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8, response_format={"type": "xml"})
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=8)
    assert "Paris" in r.choices[0].message.content
