"""Hermes / Qwen2.5 / Qwen3 format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, any number per message, content before or between them."""
from __future__ import annotations

import json
import re

from shardserve.server.tool_parsers.base import ToolCall, ToolParser, call_from

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = ("<tool_call>",)

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if "<tool_call>" not in text:
            return text, []
        calls: list[ToolCall] = []
        kept: list[str] = []
        pos = 0
        for m in _BLOCK.finditer(text):
            try:
                call = call_from(json.loads(m.group(1)))
            except ValueError:
                call = None
            if call is None:   # malformed: the whole block stays in the content
                continue
            kept.append(text[pos:m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        content = "".join(kept).strip()
        return (content or None) if calls else text, calls
