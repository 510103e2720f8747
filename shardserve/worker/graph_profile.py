"""Where a decode step's device time goes: one captured decode graph replayed on its own, timed
with CUDA events, and its kernels listed by the torch profiler. Every rank runs it at once (through
`collective_rpc("profile_decode_graph")`), since TP graphs meet at their all-reduces. Used by
benchmarks/graph_replay_time.py; no requests are needed, as attention's cost depends on lengths,
not contents: every row reads the null block `context` times and writes its K/V into the scratch
slot, so no request's cache is touched."""
from __future__ import annotations

from typing import Any

import torch


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Milliseconds per replay of a captured graph, between two CUDA events (after one warm replay)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def graph_call_ms(fn, calls: int, replays: int = 10, warmups: int = 2) -> float:
    """Milliseconds per call of fn(i), i = 0..calls-1, captured in one CUDA graph and replayed (the
    kernel benchmarks: a call per weight copy, so each reads from memory, not the L2). Warm-up calls
    run first on a side stream, outside the capture (compiles, allocator, collective buffers)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(calls, warmups)):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return replay_ms(graph, replays) / calls


def profile_decode_graph(graphs, batch_size: int, context: int = 256, replays: int = 20) -> dict[str, Any]:
    if graphs is None:
        raise RuntimeError("no decode graphs on this rank (CPU, --enforce-eager, or pipeline parallelism)")
    batch = next(s for s in graphs.sizes if s >= batch_size)
    graph = graphs.graphs[batch]
    with torch.inference_mode():
        graphs.seq_lens[:batch].fill_(context)
        graphs.tokens.slots[:batch].fill_(graphs.tokens.scratch_slot)
        graphs.block_tables[:batch].zero_()
    try:
        ms = replay_ms(graph, replays)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                graph.replay()
            torch.cuda.synchronize()
    finally:
        with torch.inference_mode():
            graphs.seq_lens[:batch].fill_(1)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels = sorted(((e.key, e.device_time_total / 10 / 1000, e.count // 10) for e in events), key=lambda k: -k[1])
    return {"graph_batch": batch, "context": context, "replay_ms": ms,
            "kernels_per_replay": sum(k[2] for k in kernels), "kernel_ms": sum(k[1] for k in kernels),
            "kernels": [{"name": n, "ms": ms, "count": c} for n, ms, c in kernels]}
