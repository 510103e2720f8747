"""OpenAI request schemas (pydantic) and the error shape every failure is reported in.

Fields follow the OpenAI API plus vLLM's extra sampling fields (top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, stop_token_ids, chat_template_kwargs, ...), so clients written for vLLM
work unchanged. Unknown fields are ignored, as OpenAI and vLLM do.
"""
from __future__ import annotations

from typing import Annotated, Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from shardserve.sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
          413: "RequestTooLarge", 429: "RateLimitError", 500: "InternalServerError", 502: "BadGatewayError",
          503: "ServiceUnavailableError"}


MAX_N = 128   # samples per request: each is an engine request, so n is a lever for abuse
MAX_PROMPTS = 128        # prompts in one /v1/completions request: each is an engine request too
MAX_STOP = 64            # stop strings (and stop_token_ids) per request: each is checked at every step
MAX_STOP_CHARS = 1024    # characters in one stop string
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class APIError(Exception):
    """Raised by handlers; rendered as {"error": {...}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "APIError"), "param": param, "code": status}}


async def sse_data(lines: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream, up to `data: [DONE]` (excluded)."""
    async for raw in lines:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield data


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` request field: exactly one of json, regex, choice, grammar, json_object."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class _SamplingFields(_Request):
    """What completions and chat share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=-2**63, le=2**64 - 1)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP)] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[str, float] | None = None   # token id (as a JSON key) -> bias in [-100, 100]
    priority: int = 0   # vLLM's: lower runs first; other than 0 only under --scheduling-policy priority
    return_tokens_as_token_ids: bool | None = None   # vLLM's: logprobs tokens as "token_id:N" (None: the server's)
    cache_salt: str | None = None   # vLLM's: prefix-cache hits only among requests with this salt (per tenant)
    # vLLM's older names for the same (guided decoding)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_spec(self) -> StructuredOutputsParams | None:
        if self.structured_outputs is not None:
            so = self.structured_outputs
            return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                           json_object=so.json_object,
                                           disable_any_whitespace=so.disable_any_whitespace)
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        guided = {k: v for k, v in guided.items() if v is not None}
        return StructuredOutputsParams(**guided) if guided else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Unset fields take `defaults` (the model's generation_config), then SamplingParams' own."""
        given = dict(defaults or {})
        given.update({name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                             "presence_penalty", "frequency_penalty",
                                                             "repetition_penalty")
                      if getattr(self, name) is not None})
        return SamplingParams(n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, max_tokens=max_tokens,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              structured_outputs=self.structured_spec(), logit_bias=self.token_biases(), **given)

    def token_biases(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise InvalidParameter(f"logit_bias keys must be token ids, got {sorted(self.logit_bias)[:5]}",
                                   "logit_bias") from None


class CompletionRequest(_SamplingFields):
    prompt: (str | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | list[int]
             | Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)])
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    prompt_logprobs: int | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None   # an assistant turn's earlier calls
    tool_call_id: str | None = None                   # a role "tool" message: the call it answers

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: text, json_object, or json_schema (with `json_schema`)."""

    type: str = "text"
    json_schema: JsonSchemaFormat | None = None

    def structured_spec(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise InvalidParameter("response_format json_schema needs json_schema.schema", "response_format")
            return StructuredOutputsParams(json=self.json_schema.schema_)
        raise InvalidParameter(f"response_format type {self.type!r} is not supported: use 'text', 'json_object' "
                               "or 'json_schema'", "response_format")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None   # accepted; `required` may return several calls either way
    _tool_spec: StructuredOutputsParams | None = PrivateAttr(None)   # set by the server from tool_choice (tools.py)

    def structured_spec(self) -> StructuredOutputsParams | None:
        spec = super().structured_spec()
        from_format = self.response_format.structured_spec() if self.response_format is not None else None
        if spec is not None and from_format is not None:
            raise InvalidParameter("give either response_format or structured_outputs, not both", "response_format")
        return with_tool_spec(spec or from_format, self._tool_spec, "response_format")


def with_tool_spec(spec: StructuredOutputsParams | None, tool_spec: StructuredOutputsParams | None,
                   format_field: str) -> StructuredOutputsParams | None:
    """A request's output constraint once tool_choice is counted: the tool call's schema (required
    or a named function) where there is one, which no other constraint may come with."""
    if tool_spec is None:
        return spec
    if spec is not None:
        raise InvalidParameter(f"tool_choice \"required\" or a named function cannot be combined with "
                               f"{format_field} or structured_outputs", "tool_choice")
    return tool_spec


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
