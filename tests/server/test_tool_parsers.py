"""Tool-call parsers on the exact text the model families emit: one call, several calls, content
around them, and malformed text left as content."""
from __future__ import annotations

import json

import pytest

from shardserve.server.tool_parsers import TOOL_PARSERS, get_tool_parser


def parsed(parser: str, text: str):
    content, calls = get_tool_parser(parser).extract_tool_calls(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls], calls


def test_hermes_one_and_several_calls():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    content, calls, raw = parsed("hermes", text)
    assert content is None and calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert raw[0].id.startswith("call_") and raw[0].to_openai()["type"] == "function"
    text = ("Let me check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
            "</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n</tool_call>")
    content, calls, raw = parsed("hermes", text)
    assert content == "Let me check both."
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert raw[0].id != raw[1].id


def test_hermes_malformed_and_unterminated():
    text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": </tool_call>"
    assert parsed("hermes", text)[:2] == (text, [])
    assert parsed("hermes", "no calls here")[:2] == ("no calls here", [])
    # the model stopped before the closing tag (EOS / stop string): the JSON is whole, keep the call
    content, calls, _ = parsed("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}}')
    assert content is None and calls == [("f", {"x": 1})]
    # one good block and one bad one: the bad block stays in the content
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
    content, calls, _ = parsed("hermes", text)
    assert calls == [("f", {})] and content == "<tool_call>{oops}</tool_call>"
    assert parsed("hermes", '<tool_call>["not", "a", "call"]</tool_call>')[1] == []


def test_llama3_json_formats():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parsed("llama3_json", text)[:2] == (None, [("get_weather", {"city": "Paris"})])
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parsed("llama3_json", text)[:2] == (None, [("get_weather", {"city": "Paris"})])
    text = ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "arguments": {"tz": "CET"}}')
    assert parsed("llama3_json", text)[1] == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    text = '{"name": "search", "parameters": "{\\"q\\": \\"x\\"}"}'   # arguments given as a JSON string
    assert parsed("llama3_json", text)[1] == [("search", {"q": "x"})]


def test_llama3_json_not_calls():
    for text in ["The weather is nice.", '{"city": "Paris"}', '{"name": "f", "parameters": {', "",
                 'Here: {"name": "f", "parameters": {}}']:
        assert parsed("llama3_json", text)[:2] == (text, [])
    # a good call then junk after ';' keeps the call and the junk as content
    content, calls, _ = parsed("llama3_json", '{"name": "f", "parameters": {}}; {broken')
    assert calls == [("f", {})] and content == "{broken"


def test_mistral_formats():
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert parsed("mistral", text)[:2] == (None, [("get_weather", {"city": "Paris"})])
    text = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {"tz": "CET"}}]')
    assert parsed("mistral", text)[1] == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    text = 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {}}]'
    assert parsed("mistral", text)[:2] == ("Sure.", [("f", {})])
    # newer tokenizers (v11+): [TOOL_CALLS]name[ARGS]{...} once per call
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'
    assert parsed("mistral", text)[1] == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


def test_mistral_malformed():
    for text in ["plain text", '[TOOL_CALLS] [{"name": "f", "arguments": {', "[TOOL_CALLS]",
                 '[TOOL_CALLS] [{"arguments": {}}]', "[TOOL_CALLS]f[ARGS]{oops"]:
        assert parsed("mistral", text)[:2] == (text, [])


@pytest.mark.parametrize("name", list(TOOL_PARSERS))
def test_parsers_never_raise(name):
    parser = get_tool_parser(name)
    for text in ["<tool_call>", "[TOOL_CALLS][", "{", "<|python_tag|>", "{}" * 50, "[[[[", "\x00", "<tool_call>{}"]:
        content, calls = parser.extract_tool_calls(text)
        assert calls == [] and content == text


def test_unknown_parser():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def test_content_end_holds_back_what_may_start_a_call():
    hermes, llama, mistral = (get_tool_parser(n) for n in ("hermes", "llama3_json", "mistral"))
    assert hermes.content_end("Sure, let me look.") == len("Sure, let me look.")
    assert hermes.content_end("Sure <tool") == len("Sure ")
    assert hermes.content_end('Sure <tool_call>{"name"') == len("Sure ")
    assert mistral.content_end("ok [TOOL_") == len("ok ")
    assert llama.content_end("") == 0 and llama.content_end(' {"name": "f"') == 0
    assert llama.content_end("Hello there") == len("Hello there")
    assert llama.content_end("Hello <|python") == len("Hello ")


def test_serve_flags_follow_vllm():
    import argparse

    from shardserve.cli import add_server_args, auto_tool_parser
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    ns = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert auto_tool_parser(ns.enable_auto_tool_choice, ns.tool_call_parser) == "llama3_json"
    assert auto_tool_parser(False, "hermes") is None   # a parser alone leaves auto off
    with pytest.raises(ValueError, match="--tool-call-parser"):
        auto_tool_parser(True, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "nope"])
