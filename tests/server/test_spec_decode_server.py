"""`shardserve serve --speculative-config` with the embedded model, through the official `openai`
client: an input-grounded answer (repeating text the prompt holds) gets n-gram drafts accepted,
constrained JSON stays valid with drafts, and /metrics counts drafts under vLLM's names."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server.server_process import ServerProcess

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TEXT = ("The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly. "
        "Pack my box with five dozen liquor jugs.")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2})
    srv = ServerProcess(["--kv-cache-memory", "128MiB", "--max-model-len", "1024", "--max-num-seqs", "8",
                         "--speculative-config", spec], str(tmp_path_factory.mktemp("server") / "server.log"))
    yield srv
    srv.stop()


def test_input_grounded_answers_accept_drafts_and_are_counted(server):
    client = server.client()
    before = server.metrics()
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=60, messages=[
        {"role": "user", "content": f"Repeat this text exactly: {TEXT}"}])
    assert "lazy dog" in r.choices[0].message.content
    after = server.metrics()

    def grew(name: str) -> float:
        return after[f"vllm:spec_decode_{name}_total"] - before.get(f"vllm:spec_decode_{name}_total", 0)
    assert grew("num_drafts") > 0 and 0 < grew("num_accepted_tokens") <= grew("num_draft_tokens")
    assert grew("num_accepted_tokens") > r.usage.completion_tokens / 3   # much of the answer came from drafts
    per_pos = [after[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}'] for p in range(4)]
    assert sum(per_pos) == after["vllm:spec_decode_num_accepted_tokens_total"]
    assert per_pos == sorted(per_pos, reverse=True)   # a later position is only reached past the earlier ones

def test_constrained_json_with_drafts_is_valid_and_streams(server):
    client = server.client()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    messages = [{"role": "user", "content": 'Give JSON like {"name": "Ann", "age": 30} for Bob, 41.'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=48,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "p", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=48,
                                            stream=True, response_format={"type": "json_schema",
                                                                          "json_schema": {"name": "p",
                                                                                          "schema": schema}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
