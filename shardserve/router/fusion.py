"""Fusion panels: several backends answer the same request concurrently, a judge analyses the
answers (consensus, contradictions, unique insights, blind spots; JSON), then writes one final
answer from the request, the answers and the analysis. The synthesis can stream token by token."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from shardserve.router.backends import BackendError, BackendPool
from shardserve.router.config import FusionSettings
from shardserve.router.signals import message_text

DEPTH_HEADER = "x-vsr-fusion-depth"

ANALYSIS_TEMPLATE = """You are the judge of a panel of AI assistants that answered the same request.

Request:
{request}

Panel answers:
{responses}

Compare the answers. Reply with one JSON object and nothing else, with the keys "consensus" (points \
the answers agree on), "contradictions" (points where they disagree, and which side is better \
supported), "unique_insights" (valuable points only one answer makes) and "blind_spots" (what every \
answer missed)."""

SYNTHESIS_TEMPLATE = """Several AI assistants answered the user's request below, and a judge analysed \
their answers. Use both to write the single best answer to the request. Do not mention the panel, \
the assistants or the analysis.

Panel answers:
{responses}

Analysis:
{analysis}"""

# Fields that must not reach panel members: tools run once, on the final call; streaming is ours.
_PANEL_DROP = ("tools", "tool_choice", "functions", "function_call", "stream", "stream_options", "plugins", "n")


class FusionError(Exception):
    """The panel could not produce enough answers (or a member failed with on_error: fail)."""

    def __init__(self, message: str, failures: dict[str, str]) -> None:
        super().__init__(message)
        self.failures = failures


@dataclass
class PanelResult:
    id: str
    content: str | None = None
    latency_ms: float = 0.0
    usage: dict[str, int] | None = None
    error: str | None = None


@dataclass
class FusionTrace:
    decision: str | None
    judge_model: str
    panel_results: list[PanelResult] = field(default_factory=list)
    analysis: Any = None

    def as_dict(self, include_responses: bool = True) -> dict[str, Any]:
        panel = [vars(r) if include_responses else {**vars(r), "content": None} for r in self.panel_results]
        return {"decision": self.decision, "panel_results": panel,
                "failed_models": [r.id for r in self.panel_results if r.error is not None],
                "judge_model": self.judge_model, "analysis": self.analysis}


def add_usage(total: dict[str, int], usage: dict[str, Any] | None) -> None:
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        value = (usage or {}).get(key)
        if isinstance(value, int):
            total[key] = total.get(key, 0) + value


def _conversation(messages: list[dict[str, Any]]) -> str:
    return "\n\n".join(f"{m.get('role', 'user')}: {message_text(m)}" for m in messages)


def _answers(results: list[PanelResult]) -> str:
    ok = [r for r in results if r.error is None]
    return "\n\n".join(f"[Answer {i + 1}]\n{r.content}" for i, r in enumerate(ok))


class FusionRunner:
    def __init__(self, pool: BackendPool, on_member_failure=None) -> None:
        self.pool = pool
        self.on_member_failure = on_member_failure   # (backend id) -> None, for metrics

    async def run_panel(self, settings: FusionSettings, body: dict[str, Any], headers: dict[str, str],
                        trace: FusionTrace) -> None:
        """Fill trace.panel_results; raise FusionError when the panel cannot go on."""
        members = settings.analysis_models
        # Without min_successful_responses every member is awaited and, with on_error: skip, the
        # panel goes on with whoever answered; with it, the panel stops as soon as that many have.
        quorum = settings.min_successful_responses or len(members)
        limit = asyncio.Semaphore(settings.max_concurrent or len(members))
        panel_body = {k: v for k, v in body.items() if k not in _PANEL_DROP}
        results = {m: PanelResult(m) for m in members}
        enough = asyncio.Event()

        async def ask(member: str) -> None:
            result = results[member]
            async with limit:
                start = time.perf_counter()
                try:
                    data = await self.pool.chat(member, {**panel_body, **settings.analysis_overrides.get(member, {})},
                                                headers)
                    result.content = data["choices"][0]["message"].get("content") or ""
                    result.usage = data.get("usage")
                except BackendError as e:
                    result.error = e.message
                    if self.on_member_failure is not None:
                        self.on_member_failure(member)
                finally:
                    result.latency_ms = round((time.perf_counter() - start) * 1000, 2)
            if result.error is not None and settings.on_error == "fail":
                raise FusionError(f"panel member {member!r} failed: {result.error} (on_error: fail)",
                                  {member: result.error})
            if sum(r.content is not None for r in results.values()) >= quorum:
                enough.set()

        tasks = {asyncio.create_task(ask(m)): m for m in members}
        waiter = asyncio.create_task(enough.wait())
        try:
            pending = set(tasks)
            deadline = None if settings.round_timeout_seconds is None else (
                asyncio.get_running_loop().time() + settings.round_timeout_seconds)
            while pending and not enough.is_set():
                timeout = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
                done, _ = await asyncio.wait(pending | {waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if not done:   # the round timed out: whatever is still running failed
                    late = [tasks[t] for t in pending]
                    error = f"no answer within round_timeout_seconds={settings.round_timeout_seconds:g}"
                    for member in late:
                        results[member].error = error
                    if settings.on_error == "fail":   # a stalled member fails the panel like a broken one
                        raise FusionError(f"panel member {', '.join(map(repr, late))} failed: {error} "
                                          "(on_error: fail)", {m: error for m in late})
                    break
                for t in done - {waiter}:
                    pending.discard(t)
                    t.result()   # re-raises FusionError for on_error: fail
        finally:
            for t in list(tasks) + [waiter]:   # stragglers past the quorum are cancelled
                t.cancel()
            await asyncio.gather(*tasks, waiter, return_exceptions=True)
        for member, r in results.items():
            if r.content is None and r.error is None:
                r.error = "cancelled: the quorum was already met"
        trace.panel_results = [results[m] for m in members]
        ok = sum(r.content is not None for r in trace.panel_results)
        failures = {r.id: r.error for r in trace.panel_results if r.error is not None and r.content is None}
        if ok == 0:
            raise FusionError("every panel member failed: " + "; ".join(f"{k}: {v}" for k, v in failures.items()),
                              failures)
        if settings.min_successful_responses is not None and ok < quorum:
            raise FusionError(f"only {ok} of {len(members)} panel members answered; min_successful_responses is "
                              f"{quorum}: " + "; ".join(f"{k}: {v}" for k, v in failures.items()), failures)

    async def analyse(self, settings: FusionSettings, body: dict[str, Any], headers: dict[str, str],
                      trace: FusionTrace, usage: dict[str, int]) -> None:
        prompt = (settings.analysis_template or ANALYSIS_TEMPLATE).replace("{request}", _conversation(
            body["messages"])).replace("{responses}", _answers(trace.panel_results))
        call: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "temperature": 0}
        budget = body.get("max_completion_tokens") or body.get("max_tokens")
        if budget:   # the request's own budget bounds the analysis too
            call["max_tokens"] = budget
        data = await self.pool.chat(settings.judge_model, call, headers)
        add_usage(usage, data.get("usage"))
        text = data["choices"][0]["message"].get("content") or ""
        trace.analysis = _parse_analysis(text)

    def synthesis_body(self, settings: FusionSettings, body: dict[str, Any], trace: FusionTrace) -> dict[str, Any]:
        analysis = trace.analysis if isinstance(trace.analysis, str) else json.dumps(trace.analysis, indent=1)
        instructions = (settings.synthesis_template or SYNTHESIS_TEMPLATE) \
            .replace("{request}", _conversation(body["messages"])) \
            .replace("{responses}", _answers(trace.panel_results)).replace("{analysis}", analysis)
        final = {k: v for k, v in body.items() if k not in ("plugins", "n")}   # tools stay on the final call
        final["messages"] = [{"role": "system", "content": instructions}] + list(body["messages"])
        return final


def _parse_analysis(text: str) -> Any:
    """The judge's JSON object, also when wrapped in a code fence or prose; otherwise the text."""
    start, end = text.find("{"), text.rfind("}")
    if start != -1 and end > start:
        try:
            value = json.loads(text[start:end + 1])
            if isinstance(value, dict):
                return value
        except ValueError:
            pass
    return text
