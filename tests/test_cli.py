"""The `shardserve` command as users run it (a real subprocess, the embedded model)."""
from __future__ import annotations

import os
import subprocess
import sys


def _cli(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_chat_message_answers_paris():
    done = _cli("chat", "--message", "What is the capital of France?", "--max-model-len", "2048",
                "--kv-cache-memory", "512MiB")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
    assert "KV cache size:" in done.stderr and "Maximum concurrency for 2048 tokens per request" in done.stderr


def test_bad_arguments_are_one_line_errors():
    missing = _cli("chat", "--model", "/nonexistent/model", "--message", "hi")
    assert missing.returncode == 2 and "error: model '/nonexistent/model' not found" in missing.stderr
    bad_tp = _cli("chat", "-tp", "2", "--message", "hi")
    assert bad_tp.returncode == 2 and "sizes that work: 1, 3" in bad_tp.stderr
    assert "Traceback" not in missing.stderr + bad_tp.stderr


def test_serve_help_lists_vllm_flags_with_defaults():
    done = _cli("serve", "--help", timeout=60)
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for flag in ("--host", "--port", "--served-model-name", "--dtype", "--device", "--max-model-len",
                 "--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-cache-memory",
                 "--block-size", "--enable-prefix-caching", "--no-enable-prefix-caching", "--tensor-parallel-size",
                 "--pipeline-parallel-size", "--data-parallel-size", "--distributed-executor-backend", "--seed",
                 "--api-key", "--chat-template", "--generation-config", "--max-log-len", "--max-queue-len",
                 "--config", "--enable-expert-parallel", "--override-generation-config", "--scheduling-policy",
                 "--enable-prompt-tokens-details", "--disable-fastapi-docs", "--root-path",
                 "--return-tokens-as-token-ids"):
        assert flag in text, flag
    assert "--port PORT default: 8000" in text
    from shardserve.cli import build_parser
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert [a.option_strings for a in serve._actions
            if a.option_strings and a.dest != "help" and "default" not in (a.help or "")] == []


def test_vllm_flags_reach_the_engine_config(tmp_path):
    """--no-enable-chunked-prefill (the budget becomes the model length),
    --disable-custom-all-reduce (the workers' TP all-reduces through NCCL only) and --trust-remote-code
    land in the engine's arguments; the logging flags in the server's namespace."""
    from shardserve.cli import build_parser, engine_args_from
    from tests.tiny_models import make_tiny_checkpoint
    ckpt = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama")
    ns = build_parser().parse_args(["serve", ckpt, "--device", "cpu", "--no-enable-chunked-prefill",
                                    "--max-model-len", "96", "--disable-custom-all-reduce", "--disable-log-requests",
                                    "--disable-log-stats", "--trust-remote-code"])
    ns.model = ns.model_tag
    config = engine_args_from(ns).create_engine_config()
    assert not config.scheduler_config.enable_chunked_prefill
    assert config.scheduler_config.max_num_batched_tokens == 96
    assert config.parallel_config.disable_custom_all_reduce
    assert (ns.enable_log_requests, ns.disable_log_stats) == (False, True)
    assert engine_args_from(ns).trust_remote_code   # taken (LLM(trust_remote_code=True) too), changes nothing
    default = engine_args_from(build_parser().parse_args(["serve", ckpt, "--device", "cpu"]))
    assert default.enable_chunked_prefill and not default.disable_custom_all_reduce


def test_tls_flags_go_together():
    done = _cli("serve", "--ssl-keyfile", "key.pem", timeout=60)
    assert done.returncode == 2 and "--ssl-keyfile and --ssl-certfile go together" in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_config_file_flags_and_command_line_precedence(tmp_path):
    from shardserve.cli import build_parser, config_file_args
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 9001\nmax_num_seqs: 7\nenable-prefix-caching: false\nserved-model-name: m\n"
                   "allowed-origins: [https://a.example]\n")
    argv = config_file_args(["serve", "--config", str(cfg), "--port", "9002"])
    ns = build_parser().parse_args(argv)
    assert (ns.port, ns.max_num_seqs, ns.enable_prefix_caching, ns.served_model_name) == (9002, 7, False, ["m"])
    assert ns.allowed_origins == ["https://a.example"]   # lists reach JSON-valued flags as JSON
    cfg.write_text("served-model-name: [m, alias]\n")   # a list-valued flag takes a YAML list as its values
    assert build_parser().parse_args(config_file_args(["serve", "--config", str(cfg)])).served_model_name == \
        ["m", "alias"]
    bad = _cli("serve", "--config", str(tmp_path / "missing.yaml"), timeout=60)
    assert bad.returncode == 2 and "--config" in bad.stderr and "Traceback" not in bad.stderr
