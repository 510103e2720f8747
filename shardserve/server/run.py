"""`shardserve serve`: build the engine, wrap it for asyncio, serve the app with uvicorn.

SIGTERM (and Ctrl-C) drain the server (server/drain.py): new requests and /health get 503, in-flight
requests get up to --shutdown-timeout seconds to finish, then uvicorn closes the socket, the engine
and its workers stop and the process exits 0.
"""
from __future__ import annotations

import json
import logging
import os
import signal
from typing import Any

from shardserve.engine.args import EngineArgs
from shardserve.engine.async_engine import AsyncLLMEngine
from shardserve.engine.create import create_engine
from shardserve.server.serving import ServerSettings

logger = logging.getLogger("shardserve")

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_chat_template(value: str | None) -> str | None:
    """--chat-template takes a file path or the template itself, as vLLM's does."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def parse_generation_override(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """--override-generation-config: a JSON object (or a dict, from a config file or Python) of
    sampling defaults; refused here, before the model loads, if it is anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--override-generation-config is not valid JSON: {e}") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"--override-generation-config takes a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(_SAMPLING_DEFAULTS))
    if unknown:
        raise ValueError(f"--override-generation-config: {', '.join(unknown)} cannot be set; these can: "
                         f"{', '.join(_SAMPLING_DEFAULTS)}")
    return value


def generation_defaults(setting: str, model_dir: str, override: dict[str, Any] | None = None) -> dict[str, Any]:
    """Sampling defaults for fields a request leaves unset: 'auto' reads the model's
    generation_config.json (as vLLM does), 'vllm' uses none, anything else is a folder holding one;
    then `override` (parse_generation_override's) sets or replaces any of them."""
    defaults = {}
    folder = model_dir if setting == "auto" else setting
    path = os.path.join(folder, "generation_config.json")
    if setting != "vllm" and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        defaults = {k: config[k] for k in _SAMPLING_DEFAULTS if k in config}
    elif setting not in ("vllm", "auto"):
        raise ValueError(f"--generation-config {setting!r}: no generation_config.json there")
    return {**defaults, **(override or {})}


def run_server(engine_args: EngineArgs, host: str = "0.0.0.0", port: int = 8000,
               served_model_name: str | list[str] | None = None,
               api_key: str | None = None, chat_template: str | None = None, generation_config: str = "auto",
               override_generation_config: str | dict[str, Any] | None = None,
               max_log_len: int | None = None, max_queue_len: int | None = None,
               max_request_body_bytes: int | None = 32 * 1024 * 1024,
               shutdown_timeout: float = 30.0, uvicorn_log_level: str = "info",
               tool_call_parser: str | None = None, log_requests: bool = True, log_stats: bool = True,
               reasoning_parser: str | None = None, cors: dict[str, Any] | None = None,
               ssl: dict[str, Any] | None = None, app_options: dict[str, Any] | None = None) -> int:
    """ssl: uvicorn's ssl_keyfile, ssl_certfile, ssl_ca_certs, ssl_cert_reqs (serve HTTPS);
    app_options: more ServerSettings fields (enable_prompt_tokens_details, return_tokens_as_token_ids,
    disable_fastapi_docs, root_path)."""
    import uvicorn

    from shardserve.server.api import build_app
    from shardserve.server.drain import DrainGate, DrainingServer
    template = read_chat_template(chat_template)
    override = parse_generation_override(override_generation_config)
    engine = create_engine(engine_args)
    async_engine = AsyncLLMEngine(engine)
    try:
        model_config = engine.config.model_config
        model_dir = model_config.model if os.path.isdir(model_config.model) else os.path.dirname(model_config.model)
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        settings = ServerSettings(names[0] if names else engine_args.model or DEFAULT_MODEL_NAME,
                                  model_config.max_model_len, max_log_len, max_queue_len, template,
                                  generation_defaults(generation_config, model_dir, override),
                                  tool_call_parser=tool_call_parser, log_stats=log_stats,
                                  reasoning_parser=reasoning_parser, **({"cors": cors} if cors else {}),
                                  model_aliases=tuple(names[1:]), **(app_options or {}))
        if not log_requests:   # the per-request line (server/metrics.py) goes to this logger alone
            logging.getLogger("shardserve.requests").setLevel(logging.WARNING)
        gate = DrainGate(build_app(async_engine, settings, api_key, max_request_body_bytes))
        scheme = "https" if ssl and ssl.get("ssl_certfile") else "http"
        logger.info("serving %s on %s://%s:%d (OpenAI API under /v1)", settings.served_model_name, scheme, host, port)
        # The drain waits for in-flight requests; uvicorn's own grace then only closes idle connections.
        config = uvicorn.Config(gate, host=host, port=port, log_level=uvicorn_log_level,
                                timeout_graceful_shutdown=0.5, access_log=False, **(ssl or {}))
        # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal to the handler it found
        # installed. A no-op one underneath lets a drained shutdown end normally, with exit code 0.
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            DrainingServer(config, gate, shutdown_timeout).run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        async_engine.shutdown()
    return 0
