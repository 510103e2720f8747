"""`shardserve bench serve`: online serving benchmark against any OpenAI-compatible server, shaped
like `vllm bench serve` (same flags, same summary, same metric names).

Every request streams, so TTFT (time to the first content), ITL (gaps between content chunks),
TPOT ((E2EL - TTFT) / (output tokens - 1)) and E2EL are measured from the client; token counts come
from the server's usage block (stream_options.include_usage), else from the chunks.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from shardserve.bench.datasets import BenchRequest
from shardserve.server.protocol import sse_data


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)


def _payload(endpoint: str, model: str, req: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def send_one(client, url: str, headers: dict[str, str], body: dict[str, Any],
                   req: BenchRequest) -> RequestResult:
    result = RequestResult(prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
                return result
            async for data in sse_data(resp.content):
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"].get("completion_tokens", result.output_tokens)
                    result.prompt_len = event["usage"].get("prompt_tokens", result.prompt_len)
                choices = event.get("choices") or []
                if not choices:
                    continue
                c = choices[0]
                text = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if text:
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
        result.e2el = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.success = True
    except Exception as e:   # a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_benchmark(base_url: str, endpoint: str, model: str, requests: list[BenchRequest],
                        request_rate: float, max_concurrency: int | None, ignore_eos: bool, seed: int,
                        api_key: str | None = None, show_progress: bool = True) -> tuple[list[RequestResult], float]:
    import aiohttp
    from tqdm.auto import tqdm
    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc="Requests", unit="req", disable=not show_progress)
    connector = aiohttp.TCPConnector(limit=max_concurrency or len(requests) or 1)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None, connect=30)) as client:
        async def one(req: BenchRequest) -> RequestResult:
            body = _payload(endpoint, model, req, ignore_eos)
            if limit is None:
                res = await send_one(client, url, headers, body, req)
            else:
                async with limit:
                    res = await send_one(client, url, headers, body, req)
            bar.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        for req in requests:   # Poisson arrivals at request_rate; all at once when it is inf
            tasks.append(asyncio.create_task(one(req)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def summarize(results: list[RequestResult], duration: float, percentiles=(50, 99)) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "errors": sorted({r.error for r in results if not r.success})[:5],
    }
    series = {"ttft": [r.ttft for r in ok], "e2el": [r.e2el for r in ok],
              "tpot": [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
              "itl": [gap for r in ok for gap in r.itl]}
    for name, values in series.items():
        arr = np.array(values or [0.0]) * 1000
        summary[f"mean_{name}_ms"] = float(arr.mean())
        summary[f"median_{name}_ms"] = float(np.median(arr))
        for p in percentiles:
            summary[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))
    return summary


def print_summary(s: dict[str, Any], percentiles=(50, 99)) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration']:.2f}"), ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    for label, value in rows:
        print(f"{label:<40}{value:<10}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key, title in titles.items():
        print("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        upper = key.upper()
        print(f"{'Mean ' + upper + ' (ms):':<40}{s[f'mean_{key}_ms']:<10.2f}")
        print(f"{'Median ' + upper + ' (ms):':<40}{s[f'median_{key}_ms']:<10.2f}")
        for p in percentiles:
            if p != 50:
                print(f"{f'P{p} ' + upper + ' (ms):':<40}{s[f'p{p}_{key}_ms']:<10.2f}")
    if s["errors"]:
        print("Errors (first kinds):", *s["errors"], sep="\n  ")
    print("=" * w)


def save_result(summary: dict[str, Any], args: dict[str, Any], results: list[RequestResult], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**summary, "args": args, "requests": [asdict(r) for r in results]}, f, indent=1)
