"""Mistral format: `[TOOL_CALLS]` followed by a JSON list of {"name", "arguments"} (older
templates), or, in newer tokenizers, `[TOOL_CALLS]name[ARGS]{...}` once per call."""
from __future__ import annotations

from shardserve.server.tool_parsers.base import DECODER, ToolCall, ToolParser, arguments_text, call_from

_BOT = "[TOOL_CALLS]"
_ARGS = "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = (_BOT,)

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(_BOT)
        if start < 0:
            return text, []
        content = text[:start].strip()
        calls: list[ToolCall] = []
        rest = ""
        for segment in text[start + len(_BOT):].split(_BOT):
            seg = segment.strip()
            parsed, tail = self._segment(seg)
            if parsed is None:   # malformed: give the whole message back as content
                return text, []
            calls.extend(parsed)
            rest += tail
        if not calls:
            return text, []
        content = (content + " " + rest.strip()).strip()
        return content or None, calls

    @staticmethod
    def _segment(seg: str) -> tuple[list[ToolCall] | None, str]:
        if seg.startswith("[") or seg.startswith("{"):
            try:
                value, end = DECODER.raw_decode(seg)
            except ValueError:
                return None, ""
            items = value if isinstance(value, list) else [value]
            calls = [call_from(item) for item in items]
            if not calls or any(c is None for c in calls):
                return None, ""
            return calls, seg[end:]
        if _ARGS in seg:   # name[ARGS]{...}
            name, args = seg.split(_ARGS, 1)
            try:
                value, end = DECODER.raw_decode(args.strip())
            except ValueError:
                return None, ""
            if not name.strip():
                return None, ""
            return [ToolCall(name.strip(), arguments_text(value))], args.strip()[end:]
        return None, ""
