"""The Responses API's request (POST /v1/responses, server/serving_responses.py): its input items
and their translation into the chat path's messages, tools and structured outputs."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr

from shardserve.sampling_params import InvalidParameter, StructuredOutputsParams
from shardserve.server.protocol import ChatMessage, _Request, _SamplingFields, with_tool_spec


class ResponseInputPart(_Request):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ResponseInputMessage(_Request):
    """A message of the Responses API's `input` list (an item of type "message", the type optional)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ResponseInputPart]

    def chat_message(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        # "developer" is the Responses API's name for system instructions; chat templates know "system"
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=text)


class ResponseFunctionCall(_Request):
    """An earlier function call of the conversation (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class ResponseFunctionCallOutput(_Request):
    """What the client's function returned for `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ResponseReasoningItem(_Request):
    """An earlier reasoning item sent back as input: accepted and left out of the prompt, as chat
    templates leave out earlier turns' thinking."""

    type: Literal["reasoning"]


ResponseInputItem = ResponseFunctionCall | ResponseFunctionCallOutput | ResponseReasoningItem | ResponseInputMessage


class ResponseTextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseText(_Request):
    format: ResponseTextFormat | None = None


class ResponsesRequest(_SamplingFields):
    """POST /v1/responses (OpenAI's Responses API) without stored state: `input` is the whole
    conversation (server/serving_responses.py). vLLM's extra sampling fields are taken as on chat."""

    input: str | Annotated[list[ResponseInputItem], Field(min_length=1, max_length=4096)]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: ResponseText | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None                 # accepted; nothing is stored (previous_response_id is refused)
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None   # accepted (effort, summary); --reasoning-parser decides
    _tool_spec: StructuredOutputsParams | None = PrivateAttr(None)   # set by the server from tool_choice

    def messages(self) -> list[ChatMessage]:
        """The conversation as chat messages: function calls become the assistant turn's tool_calls
        (consecutive calls one turn), their outputs "tool" messages."""
        turns = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        items = [ResponseInputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, ResponseInputMessage):
                turns.append(item.chat_message())
            elif isinstance(item, ResponseFunctionCall):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if turns and turns[-1].role == "assistant" and turns[-1].tool_call_id is None:
                    turns[-1].tool_calls = [*(turns[-1].tool_calls or []), call]
                else:
                    turns.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            elif isinstance(item, ResponseFunctionCallOutput):
                turns.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        return turns

    def chat_tools(self) -> tuple[list[dict[str, Any]] | None, Any]:
        """tools and tool_choice in the chat API's shapes ({"type": "function", "function": {...}})."""
        tools = None
        if self.tools is not None:
            tools = []
            for i, tool in enumerate(self.tools):
                if tool.get("type") != "function":
                    raise InvalidParameter(f"tools[{i}]: only function tools are served, not {tool.get('type')!r}",
                                           "tools")
                tools.append({"type": "function", "function": {k: v for k, v in tool.items()
                                                               if k in ("name", "description", "parameters")}})
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        return tools, choice

    def text_format(self) -> dict[str, Any]:
        fmt = self.text.format if self.text is not None and self.text.format is not None else ResponseTextFormat()
        return fmt.model_dump(by_alias=True, exclude_none=True)

    def structured_spec(self) -> StructuredOutputsParams | None:
        spec = super().structured_spec()
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            if spec is not None:
                raise InvalidParameter("give either text.format or structured_outputs, not both", "text.format")
            if fmt.type == "json_object":
                spec = StructuredOutputsParams(json_object=True)
            elif fmt.schema_ is None:
                raise InvalidParameter("text.format json_schema needs its schema", "text.format.schema")
            else:
                spec = StructuredOutputsParams(json=fmt.schema_)
        return with_tool_spec(spec, self._tool_spec, "text.format")
