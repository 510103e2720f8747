"""POST /v1/responses (OpenAI's Responses API, server/serving_responses.py) on a real server through
the official openai client: whole and streamed responses, instructions and message lists, the
length cut, JSON output through text.format, function tools (named and required choices, enforced
by structured outputs; calls and their outputs sent back as input), and what it refuses."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.server_process import post, server_fixture

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "description": "Current time in a timezone",
          "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}},
                         "required": ["timezone"], "additionalProperties": False}}]
ASK = "What is the weather like in Paris today?"

server = server_fixture("--kv-cache-memory", "128MiB", "--max-model-len", "1024", "--max-num-seqs", "4")


def test_answers_paris_with_exact_usage(server, client):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0,
                                metadata={"team": "platform"})
    assert r.object == "response" and r.status == "completed" and r.model == MODEL and r.id.startswith("resp_")
    assert "Paris" in r.output_text and r.metadata == {"team": "platform"} and r.incomplete_details is None
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    prompt_ids = post(server.url + "/tokenize", {"messages": [{"role": "user", "content": QUESTION}]})[1]["tokens"]
    assert r.usage.input_tokens == len(prompt_ids)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens > r.usage.input_tokens


def test_stream_is_openais_event_sequence_and_adds_up(client):
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2 and kinds == (["response.created", "response.in_progress", "response.output_item.added",
                                      "response.content_part.added"] + ["response.output_text.delta"] * deltas
                                     + ["response.output_text.done", "response.content_part.done",
                                        "response.output_item.done", "response.completed"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == final.output_text and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_instructions_message_lists_and_the_length_cut(client):
    r = client.responses.create(model=MODEL, instructions="You are a geography teacher.", temperature=0,
                                input=[{"role": "developer", "content": "Answer briefly."},
                                       {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
                                max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0) as stream:
        assert [e.type for e in stream][-1] == "response.incomplete"


def test_text_format_json_schema_constrains_the_output(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input=QUESTION + " Reply in JSON.", temperature=0, max_output_tokens=30,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"city"}
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("extra,param", [({"previous_response_id": "resp_1"}, "previous_response_id"),
                                         ({"tools": [{"type": "web_search"}]}, "tools"),
                                         ({"tools": TOOLS}, "tool_choice"),   # auto needs a tool parser
                                         ({"tools": TOOLS, "tool_choice": "required",
                                           "text": {"format": {"type": "json_object"}}}, "tool_choice"),
                                         ({"n": 2}, "n"), ({"max_output_tokens": 0}, "max_output_tokens"),
                                         ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema")])
def test_what_it_does_not_do_is_a_400_naming_the_field(client, extra, param):
    body = {"input": QUESTION, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/responses", body=body, cast_to=object)
    assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=[])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-nope", input=QUESTION)


def test_named_and_required_tool_choices_give_function_calls(client):
    r = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, temperature=0, max_output_tokens=96,
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert r.status == "completed" and r.tool_choice.name == "get_weather" and len(r.tools) == 2
    r = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                                max_output_tokens=160)
    assert r.output and all(item.type == "function_call" for item in r.output)
    with client.responses.stream(model=MODEL, input=ASK, tools=TOOLS, temperature=0, max_output_tokens=96,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    (streamed,) = final.output
    assert streamed.arguments == events[3].delta == call.arguments   # greedy: what the whole response gave


def test_calls_and_their_outputs_go_back_as_input(client):
    """A conversation that carries the earlier call and its result (as an agent loop sends it):
    the template gets an assistant turn with tool_calls and a tool message."""
    first = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, temperature=0, max_output_tokens=96,
                                    tool_choice={"type": "function", "name": "get_weather"})
    (call,) = first.output
    conversation = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": call.call_id,
                     "output": json.dumps({"temperature": 21, "sky": "sunny"})}]
    r = client.responses.create(model=MODEL, input=conversation, tools=TOOLS, tool_choice="none", temperature=0,
                                max_output_tokens=24)
    assert r.output[0].type == "message" and r.output_text
    assert r.usage.input_tokens > first.usage.input_tokens   # the call and its result reached the prompt
