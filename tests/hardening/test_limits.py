"""Limits and hygiene on a live server (issue 29): body size (413), prompt and stop-list caps (400),
API keys in constant time, no prompt or key in the logs unless asked. Runs once (not per CPU path)."""
from __future__ import annotations

import http.client
import json

import pytest

from shardserve.server.protocol import MAX_PROMPTS, MAX_STOP, MAX_STOP_CHARS
from tests.server.server_process import ServerProcess, post

KEY = "sk-secret-key-29"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    srv = ServerProcess(["--kv-cache-memory", "64MiB", "--max-model-len", "256", "--api-key", KEY,
                         "--max-request-body-bytes", str(LIMIT)], str(tmp / "server.log"))
    yield srv
    srv.stop()


def chat(server, **body):
    return post(server.url + "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body}, headers=AUTH)


def test_body_over_the_limit_is_413_with_or_without_content_length(server):
    status, body, _ = chat(server, padding="x" * (LIMIT + 10))
    assert status == 413 and body["error"]["code"] == 413 and "--max-request-body-bytes" in body["error"]["message"]
    # chunked: no Content-Length, the limit is counted as the body arrives
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    payload = json.dumps({"messages": [{"role": "user", "content": "y" * (2 * LIMIT)}]}).encode()
    conn.request("POST", "/v1/chat/completions", body=iter([payload[i:i + 8192] for i in range(0, len(payload), 8192)]),
                 headers={**AUTH, "Content-Type": "application/json"}, encode_chunked=True)
    r = conn.getresponse()
    assert r.status == 413 and json.loads(r.read())["error"]["type"] == "RequestTooLarge"
    # under the limit, chunked: served as usual
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    small = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    conn.request("POST", "/v1/chat/completions", body=iter([small[:10], small[10:]]),
                 headers={**AUTH, "Content-Type": "application/json"}, encode_chunked=True)
    assert conn.getresponse().status == 200


def test_prompt_and_stop_caps_are_400s_naming_the_field(server):
    status, body, _ = post(server.url + "/v1/completions", {"prompt": "z" * 60000, "max_tokens": 1}, headers=AUTH)
    assert status == 400 and body["error"]["param"] == "prompt" and "characters" in body["error"]["message"]
    status, body, _ = post(server.url + "/v1/completions", {"prompt": ["a"] * (MAX_PROMPTS + 1), "max_tokens": 1},
                           headers=AUTH)
    assert status == 400 and body["error"]["param"].startswith("prompt")
    status, body, _ = chat(server, stop=[str(i) for i in range(MAX_STOP + 1)])
    assert status == 400 and body["error"]["param"].startswith("stop")
    status, body, _ = chat(server, stop="s" * (MAX_STOP_CHARS + 1))
    assert status == 400 and body["error"]["param"].startswith("stop")
    status, body, _ = chat(server, stop_token_ids=list(range(MAX_STOP + 1)))
    assert status == 400 and body["error"]["param"] == "stop_token_ids"
    assert chat(server, stop=[str(i) for i in range(MAX_STOP)])[0] == 200


def test_api_key_checked_and_never_logged_nor_the_prompt(server):
    assert chat(server)[0] == 200
    for wrong in ("Bearer sk-secret-key-2", "Bearer " + KEY + "x", "", KEY):
        status, body, _ = post(server.url + "/v1/chat/completions", {"messages": []},
                               headers={"Authorization": wrong} if wrong else {})
        assert status == 401 and body["error"]["type"] == "AuthenticationError"
    marker = "a-very-private-prompt-29"
    assert chat(server, messages=[{"role": "user", "content": marker}])[0] == 200
    server.wait_idle()
    log = server.read_log()
    assert '"event": "request_finished"' in log
    assert marker not in log and KEY not in log
    assert '"prompt": null' in log
