"""The real server (uvicorn, the embedded SmolLM2) through the official `openai` client: answers,
streaming, usage, stop strings, n, logprobs, concurrency, metrics, disconnects, bad input."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import openai
import pytest

from tests.server.server_process import get, post, request, server_fixture

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


server = server_fixture("--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--max-num-seqs", "40")


def count_tokens(server, text: str) -> int:
    return post(server.url + "/tokenize", {"prompt": text, "add_special_tokens": False})[1]["count"]


def test_chat_answers_paris_with_exact_usage(server, client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24, logprobs=True)
    choice = r.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop" and r.object == "chat.completion" and r.model == MODEL
    prompt_ids = post(server.url + "/tokenize", {"messages": FRANCE})[1]["tokens"]
    assert r.usage.prompt_tokens == len(prompt_ids)
    # One logprob entry per generated token (the EOS that stopped it included, as OpenAI counts).
    assert r.usage.completion_tokens == len(choice.logprobs.content)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    comp = dict(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=12)
    whole = client.completions.create(**comp)
    parts = list(client.completions.create(**comp, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"


def test_stop_strings_and_max_completion_tokens(server, client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24, stop=["Paris"])
    assert r.choices[0].finish_reason == "stop" and "Paris" not in r.choices[0].message.content
    assert r.choices[0].message.content.rstrip().endswith("is")
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_n_seed_and_sampling_fields(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2, seed=7,
                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]   # seeded: reproducible
    assert a.usage.completion_tokens == 16


def test_logprobs_shapes(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) >= 3 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    assert content[0].token == content[0].top_logprobs[0].token   # greedy picks the top token


def test_32_concurrent_streams_complete_with_the_right_text(server):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]

    async def run():
        aclient = server.client(asynchronous=True)

        async def whole(p):
            r = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0)
            return r.choices[0].text

        async def streamed(p):
            text = ""
            async for chunk in await aclient.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0,
                                                               stream=True):
                text += chunk.choices[0].text
            return text

        expected = await asyncio.gather(*(whole(p) for p in prompts))
        got = await asyncio.gather(*(streamed(p) for p in prompts))
        await aclient.close()
        return expected, got

    expected, got = asyncio.run(run())
    assert got == expected   # batch invariance makes greedy text independent of batch-mates
    assert len(set(expected)) > 1
    server.wait_idle()


def test_metrics_move(server, client):
    before = server.metrics()
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = server.wait_idle()
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 10
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 2 * count_tokens(
        server, "Hello there")
    assert after['vllm:request_success_total{finished_reason="length"}'] - before.get(
        'vllm:request_success_total{finished_reason="length"}', 0) == 2
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert after[f"vllm:{name}_count"] - before[f"vllm:{name}_count"] == 2, name
    assert after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"] == 8


def _open_stream(server, body: dict) -> socket.socket:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def test_client_disconnect_aborts_and_frees_blocks(server):
    before = server.metrics().get('vllm:request_success_total{finished_reason="abort"}', 0)
    long = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 900, "ignore_eos": True}
    conn = _open_stream(server, {**long, "stream": True})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    conn = _open_stream(server, long)   # not streaming: the server notices while it waits
    time.sleep(1.0)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    server.wait_idle(timeout_s=30)
    deadline = time.monotonic() + 10
    while server.metrics().get('vllm:request_success_total{finished_reason="abort"}', 0) < before + 2:
        assert time.monotonic() < deadline, "aborted requests were not recorded"
        time.sleep(0.1)


def test_cors_allows_every_origin_by_default(server):
    """vLLM's default CORS: any origin, method and header (a browser app may call the API)."""
    status, _, headers = request("OPTIONS", server.url + "/v1/completions", timeout=10,
                                 headers={"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"})
    assert status == 200 and headers["access-control-allow-origin"] == "*"


def test_request_id_is_echoed(server):
    status, _, headers = post(server.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 1},
                              headers={"X-Request-Id": "trace-123"})
    assert status == 200 and headers["x-request-id"] == "trace-123"
    assert '"request_id": "trace-123"' in server.read_log()
    assert get(server.url + "/v1/models")[2]["x-request-id"]   # generated when absent


def test_models_tokenizer_and_probe_routes(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    ids = post(server.url + "/tokenize", {"prompt": "Hello world"})[1]["tokens"]
    assert post(server.url + "/detokenize", {"tokens": ids})[1]["prompt"].endswith("Hello world")
    assert json.loads(get(server.url + "/version")[1])["version"]
    assert get(server.url + "/ping")[0] == 200 and get(server.url + "/health")[0] == 200


BAD_REQUESTS = [
    # (path, body or raw bytes, status, text in message, param)
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON", None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "role", "messages.0.role"),
    ("/v1/chat/completions", {"messages": FRANCE, "temperature": -1}, 400, "temperature", "temperature"),
    ("/v1/chat/completions", {"messages": FRANCE, "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 5000}, 400, "1024", "max_tokens"),
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("/v1/chat/completions", {"messages": FRANCE, "n": "two"}, 400, "n", "n"),
    ("/v1/chat/completions", {"messages": FRANCE, "logprobs": True, "top_logprobs": 500}, 400, "logprobs", None),
    ("/v1/chat/completions", {"model": "gpt-nope", "messages": FRANCE}, 404, "gpt-nope", "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [99999999]]}, 400, "vocabulary", None),
    ("/v1/completions", {"prompt": "x " * 2000, "max_tokens": 10}, 400, "maximum context length", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids", None),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens", "min_tokens"),
    ("/v1/completions", [1, 2, 3], 400, "JSON object", None),
    ("/v1/chat/completions", {"messages": FRANCE, "priority": 1}, 400, "--scheduling-policy priority", "priority"),
    ("/v1/completions", {"prompt": "hi", "priority": -1}, 400, "--scheduling-policy priority", "priority"),
]


@pytest.mark.parametrize("path,body,status,text,param", BAD_REQUESTS)
def test_bad_input_gets_a_clear_openai_error(server, path, body, status, text, param):
    if isinstance(body, bytes):
        got, data, _ = post(server.url + path, raw=body)
    else:
        got, data, _ = post(server.url + path, body)
    assert got == status, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert text in err["message"]
    if param is not None:
        assert err["param"] == param


def test_after_bad_requests_nothing_leaks_and_the_server_still_answers(server, client):
    for path, body, *_ in BAD_REQUESTS:
        post(server.url + path, raw=body) if isinstance(body, bytes) else post(server.url + path, body)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=-2)
    server.wait_idle()
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content


def test_chat_template_kwargs_reach_the_template(client):
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}assistant:")

    def prompt_tokens(**extra):
        r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=1,
                                           extra_body={"chat_template": template, **extra})
        return r.usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > plain
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain


def test_lone_surrogate_is_a_400_and_the_server_keeps_serving(server):
    text = "hi \ud800 there"   # json.dumps writes it as the escape \ud800, as a client would send it
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
                       ("/v1/completions", {"prompt": text})):
        status, data, _ = post(server.url + path, {"model": MODEL, "max_tokens": 4, **body})
        assert status == 400, data
        assert "surrogate" in data["error"]["message"]
    status, data, _ = post(server.url + "/v1/completions", {"model": MODEL, "prompt": "hi \U0001F600", "max_tokens": 2})
    assert status == 200, data


def test_logit_bias_steers_and_bad_ids_are_refused(server):
    client = server.client()
    token = 35   # any id: +100 makes it every greedy pick, -100 keeps it out
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                                  logit_bias={str(token): 100})
    status, expected, _ = post(server.url + "/detokenize", {"model": MODEL, "tokens": [token] * 5})
    assert status == 200 and r.choices[0].text == expected["prompt"]
    banned = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                                       logit_bias={str(t): -100 for t in range(0, 49152, 2)})
    assert banned.choices[0].text   # still answers, from odd ids only
    for bias, why in (({"49152": 5}, "outside the vocabulary"), ({"7": 101}, "[-100, 100]"),
                      ({"seven": 1}, "token ids")):
        status, data, _ = post(server.url + "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                                 "logit_bias": bias})
        assert status == 400 and why in data["error"]["message"] and data["error"]["param"] == "logit_bias", data


def test_sagemaker_invocations_route_by_body(server):
    """/invocations (vLLM's SageMaker route): messages make a chat completion, a prompt a completion."""
    status, chat, _ = post(server.url + "/invocations", {"messages": FRANCE, "max_tokens": 16, "temperature": 0})
    assert status == 200 and chat["object"] == "chat.completion" and "Paris" in chat["choices"][0]["message"]["content"]
    status, text, _ = post(server.url + "/invocations", {"prompt": "The capital of France is", "max_tokens": 2})
    assert status == 200 and text["object"] == "text_completion" and text["usage"]["completion_tokens"] == 2
    status, err, _ = post(server.url + "/invocations", {"input": "hi"})
    assert status == 400 and "messages" in err["error"]["message"]
    assert post(server.url + "/invocations", raw=b"[1]")[0] == 400
    server.wait_idle()
