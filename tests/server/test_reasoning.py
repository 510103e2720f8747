"""--reasoning-parser: the two parsers' split of an output into thinking and answer (every prefix of
a stream holds back only what may still become a tag, so the deltas add up to the whole), and a real
`shardserve serve --reasoning-parser qwen3` through the official `openai` client, the embedded model
made to think by a regex (structured outputs) since it does not by itself."""
from __future__ import annotations

import pytest

from shardserve.server.reasoning import ReasoningParser
from tests.server.server_process import server_fixture

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
THOUGHT = "<think>\nThe capital of France is Paris.\n</think>\n\nParis"


@pytest.mark.parametrize("name,prompt,text,want", [
    ("qwen3", "", THOUGHT, ("\nThe capital of France is Paris.\n", "\n\nParis")),
    ("qwen3", "", "Paris", (None, "Paris")),                       # no think block: all content
    ("qwen3", "", "<think>\ncut short", ("\ncut short", "")),      # stopped while thinking
    ("qwen3", "assistant\n<think>\n", "so Paris</think>Paris", ("so Paris", "Paris")),   # opened in the prompt
    ("qwen3", "<think>\n\n</think>\n\n", "Paris</think>", (None, "Paris</think>")),   # thinking off: closed block
    ("deepseek_r1", "", "so Paris</think>\n\nParis", ("so Paris", "\n\nParis")),     # the template opened it
    ("deepseek_r1", "", THOUGHT, ("\nThe capital of France is Paris.\n", "\n\nParis")),
    ("deepseek_r1", "", "still thinking", ("still thinking", "")),
])
def test_split(name, prompt, text, want):
    assert ReasoningParser(name, prompt).split(text) == want


@pytest.mark.parametrize("name,text", [("qwen3", THOUGHT), ("qwen3", "Paris </thin"), ("qwen3", "<thi"),
                                       ("deepseek_r1", "a</b</thinking</think>x</think>"),
                                       ("deepseek_r1", "ends in </thi")])
def test_every_prefix_only_grows(name, text):
    parser = ReasoningParser(name)
    final_reasoning, final_content = parser.split(text)
    seen = ("", "")
    for n in range(len(text) + 1):
        reasoning, content = parser.split(text[:n], final=False)
        reasoning = reasoning or ""
        assert (final_reasoning or "").startswith(reasoning) and final_content.startswith(content), text[:n]
        assert reasoning.startswith(seen[0]) and content.startswith(seen[1]), text[:n]
        seen = (reasoning, content)


def test_unknown_parser():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningParser("granite")


server = server_fixture("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--max-num-seqs", "4",
                        "--reasoning-parser", "qwen3")


def _ask(client, regex: str, stream: bool = False):
    return client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40, stream=stream,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}],
                                          extra_body={"structured_outputs": {"regex": regex}})


def test_thinking_apart_from_the_answer(client):
    r = _ask(client, THOUGHT.replace(".", r"\."))
    message = r.choices[0].message
    assert (message.reasoning, message.content) == ("\nThe capital of France is Paris.\n", "\n\nParis")
    assert message.reasoning_content == message.reasoning   # vLLM's older name
    reasoning, content = "", ""
    for chunk in _ask(client, THOUGHT.replace(".", r"\."), stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            assert (delta.model_extra or {}).get("reasoning_content") == (delta.model_extra or {}).get("reasoning")
            reasoning += (delta.model_extra or {}).get("reasoning") or ""
            content += delta.content or ""
    assert (reasoning, content) == (message.reasoning, message.content)


def test_an_answer_without_thinking_is_all_content(client):
    message = _ask(client, "Paris").choices[0].message
    assert message.content == "Paris" and "reasoning" not in (message.model_extra or {})


def test_responses_api_gives_the_thinking_its_own_item(client):
    """/v1/responses: the thinking is a `reasoning` output item before the message, whole and
    streamed (reasoning_text deltas, that item closed before the message opens)."""
    kwargs = dict(model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=40,
                  extra_body={"structured_outputs": {"regex": THOUGHT.replace(".", r"\.")}})
    r = client.responses.create(**kwargs)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "\nThe capital of France is Paris.\n"
    assert message.type == "message" and r.output_text == "\n\nParis"
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "\n\nParis"
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == "\n\nParis"
