"""`shardserve bench serve | latency | throughput`: argument parsing and the commands' entry points."""
from __future__ import annotations

import argparse
import os


def cmd_bench_serve(ns: argparse.Namespace) -> int:
    import asyncio
    import json
    import urllib.request

    from shardserve.bench import serve as bench
    from shardserve.bench.datasets import random_requests
    base_url = ns.base_url or f"http://{ns.host}:{ns.port}"
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    model = ns.model
    if model is None:   # like vllm bench serve: the server's first model
        with urllib.request.urlopen(urllib.request.Request(base_url + "/v1/models", headers=headers), timeout=30) as r:
            model = json.load(r)["data"][0]["id"]
    tokenizer = _bench_tokenizer(ns.tokenizer, model)
    requests = random_requests(ns.num_prompts, ns.random_input_len, ns.random_output_len, ns.random_range_ratio,
                               ns.seed, tokenizer)
    percentiles = sorted({50, *(float(p) if "." in p else int(p) for p in ns.metric_percentiles.split(","))})
    print(f"Benchmarking {model} at {base_url}{ns.endpoint}: {ns.num_prompts} prompts, request rate "
          f"{ns.request_rate}, max concurrency {ns.max_concurrency}")
    if ns.profile:
        _post_profile(base_url, "/start_profile", headers)
    results, duration = asyncio.run(bench.run_benchmark(base_url, ns.endpoint, model, requests, ns.request_rate,
                                                        ns.max_concurrency, ns.ignore_eos, ns.seed, ns.api_key))
    if ns.profile:
        for path in _post_profile(base_url, "/stop_profile", headers)["traces"]:
            print(f"profile trace: {path}")
    summary = bench.summarize(results, duration, percentiles)
    bench.print_summary(summary, percentiles)
    if ns.save_result:
        import time
        name = ns.result_filename or f"shardserve-bench-serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path = os.path.join(ns.result_dir or ".", name)
        bench.save_result(summary, {k: v for k, v in vars(ns).items() if k != "func"}, results, path)
        print(f"saved {path}")
    return 0 if summary["completed"] else 1


def _post_profile(base_url: str, route: str, headers: dict[str, str]) -> dict:
    import json
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(urllib.request.Request(base_url + route, data=b"", headers=headers,
                                                           method="POST"), timeout=600) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise ValueError(f"{base_url} has no {route}: start the server with SHARDSERVE_TORCH_PROFILER_DIR "
                             "(or VLLM_TORCH_PROFILER_DIR) set to use --profile") from None
        raise
    return json.loads(body) if body else {}


def _bench_tokenizer(path: str | None, model: str):
    from shardserve.models.loader import default_model_path
    from shardserve.server.run import DEFAULT_MODEL_NAME
    from shardserve.tokenizer.tokenizer import Tokenizer
    if path is None:
        if model != DEFAULT_MODEL_NAME:
            raise ValueError(f"pass --tokenizer (an HF checkpoint directory or GGUF file) for {model!r}: random "
                             "prompts are built from its vocabulary")
        path = default_model_path()
    return Tokenizer.from_path(path)


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None,
                   help="server root, e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model id to send (default: the server's first model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer for random prompts: HF directory or GGUF "
                   "(default: the embedded SmolLM2's when benchmarking it)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--profile", action="store_true", help="torch-profile the server's workers during the run "
                   "(POST /start_profile and /stop_profile; the server needs SHARDSERVE_TORCH_PROFILER_DIR set)")
    p.add_argument("--dataset-name", default="random", choices=["random"])
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)] (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length (vLLM extension)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 90,99 (default: %(default)s)")
    p.add_argument("--save-result", action="store_true", help="write the summary and per-request results as JSON")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)


def cmd_bench_offline(ns: argparse.Namespace) -> int:
    import json

    from shardserve.bench import offline
    from shardserve.llm import _setup_logging
    _setup_logging()
    result = offline.run_latency(ns) if ns.bench_command == "latency" else offline.run_throughput(ns)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({**result, "args": {k: v for k, v in vars(ns).items() if k != "func"}}, f, indent=1)
    return 0


def add_bench_offline_args(p: argparse.ArgumentParser, latency: bool) -> None:
    from shardserve.bench.shapes import SHAPES
    p.add_argument("--model", default=None, help="checkpoint directory or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--random-weights", default=None, metavar="SHAPE",
                   help=f"full-size random weights with a real shape: {', '.join(SHAPES)}, or a config.json / "
                   "checkpoint directory (default: off)")
    p.add_argument("--dtype", default="auto", help="default: %(default)s")
    p.add_argument("--device", default="auto", help="default: %(default)s")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="default: %(default)s")
    p.add_argument("--quantization", "-q", choices=["fp8", "gptq", "awq", "fp8-block"], default=None,
                   help="fp8: quantize the weights at load; gptq/awq: random INT4 weights of that format, fp8-block: "
                   "random FP8 weights with 128 x 128 block scales (with --random-weights) (default: as the "
                   "checkpoint stores them)")
    p.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                   help="MoE models: whole experts per TP rank instead of every expert sliced (default: off)")
    p.add_argument("--input-len", type=int, default=32 if latency else 1024, help="default: %(default)s")
    p.add_argument("--output-len", type=int, default=128, help="default: %(default)s")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--max-num-seqs", type=int, default=256, help="default: %(default)s")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: 2048")
    p.add_argument("--kv-cache-memory", default=None, help="CPU KV budget, e.g. 4GiB (default: 4GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="default: %(default)s")
    p.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no graphs for decode steps (default: off)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                   help="fp8: an E4M3 KV cache, half the bytes of bf16 (default: %(default)s)")
    p.add_argument("--cpu-offload-gb", type=float, default=0.0,
                   help="CUDA: GiB of weights per GPU streamed from pinned CPU memory; latency then also "
                   "reports the host-to-device copy bound (default: %(default)s)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=not latency,
                   help="latency sends the same prompts every iteration, so caching would turn every prefill after "
                        "the first into a cache hit (default: %(default)s)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs (default: on for CUDA)")
    p.add_argument("--output-json", default=None, help="write the results here (default: none)")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler traces of every worker (needs SHARDSERVE_TORCH_PROFILER_DIR): latency runs one "
                        "more batch under it after the timed ones; throughput profiles the timed run itself")
    if latency:
        p.add_argument("--batch-size", type=int, default=8, help="default: %(default)s")
        p.add_argument("--num-iters-warmup", type=int, default=3, help="default: %(default)s")
        p.add_argument("--num-iters", type=int, default=10, help="default: %(default)s")
    else:
        p.add_argument("--num-prompts", type=int, default=1000, help="default: %(default)s")
        p.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="lengths uniform in [len * (1 - r), len * (1 + r)] (default: %(default)s)")



def add_bench_commands(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    bench_serve = bench.add_parser("serve", help="online benchmark against an OpenAI-compatible server "
                                   "(like vllm bench serve)")
    add_bench_serve_args(bench_serve)
    bench_serve.set_defaults(func=cmd_bench_serve)
    for name, latency in (("throughput", False), ("latency", True)):
        offline = bench.add_parser(name, help=f"offline {name} beside the measured roofline (like vllm bench {name})")
        add_bench_offline_args(offline, latency)
        offline.set_defaults(func=cmd_bench_offline)
