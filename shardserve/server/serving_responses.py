"""POST /v1/responses: OpenAI's Responses API on the chat path (the input as chat messages through
the chat template, one engine request), as vLLM serves it for text.

What it covers: `input` as a string or a list of messages (input_text / output_text parts),
`instructions`, `max_output_tokens`, the sampling fields (vLLM's extras too), `text.format`
(json_object / json_schema, through structured outputs), `metadata`, `stream`. With
`--reasoning-parser` the thinking is a `reasoning` output item before the message. Not covered,
and refused with a 400 naming the field: `previous_response_id` (no response is stored; send the
whole conversation), `tools`, and `n` other than 1.

A stream is OpenAI's event sequence (each an SSE `event:` + `data:` pair with `type` and a
`sequence_number`): response.created, response.in_progress, then per output item
response.output_item.added, its deltas (response.reasoning_text.delta, or
response.content_part.added + response.output_text.delta ...), its .done events, and last
response.completed (response.incomplete where max_output_tokens cut it short).
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from starlette.requests import Request

from shardserve.outputs import RequestOutput
from shardserve.server.protocol import APIError, ResponsesRequest
from shardserve.server.reasoning import ReasoningParser
from shardserve.server.serving import now_s
from shardserve.server.serving_chat import ChatServing


class ResponsesServing(ChatServing):
    async def create(self, req: ResponsesRequest, raw: Request) -> dict[str, Any] | AsyncIterator[str]:
        self.check_model(req.model)
        if req.previous_response_id is not None:
            raise APIError(400, "previous_response_id: this server stores no responses; send the whole "
                                "conversation as input", "previous_response_id")
        if req.tools:
            raise APIError(400, "tools are not supported on /v1/responses; use /v1/chat/completions", "tools")
        if req.n != 1:
            raise APIError(400, "a response has one output: n must be 1", "n")
        self.check_ready(raw)
        text, ids = await self.render(req.messages(), True, False, None, None)
        max_tokens = self.max_tokens_for(len(ids), req.max_output_tokens, "max_output_tokens")
        params = self.sampling_params(req.sampling_params, max_tokens, None)
        streams = await self.start_all(raw, [{"prompt": text, "prompt_token_ids": ids}], params, req.priority)
        parser = ReasoningParser(self.settings.reasoning_parser, text) if self.settings.reasoning_parser else None
        body = ResponseBody(req, raw.state.request_id, self.settings.served_model_name, parser)
        if req.stream:
            return self.sse_errors(body.events(streams[0]))
        (out,) = await self.collect(streams, raw)
        return body.final(out)


class ResponseBody:
    """The response object of one request, whole or as the stream's events."""

    def __init__(self, req: ResponsesRequest, request_id: str, model: str, parser: ReasoningParser | None) -> None:
        self.req, self.model, self.parser = req, model, parser
        self.id, self.created = f"resp_{request_id}", now_s()
        self.message_id, self.reasoning_id = f"msg_{request_id}", f"rs_{request_id}"
        self.sequence = 0

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 ) -> dict[str, Any]:
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "metadata": req.metadata or {}, "text": {"format": req.text_format()}, "tools": [],
                "tool_choice": req.tool_choice, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "reasoning": req.reasoning, "store": False, "previous_response_id": None, "user": req.user,
                "error": None, "usage": usage, "completed_at": now_s() if status == "completed" else None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}

    def reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []}

    def message_item(self, text: str | None, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [] if text is None else [_output_text(text)]}

    def _finish(self, out: RequestOutput) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        """The finished response's status, output items and usage."""
        c = out.outputs[0]
        status = "incomplete" if c.finish_reason == "length" else "completed"
        reasoning, text = self.parser.split(c.text) if self.parser else (None, c.text)
        items = [self.reasoning_item(reasoning, "completed")] if reasoning is not None else []
        items.append(self.message_item(text, status))
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
        sent_reasoning = sent_text = None   # characters sent of each item; None: the item is not open
        index = 0                           # the message's output_index (1 after a reasoning item)
        async for out in stream:
            c = out.outputs[0]
            final = c.finish_reason is not None
            reasoning, text = self.parser.split(c.text, final) if self.parser else (None, c.text)
            if reasoning and sent_reasoning is None:
                sent_reasoning, index = 0, 1
                yield self.event("response.output_item.added", output_index=0,
                                 item=self.reasoning_item("", "in_progress"))
            if sent_reasoning is not None and reasoning is not None and len(reasoning) > sent_reasoning:
                yield self.event("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=0,
                                 content_index=0, delta=reasoning[sent_reasoning:])
                sent_reasoning = len(reasoning)
            if (text or final) and sent_text is None:
                if sent_reasoning is not None:   # the thinking is over: its item closes first
                    yield self.event("response.reasoning_text.done", item_id=self.reasoning_id, output_index=0,
                                     content_index=0, text=reasoning or "")
                    yield self.event("response.output_item.done", output_index=0,
                                     item=self.reasoning_item(reasoning or "", "completed"))
                sent_text = 0
                yield self.event("response.output_item.added", output_index=index,
                                 item=self.message_item(None, "in_progress"))
                yield self.event("response.content_part.added", item_id=self.message_id, output_index=index,
                                 content_index=0, part=_output_text(""))
            if sent_text is not None and len(text) > sent_text:
                yield self.event("response.output_text.delta", item_id=self.message_id, output_index=index,
                                 content_index=0, delta=text[sent_text:], logprobs=[])
                sent_text = len(text)
            if final:
                status, items, usage = self._finish(out)
                yield self.event("response.output_text.done", item_id=self.message_id, output_index=index,
                                 content_index=0, text=text, logprobs=[])
                yield self.event("response.content_part.done", item_id=self.message_id, output_index=index,
                                 content_index=0, part=_output_text(text))
                yield self.event("response.output_item.done", output_index=index, item=items[-1])
                yield self.event(f"response.{status}", response=self.response(status, items, usage))
                return


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
