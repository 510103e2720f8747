"""What every tool parser shares: the call shape, JSON scanning, and the parser interface."""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str   # a JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_call_id()

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def arguments_text(args: Any) -> str:
    """Arguments as a JSON text: a dict is dumped; a string that already is JSON stays as it is."""
    if isinstance(args, str):
        try:
            json.loads(args)
            return args
        except ValueError:
            return json.dumps(args, ensure_ascii=False)
    return json.dumps({} if args is None else args, ensure_ascii=False)


def call_from(obj: Any, arg_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """A ToolCall from {"name": ..., <arg key>: ...}, or None if `obj` is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in arg_keys:
        if key in obj:
            return ToolCall(obj["name"], arguments_text(obj[key]))
    return ToolCall(obj["name"], "{}")


DECODER = json.JSONDecoder()


class ToolParser(ABC):
    """extract_tool_calls(text) -> (content, calls). Text that is not a well-formed call stays in the
    content; a parser never raises on model output."""

    name = ""
    start_markers: tuple[str, ...] = ()   # text that begins a tool call

    def content_end(self, text: str) -> int:
        """While streaming: the length of the prefix of `text` that cannot belong to a tool call
        (before the first start marker, less any tail that could be the start of a marker)."""
        found = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        if found:
            return min(found)
        for k in range(min(len(text), max(map(len, self.start_markers), default=0) - 1), 0, -1):
            if any(m.startswith(text[-k:]) for m in self.start_markers):
                return len(text) - k
        return len(text)

    @abstractmethod
    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the content outside the calls, or None when there is none; the calls)."""
