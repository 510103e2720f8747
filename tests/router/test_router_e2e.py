"""The router as users run it (`shardserve router`, a real process) in front of real backends: two
`shardserve serve` processes with tiny models, a scripted judge, and endpoints that refuse
connections, answer 500, stall past the timeout and send invalid JSON. Driven with the official
`openai` client."""
from __future__ import annotations

import time

import openai
import pytest
import yaml

from tests.router.fake_backends import start_fake
from tests.server.server_process import ServerProcess, free_port, get, post
from tests.tiny_models import make_tiny_checkpoint

Q = [{"role": "user", "content": "Compare tensor parallelism and pipeline parallelism for a 70B model."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    ckpt = make_tiny_checkpoint(str(tmp / "ckpt"), "llama")
    servers = {name: ServerProcess([ckpt, "--kv-cache-memory", "16MiB", "--served-model-name", name],
                                   str(tmp / f"{name}.log")) for name in ("tiny-a", "tiny-b")}
    fakes = {kind: start_fake(kind) for kind in ("scripted", "error500", "stall", "garbage")}
    closed = f"http://127.0.0.1:{free_port()}/v1"

    def backend(bid, url, model=None, **kw):
        return {"id": bid, "type": "vllm", "base_url": url, "model": model or bid, **kw}

    def panel(did, members, judge="judge", words=(), **kw):
        return {"id": did, "algorithm": {"type": "fusion", "analysis_models": members, "judge_model": judge, **kw},
                "signals": [{"type": "keyword", "keywords": list(words)}]}

    config = {"router": {
        "backends": [backend("tiny-a", servers["tiny-a"].url + "/v1", type="shardserve"),
                     backend("tiny-b", servers["tiny-b"].url + "/v1", type="shardserve"),
                     backend("judge", fakes["scripted"][1]), backend("refuse", closed),
                     backend("err500", fakes["error500"][1]), backend("stall", fakes["stall"][1], timeout_s=1.5),
                     backend("garbage", fakes["garbage"][1]),
                     backend("flaky", closed, model="tiny-a"), backend("flaky", servers["tiny-a"].url + "/v1",
                                                                         model="tiny-a")],
        "decisions": [
            {**panel("research_fusion", ["tiny-a", "tiny-b"], words=["research", "compare"], on_error="skip"),
             "priority": 10},
            {"id": "long_context", "algorithm": {"type": "static", "model": "tiny-b"},
             "signals": [{"type": "context_length", "min_tokens": 100}]},
            panel("strict_panel", ["tiny-a", "refuse"], words=["strict"], on_error="fail"),
            panel("quorum_panel", ["tiny-a", "stall"], words=["quick"], min_successful_responses=1),
            panel("broken_panel", ["refuse", "err500", "garbage"], words=["doomed"]),
            panel("skip_panel", ["tiny-a", "refuse", "garbage"], words=["tolerant"], on_error="skip"),
            panel("stream_panel", ["tiny-a"], judge="tiny-b", words=["livestream"]),
            panel("slow_round", ["tiny-a", "stall"], words=["patient"], round_timeout_seconds=0.8,
                  analysis_overrides={"tiny-a": {"max_tokens": 3}}),
            {"id": "python_help", "algorithm": {"type": "static", "model": "tiny-b"},
             "signals": [{"type": "embedding", "threshold": 0.5,
                          "candidates": ["How do I fix this Python exception?", "My code throws a TypeError"]}]},
        ],
        "default_model": "tiny-a"}}
    path = tmp / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    router = ServerProcess(["--config", str(path), "--api-key", "rkey"], str(tmp / "router.log"), command="router")
    yield router, fakes
    router.stop()
    for srv in servers.values():
        srv.stop()
    for server, _ in fakes.values():
        server.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    return cluster[0].client(api_key="rkey")


def ask(client, text: str, model: str = "vllm-sr/auto", **kw):
    return client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=12, temperature=0, **kw)


def test_single_model_routes_and_headers(cluster, client):
    raw = ask(client, "hello there")   # no decision matches: the default model
    assert raw.headers["x-vsr-selected-model"] == "tiny-a"
    assert raw.headers["x-vsr-selected-decision"] == "default"
    assert raw.headers["x-vsr-selected-algorithm"] == "static"
    assert raw.parse().usage.completion_tokens == 12
    raw = ask(client, "hello " * 80)   # ~120 estimated tokens
    assert (raw.headers["x-vsr-selected-model"], raw.headers["x-vsr-selected-decision"]) == ("tiny-b", "long_context")
    raw = ask(client, "hello", model="tiny-b")   # a backend id: pass-through
    assert raw.headers["x-vsr-selected-model"] == "tiny-b" and raw.parse().model == "tiny-b"
    chunks = list(client.chat.completions.create(model="tiny-a", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, stream=True, temperature=0))
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2


def test_embedding_routing_in_the_router(client):
    raw = ask(client, "Why does my Python program raise a KeyError?")
    assert (raw.headers["x-vsr-selected-decision"], raw.headers["x-vsr-selected-model"]) == ("python_help", "tiny-b")
    assert ask(client, "A good recipe for banana bread?").headers["x-vsr-selected-decision"] == "default"


def test_round_timeout_and_analysis_overrides(client):
    start = time.monotonic()
    trace = ask(client, "be patient").parse().model_extra["fusion_trace"]
    assert time.monotonic() - start < 1.4   # the round ended at 0.8 s, before the 1.5 s call timeout
    assert trace["panel_results"][1]["error"].startswith("no answer within round_timeout_seconds=0.8")
    assert trace["panel_results"][0]["usage"]["completion_tokens"] <= 3   # per-member override


def test_unknown_model_fusion_without_match_and_auth(cluster, client):
    with pytest.raises(openai.NotFoundError) as e:
        ask(client, "hi", model="gpt-9")
    assert "vllm-sr/auto" in str(e.value) and "tiny-a" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "hello there", model="vllm-sr/fusion")
    assert "no fusion decision matched" in str(e.value)
    with pytest.raises(openai.AuthenticationError):
        cluster[0].client(api_key="wrong").models.list()
    ids = [m.id for m in client.models.list().data]
    assert ids[:2] == ["vllm-sr/auto", "vllm-sr/fusion"] and "tiny-b" in ids
    assert get(cluster[0].url + "/health")[0] == 200


def test_seed_style_fusion_query_with_plugin_trace_and_usage(client):
    raw = client.chat.completions.with_raw_response.create(
        model="vllm-sr/fusion", messages=Q, max_tokens=12, temperature=0,
        extra_body={"plugins": [{"id": "fusion", "analysis_models": ["tiny-a", "tiny-b"], "judge_model": "judge"}]})
    response = raw.parse()
    assert raw.headers["x-vsr-selected-algorithm"] == "fusion" and raw.headers["x-vsr-selected-model"] == "judge"
    trace = response.model_extra["fusion_trace"]
    assert [m["id"] for m in trace["panel_results"]] == ["tiny-a", "tiny-b"]
    assert all(m["error"] is None and isinstance(m["content"], str) and m["latency_ms"] > 0
               for m in trace["panel_results"])
    assert trace["analysis"]["consensus"] == ["c"] and trace["failed_models"] == []
    panel = [m["usage"] for m in trace["panel_results"]]
    # usage sums every call: the two panel answers, the judge's analysis and its synthesis
    assert response.usage.completion_tokens == sum(u["completion_tokens"] for u in panel) + 2 * 5
    assert response.usage.prompt_tokens == sum(u["prompt_tokens"] for u in panel) + 2 * 10
    assert response.choices[0].message.content == '{"consensus": ["c"], "contradictions": [], ' \
        '"unique_insights": [], "blind_spots": []}'   # the scripted judge's answer


def test_keyword_decision_runs_the_panel_and_strips_tools(cluster, client):
    fake = cluster[1]["scripted"][0].RequestHandlerClass
    fake.seen.clear()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    raw = ask(client, "Please research this topic", tools=tools)
    assert raw.headers["x-vsr-selected-decision"] == "research_fusion"
    analysis_call, final_call = fake.seen[-2]["body"], fake.seen[-1]["body"]
    assert "tools" not in analysis_call and final_call["tools"] == tools   # tools only on the final call
    assert fake.seen[-1]["headers"]["x-vsr-fusion-depth"] == "1"
    assert final_call["messages"][-1]["content"] == "Please research this topic"


def test_skip_fail_quorum_timeouts_and_all_fail(client):
    tolerant = ask(client, "be tolerant").parse().model_extra["fusion_trace"]
    assert tolerant["failed_models"] == ["refuse", "garbage"]
    errors = {m["id"]: m["error"] for m in tolerant["panel_results"]}
    assert "cannot connect" in errors["refuse"] and "invalid response" in errors["garbage"]
    with pytest.raises(openai.APIStatusError) as e:
        ask(client, "be strict")
    assert e.value.status_code == 502 and "on_error: fail" in str(e.value)
    start = time.monotonic()
    quick = ask(client, "quick answer please").parse().model_extra["fusion_trace"]
    assert time.monotonic() - start < 1.5   # did not wait for the staller: the quorum of 1 was met
    assert quick["panel_results"][1]["error"].startswith("cancelled")
    with pytest.raises(openai.APIStatusError) as e:
        ask(client, "doomed request")
    assert e.value.status_code == 502
    for member in ("refuse", "err500", "garbage"):
        assert member in str(e.value)
    with pytest.raises(openai.APIStatusError) as e:   # a single stalling backend times out
        ask(client, "hi", model="stall")
    assert e.value.status_code == 502 and "timed out after 1.5 s" in str(e.value)


def test_streaming_synthesis_arrives_as_it_is_generated(client):
    stream = client.chat.completions.create(
        model="vllm-sr/auto", messages=[{"role": "user", "content": "research streaming"}], max_tokens=12,
        stream=True, stream_options={"include_usage": True})
    arrivals, text, chunks = [], "", []
    for chunk in stream:
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
            text += chunk.choices[0].delta.content
    assert text == "Final answer in five words"
    # The scripted judge spaces its 5 chunks 0.2 s apart: the first reached us ~0.8 s before the last.
    assert arrivals[-1] - arrivals[0] > 0.6
    assert "fusion_trace" in chunks[0].model_extra
    assert chunks[-1].usage.completion_tokens >= 2 * 5 and chunks[-1].choices == []
    live = list(client.chat.completions.create(model="vllm-sr/auto", messages=[
        {"role": "user", "content": "livestream it"}], max_tokens=20, stream=True))
    assert len([c for c in live if c.choices and c.choices[0].delta.content]) > 2   # a real shardserve judge


def test_recursion_guard_and_endpoint_retry(cluster, client):
    status, body, _ = post(cluster[0].url + "/v1/chat/completions",
                           {"model": "vllm-sr/auto", "messages": Q, "max_tokens": 4},
                           headers={"Authorization": "Bearer rkey", "x-vsr-fusion-depth": "1"})
    assert status == 400 and "cannot start another panel" in body["error"]["message"]
    for _ in range(6):   # one endpoint refuses connections: every call still lands on the other
        assert ask(client, "hi", model="flaky").parse().usage.completion_tokens == 12


def test_router_metrics(cluster, client):
    ask(client, "hello there")
    _, body, _ = get(cluster[0].url + "/metrics")
    text = body.decode()
    assert 'router_requests_total{algorithm="static",decision="default"}' in text
    assert 'router_panel_member_failures_total{backend="refuse"}' in text
    assert "router_backend_latency_seconds_bucket" in text and "router_fusion_latency_seconds_count" in text


def test_pass_through_errors(client):
    with pytest.raises(openai.APIStatusError) as e:
        ask(client, "hi", model="garbage")
    assert e.value.status_code == 502 and "not JSON" in str(e.value)
    with pytest.raises(openai.APIStatusError) as e:
        ask(client, "hi", model="err500")
    assert e.value.status_code == 502 and "HTTP 500" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:   # a backend's 4xx comes back as it was
        client.chat.completions.create(model="tiny-a", messages=[{"role": "user", "content": "hi"}], max_tokens=5000)
    assert "maximum context length" in str(e.value)


def test_legacy_completions_are_routed(client):
    raw = client.completions.with_raw_response.create(model="tiny-b", prompt="Hello", max_tokens=4, temperature=0)
    assert raw.headers["x-vsr-selected-model"] == "tiny-b" and raw.parse().usage.completion_tokens == 4
    raw = client.completions.with_raw_response.create(model="vllm-sr/auto", prompt="hello " * 80, max_tokens=3)
    assert (raw.headers["x-vsr-selected-decision"], raw.headers["x-vsr-selected-model"]) == ("long_context", "tiny-b")
    raw = client.completions.with_raw_response.create(model="vllm-sr/auto", prompt="please research", max_tokens=3)
    assert raw.headers["x-vsr-selected-decision"] == "default"   # the fusion decision is skipped
    text = "".join(c.choices[0].text for c in client.completions.create(model="tiny-a", prompt="Hi", max_tokens=5,
                                                                         stream=True, temperature=0))
    assert text == client.completions.create(model="tiny-a", prompt="Hi", max_tokens=5, temperature=0).choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="vllm-sr/fusion", prompt="hi", max_tokens=3)
    assert "/v1/chat/completions only" in str(e.value)
