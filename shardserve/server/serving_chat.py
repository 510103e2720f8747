"""POST /v1/chat/completions: messages through the chat template, then one engine request."""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from starlette.requests import Request

from shardserve.outputs import CompletionOutput
from shardserve.sampling_params import InvalidParameter
from shardserve.server.protocol import APIError, ChatCompletionRequest, ChatMessage
from shardserve.server.reasoning import ReasoningParser
from shardserve.server.serving import Serving, TokenNamer, now_s, sse, usage
from shardserve.server.tool_parsers import ToolCall
from shardserve.server.tools import ToolPlan, plan_tools


def _logprob_entry(name: TokenNamer, token_id: int, lp) -> dict[str, Any]:
    text = name(token_id, lp)
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(name: TokenNamer, c: CompletionOutput, start: int, top: int) -> list[dict[str, Any]]:
    """OpenAI's logprobs.content entries for output tokens [start:]."""
    content = []
    for tid, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:len(c.token_ids)]):
        item = _logprob_entry(name, tid, entry[tid])
        ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)
        item["top_logprobs"] = [_logprob_entry(name, t, lp) for t, lp in ranked[:top]]
        content.append(item)
    return content


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as HF chat templates expect it: tool calls' arguments as objects, not JSON text."""
    msg: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        msg["name"] = m.name
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
            calls.append({**call, "function": fn, "type": call.get("type", "function")})
        msg["tool_calls"] = calls
    return msg


def tool_call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's streamed shape: per call, first index + id + name, then the arguments."""
    deltas = []
    for i, call in enumerate(calls):
        deltas.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
    return deltas


class ChatServing(Serving):
    async def render(self, messages: list[ChatMessage], add_generation_prompt: bool, continue_final: bool,
                     chat_template: str | None, kwargs: dict[str, Any] | None,
                     tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        """The prompt text and its token ids (the template writes any BOS itself)."""
        self.check_tokenizer()
        conv = [template_message(m) for m in messages]
        template = chat_template or self.settings.chat_template
        try:
            text = await asyncio.to_thread(self.tokenizer.apply_chat_template, conv,
                                           add_generation_prompt and not continue_final, template, tools=tools,
                                           **(kwargs or {}))
        except Exception as e:   # a template that raises (e.g. roles out of order) is the request's fault
            raise APIError(400, f"the chat template failed on these messages: {e}", "messages") from e
        if continue_final:   # leave the last message open so the model continues it
            last = conv[-1]["content"]
            cut = text.rfind(last)
            if last and cut >= 0:
                text = text[:cut + len(last)]
        return text, await self.encode(text, add_special_tokens=False)

    async def create(self, req: ChatCompletionRequest, raw: Request) -> dict[str, Any] | AsyncIterator[str]:
        model = self.check_model(req.model)
        try:
            plan = plan_tools(req.tools, req.tool_choice, self.settings.tool_call_parser)
        except InvalidParameter as e:
            raise APIError(400, str(e), e.param) from e
        if plan.schema is not None:
            req._tool_spec = plan.structured_spec()
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        self.check_ready(raw)
        text, ids = await self.render(req.messages, req.add_generation_prompt, req.continue_final_message,
                                      req.chat_template, req.chat_template_kwargs, plan.template_tools)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.max_tokens_for(len(ids), requested, param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req.sampling_params, max_tokens, logprobs)
        request_id = raw.state.request_id
        streams = await self.start_all(raw, [{"prompt": text, "prompt_token_ids": ids}], params, req)
        meta = {"id": f"chatcmpl-{request_id}", "created": now_s(), "model": model}
        parser = (ReasoningParser(self.settings.reasoning_parser, text) if self.settings.reasoning_parser
                  else None)
        if req.stream:
            return self.sse_errors(self._stream(req, streams, meta, plan, parser))
        (out,) = await self.collect(streams, raw)
        choices = []
        for c in out.outputs:
            lp = {"content": chat_logprobs(self.namer(req), c, 0, req.top_logprobs or 0)} if req.logprobs else None
            reasoning, text = parser.split(c.text) if parser else (None, c.text)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning is not None:   # vLLM's field, and its older name
                message.update(reasoning=reasoning, reasoning_content=reasoning, content=text or None)
            finish = c.finish_reason
            if plan.active:
                content, calls = plan.extract(text)
                message["tool_calls"] = [call.to_openai() for call in calls]
                if calls:
                    message["content"] = content
                    finish = "tool_calls"
            choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish,
                            "stop_reason": c.stop_reason})
        return {**meta, "object": "chat.completion", "choices": choices,
                "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                               self.cached([out]))}

    async def _stream(self, req: ChatCompletionRequest, streams, meta: dict, plan: ToolPlan,
                      parser: ReasoningParser | None) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
        sent_text: dict[int, int] = {}   # of the content (the text after any reasoning)
        sent_tokens: dict[int, int] = {}
        sent_reasoning: dict[int, int] = {}
        prompt_tokens, cached = 0, None   # of the latest output
        name = self.namer(req)

        def chunk(choices: list[dict], extra: dict | None = None) -> str:
            return sse({**meta, "object": "chat.completion.chunk", "choices": choices, **(extra or {})})

        async for _, out in self.merged(streams):
            prompt_tokens, cached = len(out.prompt_token_ids), self.cached([out])
            for c in out.outputs:
                if c.index not in sent_text:   # OpenAI opens every choice with the role
                    sent_text[c.index] = sent_tokens[c.index] = sent_reasoning[c.index] = 0
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                elif sent_text[c.index] < 0:   # this choice already finished
                    continue
                # With a reasoning parser, the thinking goes out as `reasoning` deltas and the rest
                # as the content below; text that may still be a tag waits for the next tokens.
                reasoning, text = (parser.split(c.text, c.finish_reason is not None) if parser
                                   else (None, c.text))
                think: dict[str, str] = {}
                if reasoning is not None and len(reasoning) > sent_reasoning[c.index]:
                    new = reasoning[sent_reasoning[c.index]:]
                    think, sent_reasoning[c.index] = {"reasoning": new, "reasoning_content": new}, len(reasoning)
                delta = text[sent_text[c.index]:]
                start = sent_tokens[c.index]
                new_sent = len(text)
                if plan.active:   # text that may begin a tool call is held back; calls go out when the choice ends
                    sent = sent_text[c.index]
                    if c.finish_reason is None:
                        new_sent = max(sent, plan.content_end(text))
                        delta = text[sent:new_sent]
                        if not delta and not think:
                            continue
                    else:
                        content, calls = plan.extract(text[sent:])
                        if calls:   # content (if any), then each call: id + name, then its arguments
                            deltas = (([think] if think else []) + ([{"content": content}] if content else [])
                                      + tool_call_deltas(calls))
                            for d in deltas[:-1]:
                                yield chunk([{"index": c.index, "delta": d, "logprobs": None,
                                              "finish_reason": None}])
                            sent_text[c.index], sent_tokens[c.index] = -1, len(c.token_ids)
                            lp = ({"content": chat_logprobs(name, c, start, req.top_logprobs or 0)}
                                  if req.logprobs else None)
                            yield chunk([{"index": c.index, "delta": deltas[-1], "logprobs": lp,
                                          "finish_reason": "tool_calls", "stop_reason": c.stop_reason}])
                            continue
                if not delta and not think and c.finish_reason is None and len(c.token_ids) == start:
                    continue
                lp = ({"content": chat_logprobs(name, c, start, req.top_logprobs or 0)}
                      if req.logprobs else None)
                sent_text[c.index] = -1 if c.finish_reason is not None else new_sent
                sent_tokens[c.index] = len(c.token_ids)
                extra = {"usage": usage(prompt_tokens, sum(sent_tokens.values()), cached)} if continuous else None
                fields = {**think, **({"content": delta} if delta else {})}
                yield chunk([{"index": c.index, "delta": fields, "logprobs": lp, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason}], extra)
        if include_usage:
            yield chunk([], {"usage": usage(prompt_tokens, sum(sent_tokens.values()), cached)})
        yield sse("[DONE]")
