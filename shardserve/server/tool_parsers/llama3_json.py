"""Llama 3.1/3.2 JSON format: `{"name": ..., "parameters": {...}}` (or "arguments"), optionally
after `<|python_tag|>`, several calls separated by `;`. The message is a call only if it starts
with one (after the tag and whitespace), as the Llama templates instruct."""
from __future__ import annotations

from shardserve.server.tool_parsers.base import DECODER, ToolCall, ToolParser, call_from

_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = (_TAG,)

    def content_end(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("{"):   # a message that opens with JSON may be a call
            return 0
        return super().content_end(text)

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        tag = text.find(_TAG)
        before = text[:tag].strip() if tag >= 0 else ""
        body = text[tag + len(_TAG):] if tag >= 0 else text
        i = len(body) - len(body.lstrip())
        if i >= len(body) or body[i] != "{":
            return text, []
        calls: list[ToolCall] = []
        while i < len(body) and body[i] == "{":
            try:
                obj, end = DECODER.raw_decode(body, i)
            except ValueError:
                break
            call = call_from(obj, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            i = end
            rest = body[i:].lstrip()
            if not rest.startswith(";"):
                i = len(body) - len(rest)
                break
            rest = rest[1:].lstrip()
            i = len(body) - len(rest)
        if not calls:
            return text, []
        content = (before + " " + body[i:].strip()).strip()
        return content or None, calls
