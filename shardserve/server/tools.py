"""tool_choice for chat requests: which tools reach the template, the JSON schema that enforces
`required` and named choices (through structured outputs), and turning generated text back into
OpenAI tool calls. `auto` leaves generation free and parses the text with a tool parser."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shardserve.sampling_params import InvalidParameter, StructuredOutputsParams
from shardserve.server.tool_parsers import ToolCall, ToolParser, get_tool_parser

AUTO_FLAGS = "--enable-auto-tool-choice --tool-call-parser hermes|llama3_json|mistral"


@dataclass
class ToolPlan:
    """mode: "none", "auto", "required" or "named". `template_tools` go to the chat template;
    `schema` (required/named) constrains generation; `parser` (auto) reads the text."""

    mode: str
    template_tools: list[dict[str, Any]] | None = None
    schema: dict[str, Any] | None = None
    parser: ToolParser | None = None

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def structured_spec(self) -> StructuredOutputsParams | None:
        return StructuredOutputsParams(json=self.schema) if self.schema is not None else None

    def content_end(self, text: str) -> int:
        """While streaming: how much of `text` is surely content (auto: up to where a call may begin)."""
        if self.mode == "auto" and self.parser is not None:
            return self.parser.content_end(text)
        return 0 if self.active else len(text)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) from a finished choice's text; text that is not a call stays content."""
        if self.mode == "auto" and self.parser is not None:
            return self.parser.extract_tool_calls(text)
        if self.mode not in ("required", "named"):
            return text, []
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        items = value if self.mode == "required" else [value]
        if not isinstance(items, list) or not items:
            return text, []
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return text, []
            calls.append(ToolCall(item["name"], json.dumps(item.get("arguments", {}), ensure_ascii=False)))
        return None, calls


def _functions(tools: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidParameter(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                                   "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidParameter(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidParameter(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out.append(fn)
    return out


def call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    """One call of `fn`: {"name": <its name>, "arguments": <its parameters schema>}."""
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"type": "string", "const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def required_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """An array of one or more calls, each of any of the tools."""
    return {"type": "array", "minItems": 1, "items": {"anyOf": [call_schema(fn) for fn in functions]}}


def plan_tools(tools: list[Any] | None, tool_choice: Any, auto_parser: str | None) -> ToolPlan:
    """The ToolPlan for a request, or InvalidParameter naming what is wrong. auto_parser: the
    server's --tool-call-parser when --enable-auto-tool-choice is on, else None."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolPlan("none")
    if not tools:
        raise InvalidParameter(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    functions = _functions(tools)
    if tool_choice == "auto":
        if auto_parser is None:
            raise InvalidParameter(f'"auto" tool choice requires {AUTO_FLAGS} to be set on the server '
                                   '(or send tool_choice "required", "none" or a named function)', "tool_choice")
        return ToolPlan("auto", tools, parser=get_tool_parser(auto_parser))
    if tool_choice == "required":
        return ToolPlan("required", tools, schema=required_schema(functions))
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [fn for fn in functions if fn["name"] == name]
        if not chosen:
            raise InvalidParameter(f"tool_choice names function {name!r}, which is not among the tools "
                                   f"({', '.join(fn['name'] for fn in functions)})", "tool_choice")
        return ToolPlan("named", tools, schema=call_schema(chosen[0]))
    raise InvalidParameter('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                           '{"name": ...}}', "tool_choice")
