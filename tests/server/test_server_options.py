"""Server options, on one real server: sampling defaults a request leaves unset (the model's
generation_config.json, vLLM's --override-generation-config over it), --enable-prompt-tokens-details
(the prefix cache's share of the prompt in usage), --return-tokens-as-token-ids (and the request field
over it), --disable-fastapi-docs, --root-path, and a second --served-model-name (an alias)."""
from __future__ import annotations

import json

import openai
import pytest

from shardserve.server.run import generation_defaults, parse_generation_override
from tests.server.server_process import get, post, server_fixture

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_override_sets_and_replaces_the_models_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "bos_token_id": 1}))
    assert generation_defaults("auto", str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9}
    override = parse_generation_override('{"temperature": 0.2, "top_k": 5}')
    assert generation_defaults("auto", str(tmp_path), override) == {"temperature": 0.2, "top_p": 0.9, "top_k": 5}
    assert generation_defaults("vllm", str(tmp_path), override) == {"temperature": 0.2, "top_k": 5}
    assert generation_defaults("auto", str(tmp_path / "none"), override) == override   # no file: the override alone
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(str(tmp_path / "none"), str(tmp_path))


@pytest.mark.parametrize("value,message", [("{temperature: 0}", "not valid JSON"), ("[0.5]", "JSON object"),
                                           ('{"max_new_tokens": 9, "seed": 1}', "max_new_tokens, seed cannot")])
def test_bad_override_is_refused_naming_the_problem(value, message):
    with pytest.raises(ValueError, match=message):
        parse_generation_override(value)


server = server_fixture("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--generation-config", "vllm",
                        "--override-generation-config", '{"temperature": 0}', "--enable-prompt-tokens-details",
                        "--disable-fastapi-docs", "--root-path", "/llm", "--return-tokens-as-token-ids",
                        "--served-model-name", MODEL, "smol")


def test_requests_without_a_temperature_take_the_override(client):
    prompt = "Write a short story about a cat who learns to fly."
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0).choices[0].text
    for _ in range(3):   # sampled at temperature 1 these would differ from the greedy text
        assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=32).choices[0].text == greedy
    sampled = {client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=1.5, seed=s)
               .choices[0].text for s in range(3)}
    assert sampled != {greedy}   # a request's own temperature still wins


def test_usage_reports_the_cached_prompt_tokens(client):
    messages = [{"role": "user", "content": "List three rivers of France and one fact about each of them."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # whole 16-token blocks of the same prompt come from the prefix cache (its last token is recomputed)
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 16 * 16 > 0
    stream = client.completions.create(model=MODEL, prompt="List three rivers of France.", max_tokens=4, stream=True,
                                       stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens >= 0 and usage.completion_tokens == 4


def test_no_docs_and_the_routes_under_the_root_path_too(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert get(server.url + path)[0] == 404, path
    assert get(server.url + "/v1/models")[0] == get(server.url + "/llm/v1/models")[0] == 200


def test_logprobs_name_tokens_by_id(server, client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, logprobs=True, top_logprobs=2)
    entries = r.choices[0].logprobs.content
    ids = [int(e.token.removeprefix("token_id:")) for e in entries]
    assert all(e.token.startswith("token_id:") for e in entries)
    assert all(t.token.startswith("token_id:") for e in entries for t in e.top_logprobs)
    detok = post(server.url + "/detokenize", {"tokens": ids})[1]["prompt"]
    assert detok.startswith(r.choices[0].message.content)   # the ids are the answer's tokens
    text = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, logprobs=True,
                                          extra_body={"return_tokens_as_token_ids": False})
    assert "".join(e.token for e in text.choices[0].logprobs.content) == detok   # the request's own choice
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, logprobs=1, echo=True)
    assert all(t.startswith("token_id:") for t in c.choices[0].logprobs.tokens)
    assert all(k.startswith("token_id:") for top in c.choices[0].logprobs.top_logprobs[1:] for k in top)


def test_a_second_served_model_name_is_an_alias(client):
    assert [m.id for m in client.models.list().data] == [MODEL, "smol"]
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.model == "smol"   # the name asked for
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).model == MODEL
    assert client.responses.create(model="smol", input="Hi", max_output_tokens=2).model == "smol"
    with pytest.raises(openai.NotFoundError, match="smol"):
        client.completions.create(model="other", prompt="Hi", max_tokens=2)


def test_cache_salt_keeps_tenants_apart(server, client):
    """vLLM's cache_salt: a request reuses cached prompt blocks only of requests with its salt."""
    messages = [{"role": "user", "content": "Name the four largest cities of France, in order of size."}]

    def cached(salt: str | None) -> tuple[int, int]:
        extra = {"cache_salt": salt} if salt is not None else {}
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens, (r.usage.prompt_tokens - 1) // 16 * 16

    cached(None)
    hit, whole = cached(None)
    assert hit == whole > 0            # unsalted: every whole block of the prompt from the first
    assert cached("tenant-a")[0] == 0  # another tenant: not even the chat template's shared preamble
    assert cached("tenant-a")[0] == whole and cached("tenant-b")[0] == 0
    status, body, _ = post(server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 1, "cache_salt": ""})
    assert status == 400 and body["error"]["param"] == "cache_salt"
