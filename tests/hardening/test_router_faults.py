"""Router backends failing in the middle of a fusion panel (issue 29), in real processes: a
`shardserve serve` member SIGKILLed while it generates, a backend process that dies after the request
reached it, one that accepts and never answers, and a judge that dies while streaming the synthesis.
Each is handled per `on_error` (skip: the judge works from the answers that came; fail: a 502 naming
the member) within the round timeout, and the router keeps serving."""
from __future__ import annotations

import json
import threading
import time

import pytest
import yaml

from tests.hardening.fault_backend import FaultBackend
from tests.router.fake_backends import start_fake
from tests.server.server_process import ServerProcess, free_port, get, post
from tests.tiny_models import make_tiny_checkpoint

KEY = {"Authorization": "Bearer rkey"}
ROUND_S = 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router_faults")
    ckpt = make_tiny_checkpoint(str(tmp / "ckpt"), "llama")
    servers = {name: ServerProcess([ckpt, "--kv-cache-memory", "16MiB", "--served-model-name", name],
                                   str(tmp / f"{name}.log")) for name in ("tiny-a", "tiny-b")}
    judge = start_fake("scripted")
    faults = {mode: FaultBackend(mode, free_port()) for mode in ("die", "die-mid-stream", "silent")}
    for f in faults.values():
        f.start()

    def backend(bid, url, **kw):
        return {"id": bid, "type": "vllm", "base_url": url, "model": bid, **kw}

    def panel(did, members, on_error, judge="judge", **kw):
        return {"id": did, "algorithm": {"type": "fusion", "analysis_models": members, "judge_model": judge,
                                         "on_error": on_error, **kw},
                "signals": [{"type": "keyword", "keywords": [did]}]}

    config = {"router": {
        "backends": [backend("tiny-a", servers["tiny-a"].url + "/v1", type="shardserve"),
                     backend("tiny-b", servers["tiny-b"].url + "/v1", type="shardserve"),
                     backend("judge", judge[1]), backend("dier", faults["die"].url),
                     backend("dying-judge", faults["die-mid-stream"].url),
                     backend("silent", faults["silent"].url, timeout_s=30)],
        "decisions": [
            panel("killskip", ["tiny-a", "tiny-b"], "skip",
                  analysis_overrides={"tiny-b": {"max_tokens": 900, "ignore_eos": True}}),
            panel("diefail", ["tiny-a", "dier"], "fail"),
            panel("dieskip", ["tiny-a", "dier"], "skip"),
            panel("stallskip", ["tiny-a", "silent"], "skip", round_timeout_seconds=ROUND_S),
            panel("stallfail", ["tiny-a", "silent"], "fail", round_timeout_seconds=ROUND_S),
            panel("judgedies", ["tiny-a"], "skip", judge="dying-judge")],
        "default_model": "tiny-a"}}
    path = tmp / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    router = ServerProcess(["--config", str(path), "--api-key", "rkey"], str(tmp / "router.log"), command="router")
    yield router, servers, judge[0].RequestHandlerClass, faults
    router.stop()
    for srv in servers.values():
        srv.stop()
    for f in faults.values():
        f.stop()
    judge[0].shutdown()


def ask(router: ServerProcess, decision: str, **kw) -> tuple[int, dict, float]:
    start = time.monotonic()
    status, body, _ = post(router.url + "/v1/chat/completions", {
        "model": "vllm-sr/auto", "messages": [{"role": "user", "content": f"please {decision} now"}],
        "max_tokens": 8, "temperature": 0, **kw}, headers=KEY, timeout=60)
    return status, body, time.monotonic() - start


def _still_serving(router: ServerProcess) -> None:
    assert get(router.url + "/health")[0] == 200
    status, body, _ = post(router.url + "/v1/chat/completions", {
        "model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, headers=KEY)
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body


def _synthesised_from(judge, answers: int) -> None:
    """The judge's analysis prompt holds exactly this many panel answers."""
    prompt = judge.seen[-2]["body"]["messages"][0]["content"]
    assert prompt.count("[Answer ") == answers, prompt


def test_member_killed_while_generating_is_skipped(cluster):
    router, servers, judge, _ = cluster
    victim = servers["tiny-b"]
    result: list = []
    thread = threading.Thread(target=lambda: result.append(ask(router, "killskip")))
    thread.start()
    deadline = time.monotonic() + 20
    while victim.metrics()["vllm:num_requests_running"] < 1:   # the member is generating its answer
        assert time.monotonic() < deadline, f"the panel request never reached tiny-b: {result}"
        time.sleep(0.05)
    victim.proc.kill()
    thread.join(30)
    assert not thread.is_alive(), "the router hung on a killed member"
    status, body, _ = result[0]
    assert status == 200, body
    trace = body["fusion_trace"]
    assert trace["failed_models"] == ["tiny-b"] and trace["panel_results"][0]["error"] is None
    assert "tiny-b" not in (trace["panel_results"][1]["content"] or "") and trace["panel_results"][1]["error"]
    _synthesised_from(judge, 1)
    _still_serving(router)


def test_member_dying_after_the_request_reached_it(cluster):
    router, _, judge, faults = cluster
    dier = faults["die"]
    status, body, seconds = ask(router, "diefail")
    assert status == 502 and seconds < 10, body
    message = body["error"]["message"]
    assert "'dier'" in message and "on_error: fail" in message, message
    assert dier.wait_dead() == -9   # it really died mid-request
    dier.start()
    status, body, _ = ask(router, "dieskip")
    assert status == 200, body
    assert body["fusion_trace"]["failed_models"] == ["dier"]
    _synthesised_from(judge, 1)
    dier.wait_dead()
    _still_serving(router)


def test_stalled_member_ends_with_the_round(cluster):
    router, _, judge, _ = cluster
    status, body, seconds = ask(router, "stallskip")
    assert status == 200 and seconds < ROUND_S + 3, (status, seconds, body)
    result = body["fusion_trace"]["panel_results"][1]
    assert result["id"] == "silent" and "round_timeout_seconds" in result["error"]
    _synthesised_from(judge, 1)
    status, body, seconds = ask(router, "stallfail")
    assert status == 502 and seconds < ROUND_S + 3, (status, seconds, body)
    message = body["error"]["message"]
    assert "'silent'" in message and "round_timeout_seconds" in message and "on_error: fail" in message, message
    _still_serving(router)


def test_judge_dying_mid_stream_ends_the_stream_with_an_error(cluster):
    router, _, _, faults = cluster
    status, raw, _ = post(router.url + "/v1/chat/completions", {
        "model": "vllm-sr/auto", "messages": [{"role": "user", "content": "please judgedies now"}],
        "max_tokens": 8, "stream": True}, headers=KEY, timeout=30)
    assert status == 200
    events = [e[len("data: "):] for e in raw.decode().split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert text == "Half an"   # what came before the judge died reached the client
    error = chunks[-1]["error"]
    assert error["code"] == 502 and "dying-judge" in error["message"], error
    assert faults["die-mid-stream"].wait_dead() == -9
    # The same backend named directly (a pass-through stream) dies the same way.
    faults["die-mid-stream"].start()
    status, raw, _ = post(router.url + "/v1/chat/completions", {
        "model": "dying-judge", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        headers=KEY, timeout=30)
    events = [e[len("data: "):] for e in raw.decode().split("\n\n") if e.strip()]
    assert status == 200 and events[-1] == "[DONE]" and len(events) == 4, events
    assert json.loads(events[-2])["error"]["message"].startswith("dying-judge: the stream ended"), events
    faults["die-mid-stream"].wait_dead()
    _still_serving(router)
