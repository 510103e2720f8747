"""Schema fuzzing: random and half-valid request bodies for every POST route never get a 5xx, every
error has OpenAI's shape, and afterwards the server holds no KV blocks and still answers."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tests.server.server_process import ServerProcess, post
from tests.tiny_models import make_tiny_checkpoint

ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-3, 40)
           | st.floats(allow_nan=True, allow_infinity=True) | st.floats(-3, 3) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                                           "content": st.text(max_size=20) | st.none() | json_values}), max_size=3)
prompts = st.text(max_size=30) | st.lists(st.integers(-5, 400), max_size=8) | json_values


floats = st.floats(-3, 5) | st.sampled_from([0.0, 1e-30, 1e30, float("inf"), float("nan"), -0.0])
small_ints = st.integers(-2, 12) | st.sampled_from([10**9, 2**63, -(2**63)])
# Values of each field's own type most of the time, so requests get past parsing into the engine.
TYPED = {
    **{f: floats for f in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                           "repetition_penalty")},
    **{f: small_ints for f in ("n", "top_k", "seed", "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs",
                               "max_tokens", "max_completion_tokens", "best_of")},
    **{f: st.booleans() for f in ("stream", "echo", "ignore_eos", "skip_special_tokens", "add_special_tokens",
                                  "include_stop_str_in_output", "add_generation_prompt", "continue_final_message")},
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(-1, 400) | st.just(10**12), max_size=3),
    "tokens": st.lists(st.integers(-1, 400), max_size=8),
    "model": st.none() | st.text(max_size=6),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans(),
                                             "continuous_usage_stats": st.booleans()}),
    "chat_template_kwargs": st.dictionaries(st.text(max_size=6), scalars, max_size=2),
    "messages": messages,
    "prompt": prompts,
}


@st.composite
def bodies(draw, route: str):
    fields = list(ROUTES[route].model_fields)
    body = {}
    for name in ("messages", "prompt", "tokens"):
        if name in fields and draw(st.integers(0, 9)) < 8:
            body[name] = draw(TYPED[name])
    for name in draw(st.lists(st.sampled_from(fields), max_size=6, unique=True)):
        typed = TYPED.get(name)
        body[name] = draw(typed) if typed is not None and draw(st.integers(0, 9)) < 8 else draw(json_values)
    if "max_tokens" in fields and draw(st.integers(0, 9)) < 7:   # mostly short generations
        body["max_tokens"] = draw(st.integers(1, 8))
    return body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    path = make_tiny_checkpoint(str(tmp / "ckpt"), "llama")
    srv = ServerProcess([path, "--kv-cache-memory", "16MiB", "--max-model-len", "48", "--max-logprobs", "5"],
                        str(tmp / "server.log"))
    yield srv
    srv.stop()


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_random_bodies_never_get_a_5xx(server, route):
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=bodies(route))
    def check(body):
        status, data, _ = post(server.url + route, raw=json.dumps(body).encode(), timeout=60)
        assert status < 500, (body, data)
        if status >= 400:
            assert set(data["error"]) == {"message", "type", "param", "code"}, data

    check()
    server.wait_idle()
    status, data, _ = post(server.url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3})
    assert status == 200 and data["usage"]["completion_tokens"] == 3
