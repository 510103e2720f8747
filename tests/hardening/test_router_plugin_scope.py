"""The router's fusion plugin (a request field) can only pick backends from the router's config: an id,
URL or override naming anything else never causes a call to it (issue 29)."""
from __future__ import annotations

import pytest
import yaml

from tests.router.fake_backends import start_fake
from tests.server.server_process import ServerProcess, post


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plugin_scope")
    fakes = {name: start_fake("scripted") for name in ("member", "judge", "decoy")}
    config = {"router": {"backends": [
        {"id": "member", "type": "vllm", "base_url": fakes["member"][1], "model": "member"},
        {"id": "judge", "type": "vllm", "base_url": fakes["judge"][1], "model": "judge"}],
        "decisions": [], "default_model": "member"}}
    path = tmp / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    router = ServerProcess(["--config", str(path)], str(tmp / "router.log"), command="router")
    yield router, {name: server.RequestHandlerClass for name, (server, _) in fakes.items()}, fakes["decoy"][1]
    router.stop()
    for server, _ in fakes.values():
        server.shutdown()


def test_plugin_overrides_never_reach_a_backend_outside_the_config(setup):
    router, handlers, decoy_url = setup
    attempts = [
        {"analysis_models": ["member", decoy_url], "judge_model": "judge"},
        {"analysis_models": ["member"], "judge_model": decoy_url},
        {"analysis_models": ["decoy"], "judge_model": "judge"},
        {"analysis_models": ["member"], "judge_model": "judge", "base_url": decoy_url,
         "analysis_overrides": {"member": {"base_url": decoy_url, "model": "decoy"}},
         "backends": [{"id": "decoy", "base_url": decoy_url}]},
    ]
    statuses = []
    for plugin in attempts:
        status, body, _ = post(router.url + "/v1/chat/completions", {
            "model": "vllm-sr/auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "plugins": [{"id": "fusion", **plugin}]})
        statuses.append(status)
        if status != 200:
            assert status == 400 and body["error"]["param"] == "plugins", body
    assert statuses == [400, 400, 400, 200]
    assert handlers["decoy"].seen == []
    # the accepted one called only configured backends, with their configured model names
    assert {c["body"]["model"] for c in handlers["member"].seen} == {"member"}
    assert {c["body"]["model"] for c in handlers["judge"].seen} == {"judge"}
    assert all("plugins" not in c["body"] for h in handlers.values() for c in h.seen)
