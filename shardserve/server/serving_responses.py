"""POST /v1/responses: OpenAI's Responses API on the chat path (the input as chat messages through
the chat template, one engine request), as vLLM serves it for text.

What it covers: `input` as a string or a list of items (messages with input_text / output_text
parts, earlier function calls and their outputs, earlier reasoning items, which are left out),
`instructions`, `max_output_tokens`, the sampling fields (vLLM's extras too), `text.format`
(json_object / json_schema, through structured outputs), function `tools` with `tool_choice`
(server/tools.py, as on chat: auto with --enable-auto-tool-choice, required and named enforced by
structured outputs), `metadata`, `stream`. With `--reasoning-parser` the thinking is a `reasoning`
output item before the message; tool calls are `function_call` items after it. Refused with a 400
naming the field: `previous_response_id` (no response is stored; send the whole conversation),
tools other than functions, and `n` other than 1.

A stream is OpenAI's event sequence (each an SSE `event:` + `data:` pair with `type` and a
`sequence_number`): response.created, response.in_progress, then per output item
response.output_item.added, its deltas (response.reasoning_text.delta, or
response.content_part.added + response.output_text.delta ..., or for a call
response.function_call_arguments.delta with all its arguments), its .done events, and last
response.completed (response.incomplete where max_output_tokens cut it short). Text that may
begin a tool call is held back until the output ends, as on chat.
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from starlette.requests import Request

from shardserve.outputs import RequestOutput
from shardserve.sampling_params import InvalidParameter
from shardserve.server.protocol import APIError
from shardserve.server.protocol_responses import ResponsesRequest
from shardserve.server.reasoning import ReasoningParser
from shardserve.server.serving import now_s
from shardserve.server.serving_chat import ChatServing
from shardserve.server.tool_parsers import ToolCall
from shardserve.server.tools import ToolPlan, plan_tools


class ResponsesServing(ChatServing):
    async def create(self, req: ResponsesRequest, raw: Request) -> dict[str, Any] | AsyncIterator[str]:
        model = self.check_model(req.model)
        if req.previous_response_id is not None:
            raise APIError(400, "previous_response_id: this server stores no responses; send the whole "
                                "conversation as input", "previous_response_id")
        if req.n != 1:
            raise APIError(400, "a response has one output: n must be 1", "n")
        try:
            plan = plan_tools(*req.chat_tools(), self.settings.tool_call_parser)
        except InvalidParameter as e:
            raise APIError(400, str(e), e.param) from e
        if plan.schema is not None:
            req._tool_spec = plan.structured_spec()
        self.check_ready(raw)
        text, ids = await self.render(req.messages(), True, False, None, None, plan.template_tools)
        max_tokens = self.max_tokens_for(len(ids), req.max_output_tokens, "max_output_tokens")
        params = self.sampling_params(req.sampling_params, max_tokens, None)
        streams = await self.start_all(raw, [{"prompt": text, "prompt_token_ids": ids}], params, req)
        parser = ReasoningParser(self.settings.reasoning_parser, text) if self.settings.reasoning_parser else None
        body = ResponseBody(req, raw.state.request_id, model, parser, plan)
        if req.stream:
            return self.sse_errors(body.events(streams[0]))
        (out,) = await self.collect(streams, raw)
        return body.final(out)


class ResponseBody:
    """The response object of one request, whole or as the stream's events."""

    def __init__(self, req: ResponsesRequest, request_id: str, model: str, parser: ReasoningParser | None,
                 plan: ToolPlan) -> None:
        self.req, self.model, self.parser, self.plan = req, model, parser, plan
        self.id, self.created = f"resp_{request_id}", now_s()
        self.message_id, self.reasoning_id = f"msg_{request_id}", f"rs_{request_id}"
        self.sequence = 0

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 ) -> dict[str, Any]:
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "metadata": req.metadata or {}, "text": {"format": req.text_format()}, "tools": req.tools or [],
                "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
                "reasoning": req.reasoning, "store": False, "previous_response_id": None, "user": req.user,
                "error": None, "usage": usage, "completed_at": now_s() if status == "completed" else None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}

    def reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []}

    def message_item(self, text: str | None, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [] if text is None else [_output_text(text)]}

    def split(self, text: str, final: bool) -> tuple[str | None, str, list[ToolCall]]:
        """(reasoning, content, calls) of the output so far: the content only what is surely not a
        tool call while it runs; the calls once it is over."""
        reasoning, content = self.parser.split(text, final) if self.parser else (None, text)
        if not self.plan.active:
            return reasoning, content, []
        if not final:
            return reasoning, content[:self.plan.content_end(content)], []
        rest, calls = self.plan.extract(content)
        return reasoning, (rest or "") if calls else content, calls

    def _finish(self, out: RequestOutput) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        """The finished response's status, output items and usage."""
        c = out.outputs[0]
        status = "incomplete" if c.finish_reason == "length" else "completed"
        reasoning, text, calls = self.split(c.text, True)
        items = [self.reasoning_item(reasoning, "completed")] if reasoning else []
        if text or not calls:
            items.append(self.message_item(text, status))
        items += [_function_call(call) for call in calls]
        usage = {"input_tokens": len(out.prompt_token_ids),
                 "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                 "output_tokens": len(c.token_ids), "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": len(out.prompt_token_ids) + len(c.token_ids)}
        return status, items, usage

    def final(self, out: RequestOutput) -> dict[str, Any]:
        return self.response(*self._finish(out))

    # ---- streaming --------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> str:
        payload = json.dumps({"type": kind, "sequence_number": self.sequence, **fields}, ensure_ascii=False)
        self.sequence += 1
        return f"event: {kind}\ndata: {payload}\n\n"

    async def events(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        # Characters sent of each item: None before it opens; the reasoning item's -1 once closed.
        sent_reasoning = sent_text = None
        index = 0   # the next item's output_index
        async for out in stream:
            c = out.outputs[0]
            final = c.finish_reason is not None
            reasoning, text, calls = self.split(c.text, final)
            if reasoning and sent_reasoning is None:
                sent_reasoning, index = 0, 1
                yield self.event("response.output_item.added", output_index=0,
                                 item=self.reasoning_item("", "in_progress"))
            if sent_reasoning is not None and sent_reasoning >= 0 and len(reasoning or "") > sent_reasoning:
                yield self.event("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=0,
                                 content_index=0, delta=reasoning[sent_reasoning:])
                sent_reasoning = len(reasoning)
            if (text or (final and not calls)) and sent_text is None:
                async for e in self._close_reasoning(sent_reasoning, reasoning):
                    yield e
                sent_reasoning, sent_text = -1, 0
                yield self.event("response.output_item.added", output_index=index,
                                 item=self.message_item(None, "in_progress"))
                yield self.event("response.content_part.added", item_id=self.message_id, output_index=index,
                                 content_index=0, part=_output_text(""))
            if sent_text is not None and len(text) > sent_text:
                yield self.event("response.output_text.delta", item_id=self.message_id, output_index=index,
                                 content_index=0, delta=text[sent_text:], logprobs=[])
                sent_text = len(text)
            if not final:
                continue
            status, items, usage = self._finish(out)
            async for e in self._close_reasoning(sent_reasoning, reasoning):
                yield e
            if sent_text is not None:
                yield self.event("response.output_text.done", item_id=self.message_id, output_index=index,
                                 content_index=0, text=text, logprobs=[])
                yield self.event("response.content_part.done", item_id=self.message_id, output_index=index,
                                 content_index=0, part=_output_text(text))
                yield self.event("response.output_item.done", output_index=index,
                                 item=next(i for i in items if i["type"] == "message"))
                index += 1
            for call in calls:   # each call whole: added with no arguments, its arguments, done
                item = _function_call(call)
                yield self.event("response.output_item.added", output_index=index,
                                 item={**item, "arguments": "", "status": "in_progress"})
                yield self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                 delta=call.arguments)
                yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 arguments=call.arguments)
                yield self.event("response.output_item.done", output_index=index, item=item)
                index += 1
            yield self.event(f"response.{status}", response=self.response(status, items, usage))
            return

    async def _close_reasoning(self, sent: int | None, reasoning: str | None) -> AsyncIterator[str]:
        """The reasoning item's closing events, if it is open (sent not None, and not -1: closed)."""
        if sent is not None and sent >= 0:
            yield self.event("response.reasoning_text.done", item_id=self.reasoning_id, output_index=0,
                             content_index=0, text=reasoning or "")
            yield self.event("response.output_item.done", output_index=0,
                             item=self.reasoning_item(reasoning or "", "completed"))


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _function_call(call: ToolCall) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": "completed"}
