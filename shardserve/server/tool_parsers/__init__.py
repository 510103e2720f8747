"""Tool-call parsers for `tool_choice: "auto"`: each turns a model family's tool-call text into
OpenAI tool calls. Picked with `--tool-call-parser`; see docs/server.md "Tool calling"."""
from __future__ import annotations

from shardserve.server.tool_parsers.base import ToolCall, ToolParser, new_call_id
from shardserve.server.tool_parsers.hermes import HermesToolParser
from shardserve.server.tool_parsers.llama3_json import Llama3JsonToolParser
from shardserve.server.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}: use one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ToolCall", "ToolParser", "get_tool_parser", "new_call_id"]
