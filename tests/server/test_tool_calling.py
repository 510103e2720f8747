"""Tool calling through the official `openai` client against a real `shardserve serve` on the
embedded SmolLM2: named and required tool choices (enforced by structured outputs, so even this
tiny model returns well-formed calls), streamed and not; auto without the server flags is a 400;
a conversation with tool results goes back through the chat template."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from shardserve.server.tools import call_schema, plan_tools, required_schema
from tests.server.server_process import ServerProcess, server_fixture

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}},
               "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME_PARAMS}}]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


server = server_fixture("--kv-cache-memory", "128MiB", "--max-model-len", "1024", "--max-num-seqs", "8")


def check_call(call, names=("get_weather",)) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_schemas_for_required_and_named():
    plan = plan_tools(TOOLS, NAMED, None)
    assert plan.mode == "named" and plan.schema == call_schema(TOOLS[0]["function"])
    assert plan.schema["properties"]["name"] == {"type": "string", "const": "get_weather"}
    assert plan.schema["properties"]["arguments"] == WEATHER_PARAMS
    plan = plan_tools(TOOLS, "required", None)
    assert plan.schema == required_schema([t["function"] for t in TOOLS])
    assert plan.schema["minItems"] == 1 and len(plan.schema["items"]["anyOf"]) == 2
    good = [{"name": "get_time", "arguments": {"timezone": "CET"}}]
    jsonschema.validate(good, plan.schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"city": "x"}}], plan.schema)
    content, calls = plan.extract(json.dumps(good))
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"timezone": "CET"})]
    assert plan.extract('[{"name": "get_time", "argu')[1] == []   # cut off by max_tokens: left as content
    assert plan_tools(TOOLS, "none", None).active is False
    assert plan_tools(None, None, None).mode == "none"
    assert plan_tools(TOOLS, "auto", "hermes").parser.name == "hermes"


def test_named_tool_choice(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0,
                                       max_tokens=96)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


def test_named_tool_choice_streamed(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                            temperature=0, max_tokens=96, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert entry["id"] is None and d.function.name   # the id comes once, with the name
                    entry["id"], entry["name"] = d.id, d.function.name
                entry["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_PARAMS)


def test_required_with_two_tools(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=160)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call, ("get_weather", "get_time"))


def test_auto_without_flags_and_bad_tool_choices_are_400s(client):
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice --tool-call-parser"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=8)
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):   # auto is the default with tools
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8,
                                       response_format={"type": "json_object"})
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=8)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content


def test_tool_results_round_trip_through_the_template(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 21, "sky": "sunny"}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=16)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=NAMED,
                                       temperature=0, max_tokens=96)
    check_call(r.choices[0].message.tool_calls[0])


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@pytest.fixture(scope="module")
def auto_client(tmp_path_factory):
    srv = ServerProcess(["--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--max-num-seqs", "4",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                        str(tmp_path_factory.mktemp("server") / "server.log"))
    yield srv.client()
    srv.stop()


def test_auto_with_the_hermes_parser(auto_client):
    # the tiny model does not write Hermes calls by itself: a choice constraint makes it write one
    force = {"structured_outputs": {"choice": ["Let me check. " + HERMES_CALL]}}
    r = auto_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
                                            extra_body=force)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    check_call(choice.message.tool_calls[0])
    stream = auto_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                                 max_tokens=200, extra_body=force, stream=True)
    content, args, names, finish = "", "", [], None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                names += [d.function.name] if d.function.name else []
                args += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert content.strip() == "Let me check." and names == ["get_weather"] and finish == "tool_calls"
    assert json.loads(args) == {"city": "Paris", "unit": "celsius"}
    r = auto_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=8)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls   # no call: plain content


def test_responses_api_auto_gives_the_text_and_the_call_as_items(auto_client):
    """/v1/responses with tool_choice auto (the default with tools) and the Hermes parser: the text
    before the call is a message item, the call a function_call item, whole and streamed."""
    force = {"structured_outputs": {"choice": ["Let me check. " + HERMES_CALL]}}
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    kwargs = dict(model=MODEL, input=ASK[0]["content"], tools=tools, temperature=0, max_output_tokens=200,
                  extra_body=force)
    r = auto_client.responses.create(**kwargs)
    message, call = r.output
    assert message.type == "message" and r.output_text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    with auto_client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text.strip() == "Let me check." and "<tool_call>" not in text   # the call's text is held back
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == call.arguments


CHECKING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.tool_calls and m.tool_calls[0].function.arguments is string %}{{ raise_exception('args as text') }}"
    "{% endif %}{% if m.role == 'tool' and not m.tool_call_id %}{{ raise_exception('no tool_call_id') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}"
    "<|im_end|>\n{% endfor %}{% if tools %}TOOLS: {{ tools | tojson }}\n{% endif %}<|im_start|>assistant\n")


def test_tools_and_tool_messages_reach_the_template(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 21}'}]
    common = dict(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                  extra_body={"chat_template": CHECKING_TEMPLATE})
    with_tools = client.chat.completions.create(tool_choice=NAMED, max_tokens=96, **common)
    check_call(with_tools.choices[0].message.tool_calls[0])
    without = client.chat.completions.create(tool_choice="none", max_tokens=2, **common)   # "none": no tools shown
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 50


def test_tool_schemas_in_the_engine_offline():
    """The schemas built for required and named choices, through the offline engine: the text is
    JSON valid against them and extracts to calls whose arguments follow the tools' parameters."""
    from shardserve.llm import LLM
    from shardserve.sampling_params import SamplingParams
    llm = LLM(max_model_len=1024, kv_cache_memory="64MiB", show_progress=False)
    try:
        plans = [plan_tools(TOOLS, "required", None), plan_tools(TOOLS, NAMED, None)]
        params = [SamplingParams(temperature=0, max_tokens=160, structured_outputs=p.structured_spec()) for p in plans]
        outs = llm.chat([ASK, ASK], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for plan, out in zip(plans, outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), plan.schema)
        content, calls = plan.extract(text)
        assert content is None and calls
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])
    assert plans[1].extract(outs[1].outputs[0].text)[1][0].name == "get_weather"
