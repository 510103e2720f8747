"""`shardserve` command line: serve, chat, generate, router, plan, doctor, bench and worker."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from shardserve.engine.cli_args import add_engine_args, add_parallel_args, engine_args_from
from shardserve.server.reasoning import PARSERS as REASONING_PARSERS


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=256)


def _make_llm(ns: argparse.Namespace):
    from shardserve.llm import LLM
    args = engine_args_from(ns)
    return LLM(**vars(args))


def cmd_chat(ns: argparse.Namespace) -> int:
    from shardserve.sampling_params import SamplingParams
    llm = _make_llm(ns)
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens)
    messages = [{"role": "system", "content": ns.system}] if ns.system else []
    if ns.message:
        messages.append({"role": "user", "content": ns.message})
        print(llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text)
        return 0
    print("Chatting with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line:
            return 0
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(f"assistant> {reply}")
        messages.append({"role": "assistant", "content": reply})


def cmd_generate(ns: argparse.Namespace) -> int:
    from shardserve.sampling_params import SamplingParams
    llm = _make_llm(ns)
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens)
    for out in llm.generate(ns.prompts, params):
        print(out.prompt + out.outputs[0].text)
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from shardserve.llm import _setup_logging
    from shardserve.server.run import run_server
    _setup_logging()
    configure_tracing(ns.otlp_traces_endpoint)   # before loading the model: a missing extra fails fast
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError(f"two models given: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    return run_server(engine_args_from(ns), host=ns.host, port=ns.port, served_model_name=ns.served_model_name,
                      api_key=ns.api_key or os.environ.get("SHARDSERVE_API_KEY") or None,
                      chat_template=ns.chat_template, generation_config=ns.generation_config,
                      override_generation_config=ns.override_generation_config,
                      max_log_len=ns.max_log_len, max_queue_len=ns.max_queue_len,
                      max_request_body_bytes=ns.max_request_body_bytes or None,
                      shutdown_timeout=ns.shutdown_timeout,
                      tool_call_parser=auto_tool_parser(ns.enable_auto_tool_choice, ns.tool_call_parser),
                      log_requests=ns.enable_log_requests, log_stats=not ns.disable_log_stats,
                      uvicorn_log_level=ns.uvicorn_log_level, reasoning_parser=ns.reasoning_parser,
                      app_options=dict(enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
                                       return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
                                       disable_fastapi_docs=ns.disable_fastapi_docs, root_path=ns.root_path),
                      cors=dict(allow_origins=ns.allowed_origins, allow_methods=ns.allowed_methods,
                                allow_headers=ns.allowed_headers, allow_credentials=ns.allow_credentials),
                      ssl=tls_settings(ns))


def tls_settings(ns: argparse.Namespace) -> dict | None:
    """uvicorn's TLS settings from the --ssl-* flags; None for plain HTTP. A key without its
    certificate (or the reverse) is refused here, not at the first connection."""
    if (ns.ssl_keyfile is None) != (ns.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both, or neither for plain HTTP")
    if ns.ssl_certfile is None:
        return None
    return dict(ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile, ssl_ca_certs=ns.ssl_ca_certs,
                ssl_cert_reqs=ns.ssl_cert_reqs)


def auto_tool_parser(enable: bool, parser: str | None) -> str | None:
    """The parser tool_choice "auto" uses, or None (auto off); vLLM's rules for the two flags."""
    if enable and parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or mistral)")
    return parser if enable else None


OTLP_HELP = ("send a trace span per request to this OTLP/HTTP collector, e.g. http://localhost:4318 "
             "(needs shardserve[otel]; default: no tracing)")


def configure_tracing(endpoint: str | None, service_name: str = "shardserve") -> None:
    if endpoint:
        from shardserve.server.tracing import configure
        configure(endpoint, service_name)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF checkpoint directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--config", default=None, help="YAML file of flag: value pairs; flags on the command "
                        "line win (default: none)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="default: %(default)s")
    g.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    g.add_argument("--served-model-name", nargs="+", default=None, help="the model id clients send; more names "
                   "are aliases, also accepted, responses carry the one asked for (default: the model path)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1, /tokenize and "
                   "/detokenize (default: $SHARDSERVE_API_KEY, else open)")
    g.add_argument("--chat-template", default=None, help="chat template file or inline Jinja (default: the model's)")
    g.add_argument("--generation-config", default="auto", help="'auto': sampling defaults from the model's "
                   "generation_config.json; 'vllm': none; or a folder holding one (default: %(default)s)")
    g.add_argument("--override-generation-config", default=None, help="JSON object of sampling defaults set over "
                   "--generation-config's, e.g. '{\"temperature\": 0.6}' (temperature, top_p, top_k, min_p, "
                   "repetition_penalty; default: none)")
    g.add_argument("--max-log-len", type=int, default=None, help="put at most this many prompt characters in "
                   "each request's log line (default: none; prompts are not logged unless asked)")
    g.add_argument("--max-request-body-bytes", type=int, default=32 * 1024 * 1024, help="refuse larger request "
                   "bodies with 413 (vLLM has no such limit; 0: none) (default: %(default)s)")
    g.add_argument("--max-queue-len", type=int, default=None, help="reject requests with 429 while this many are "
                   "waiting (default: queue without limit)")
    g.add_argument("--enable-auto-tool-choice", action="store_true", help="allow tool_choice \"auto\": the "
                   "model decides whether to call tools, read with --tool-call-parser (default: off; "
                   "\"required\" and named tool choices work without it)")
    g.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral"], default=None,
                   help="how the model writes tool calls, for tool_choice \"auto\" (default: none)")
    g.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                   help="a reasoning model's <think> block in the chat response's `reasoning` field (and "
                   "`reasoning_content`), the rest in `content`: deepseek_r1 (R1, its distills, QwQ) or qwen3 "
                   "(default: none; the thinking stays in content)")
    g.add_argument("--allowed-origins", type=json.loads, default=["*"], help="CORS: origins allowed, a JSON list "
                   "(default: [\"*\"])")
    g.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS: methods allowed, a JSON list "
                   "(default: [\"*\"])")
    g.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS: headers allowed, a JSON list "
                   "(default: [\"*\"])")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (default: off)")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key file (default: HTTP)")
    g.add_argument("--ssl-certfile", default=None, help="... and this certificate chain file (default: none)")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates for client certificates (default: none)")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, help="client certificates: 0 none, 1 optional, "
                   "2 required (Python's ssl.CERT_*) (default: %(default)s)")
    g.add_argument("--otlp-traces-endpoint", default=None, help=OTLP_HELP)
    g.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish "
                   "after SIGTERM (default: %(default)s)")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=True,
                   help="log one JSON line per finished request (default: on)")
    g.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="vLLM's older name for --no-enable-log-requests (default: off, the lines are logged)")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput / queue / KV cache line "
                   "(every $SHARDSERVE_LOG_STATS_INTERVAL s, default 10, while busy) (default: logged)")
    g.add_argument("--uvicorn-log-level", choices=["critical", "error", "warning", "info", "debug", "trace"],
                   default="info", help="uvicorn's own log level (default: %(default)s)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true", help="usage.prompt_tokens_details."
                   "cached_tokens: the prompt tokens the prefix cache held (default: off)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true", help="logprobs name each token "
                   "'token_id:N' instead of its text; a request's return_tokens_as_token_ids wins (default: off)")
    g.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json "
                   "(default: served)")
    g.add_argument("--root-path", default=None, help="the path prefix a proxy strips before requests reach the "
                   "server, for the OpenAPI document's links (default: none)")


LIST_FLAGS = ("--served-model-name",)   # flags taking several values (nargs="+"): a YAML list is those values


def config_file_args(argv: list[str]) -> list[str]:
    """Flags from a --config YAML file (keys are flag names), placed before argv so that flags on
    the command line win."""
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--config")
    path = peek.parse_known_args(argv)[0].config
    if path is None:
        return argv
    import yaml
    with open(path, encoding="utf-8") as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of flag names to values")
    extra: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if key in ("model", "model_tag"):
            extra += ["--model", str(value)]
        elif value is True:
            extra.append(flag)
        elif value is False:
            extra.append("--no-" + flag[2:])
        elif isinstance(value, list) and flag in LIST_FLAGS:
            extra += [flag, *map(str, value)]
        elif isinstance(value, (list, dict)):   # JSON-valued flags (--allowed-origins, --speculative-config)
            extra += [flag, json.dumps(value)]
        elif value is not None:
            extra += [flag, str(value)]
    return argv[:1] + extra + argv[1:]


def cmd_router(ns: argparse.Namespace) -> int:
    from shardserve.llm import _setup_logging
    from shardserve.router.run import run_router
    _setup_logging()
    configure_tracing(ns.otlp_traces_endpoint, "shardserve-router")
    return run_router(ns.config, ns.host, ns.port, ns.api_key or os.environ.get("SHARDSERVE_ROUTER_API_KEY") or None)


def cmd_worker(ns: argparse.Namespace) -> int:
    from shardserve.executor.headless import run_headless_node
    from shardserve.llm import _setup_logging
    _setup_logging()
    if ns.master_port is None:
        raise ValueError("--master-port is required: the port node 0 was started with")
    return run_headless_node(ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port,
                             ns.tensor_parallel_size * ns.pipeline_parallel_size,
                             connect_timeout_s=ns.distributed_timeout_s)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    from shardserve.planner.catalog import MODELS
    from shardserve.planner.hardware import GPUS, LINKS
    p.add_argument("model", metavar="MODEL", help=f"built-in name ({', '.join(MODELS)}), an HF config.json, "
                   "a checkpoint directory or a .gguf file")
    p.add_argument("--gpu", default=None, choices=list(GPUS), help="accelerator kind (default: h100-80gb)")
    p.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 80GiB; with --gpu, overrides its size "
                   "(default: the --gpu's)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="default: %(default)s")
    p.add_argument("--nodes", type=int, default=1, help="default: %(default)s")
    p.add_argument("--interconnect", action="append", default=[], metavar="LINK",
                   help=f"{', '.join(LINKS)}; nvlink/pcie* name the link inside a node, the others the one "
                   "between nodes; repeat or comma-separate for both (default: nvlink (pcie4 for l40s/rtx4090), "
                   "ib-ndr)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32", "fp8", "int8", "int4", "fp4"],
                   help="weight dtype (default: auto, the checkpoint's own; fp4: NVFP4 held 4-bit, "
                   "SHARDSERVE_FP4_KERNELS=1)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32", "fp8", "fp8_e4m3"],
                   help="default: auto, the activation dtype")
    p.add_argument("--max-model-len", type=int, default=None, help="tokens per request (default: the model's)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests of --max-model-len tokens that must fit at once (default: %(default)s)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="default: %(default)s")
    p.add_argument("--profile", default=None, metavar="DOCTOR_JSON",
                   help="measured bandwidths and latencies from `shardserve doctor --json` (default: built-in table)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (default: tables)")
    p.add_argument("--emit", nargs=2, metavar=("k8s", "DIR"), default=None,
                   help="also write Kubernetes manifests for the recommended layout into DIR (docs/deploy.md)")
    p.add_argument("--emit-model", default=None, help="the --model the pods serve (default: MODEL)")
    p.add_argument("--emit-image", default="shardserve:cuda", help="default: %(default)s")


def cmd_plan(ns: argparse.Namespace) -> int:
    import json

    from shardserve.planner import plan_from_options
    from shardserve.planner.report import format_plan
    plan = plan_from_options(ns.model, gpu=ns.gpu, gpu_memory=ns.gpu_memory, gpus_per_node=ns.gpus_per_node,
                             nodes=ns.nodes, interconnect=ns.interconnect, dtype=ns.dtype,
                             kv_cache_dtype=ns.kv_cache_dtype, max_model_len=ns.max_model_len,
                             concurrency=ns.concurrency, gpu_memory_utilization=ns.gpu_memory_utilization,
                             profile=ns.profile)
    print(json.dumps(plan, indent=1) if ns.json else format_plan(plan))
    if ns.emit:
        from shardserve.planner.k8s import emit
        emit(plan, ns.emit, ns.emit_model or ns.model, ns.emit_image)
    return 0


def add_doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, metavar="PATH", help="write the checks and a profile for "
                   "`shardserve plan --profile` here (default: none)")
    p.add_argument("--peers", default=None, metavar="HOST:PORT,...", help="every node of the cluster, the same "
                   "list on each; the first is the rendezvous; adds a cross-node all-reduce (default: none)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's index in --peers (default: found "
                   "from this machine's addresses)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for each benchmark (default: %(default)s)")


def cmd_doctor(ns: argparse.Namespace) -> int:
    from shardserve.doctor import run_doctor
    return run_doctor(json_path=ns.json, peers=ns.peers, node_rank=ns.node_rank, timeout=ns.timeout)


def build_parser() -> argparse.ArgumentParser:
    from shardserve import __version__
    parser = argparse.ArgumentParser(prog="shardserve", description="Serve large language models across accelerators.")
    parser.add_argument("--version", action="version", version=f"shardserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default model: the embedded SmolLM2)")
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    chat = sub.add_parser("chat", help="chat with a model in the terminal (default: the embedded SmolLM2)")
    add_engine_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--message", default=None, help="ask one question, print the answer and exit")
    chat.set_defaults(func=cmd_chat)
    gen = sub.add_parser("generate", help="complete raw prompts (no chat template)")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.add_argument("prompts", nargs="+")
    gen.set_defaults(func=cmd_generate)
    router = sub.add_parser("router", help="OpenAI-compatible semantic router with fusion panels")
    router.add_argument("--config", required=True, help="router YAML (vLLM Semantic Router shape)")
    router.add_argument("--host", default="0.0.0.0", help="default: %(default)s")
    router.add_argument("--port", type=int, default=9000, help="default: %(default)s")
    router.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 "
                        "(default: $SHARDSERVE_ROUTER_API_KEY, else open)")
    router.add_argument("--otlp-traces-endpoint", default=None, help=OTLP_HELP)
    router.set_defaults(func=cmd_router)
    plan = sub.add_parser("plan", help="what fits where: layouts, memory, KV cache and predicted decode speed")
    add_plan_args(plan)
    plan.set_defaults(func=cmd_plan)
    doctor = sub.add_parser("doctor", help="check GPUs, links, RDMA and NCCL settings; measure all-reduce")
    add_doctor_args(doctor)
    doctor.set_defaults(func=cmd_doctor)
    from shardserve.bench.cli import add_bench_commands
    add_bench_commands(sub)
    worker = sub.add_parser("worker", help="run a headless node (node_rank > 0) of a multi-node engine")
    add_parallel_args(worker, engine=False)
    worker.set_defaults(func=cmd_worker)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["serve"]:
            argv = config_file_args(argv)
    except (ValueError, OSError) as e:
        print(f"error: --config: {e}", file=sys.stderr)
        return 2
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TimeoutError as e:   # a peer that never came (multi-node rendezvous): the message names it
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
