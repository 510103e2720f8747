"""Router configuration: the vLLM Semantic Router's shape loads as is; every fault names its YAML path."""
from __future__ import annotations

import textwrap

import pytest
import yaml

from shardserve.router.config import ConfigError, load_config, parse_config

SEED = """
router:
  models:
    - id: "vllm-sr/auto"     # auto-routing with optional fusion
    - id: "vllm-sr/fusion"   # always runs a panel
  backends:
    - {id: "local-qwen", type: vllm, base_url: "http://localhost:8000/v1", model: "Qwen/Qwen3-4B"}
    - {id: "openai-gpt5", type: openai, model: "gpt-5.4-mini"}   # api key from OPENAI_API_KEY, base_url optional
  decisions:
    - id: "research_fusion"
      algorithm:
        type: fusion
        analysis_models: ["local-qwen", "openai-gpt5"]
        judge_model: "local-qwen"
        max_concurrent: 3
        on_error: skip          # partial panels are OK
      signals:
        - {type: keyword, keywords: ["research", "compare", "analyze", "explain deeply"]}
"""


def test_seed_config_loads_as_is(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    path = tmp_path / "router.yaml"
    path.write_text(SEED)
    cfg = load_config(str(path))
    assert cfg.models == ["vllm-sr/auto", "vllm-sr/fusion"]
    assert cfg.backends["openai-gpt5"].endpoints[0].base_url == "https://api.openai.com/v1"
    assert cfg.backends["openai-gpt5"].endpoints[0].api_key == "sk-test"
    assert cfg.backends["local-qwen"].model == "Qwen/Qwen3-4B"
    (d,) = cfg.decisions
    assert d.fusion.analysis_models == ["local-qwen", "openai-gpt5"] and d.fusion.on_error == "skip"
    assert d.signals[0].keywords[-1] == "explain deeply" and cfg.default_model == "local-qwen"


def test_several_endpoints_priorities_and_static():
    cfg = parse_config({"router": {
        "backends": [{"id": "a", "type": "shardserve", "base_url": "http://h1/v1", "weight": 2},
                     {"id": "a", "type": "shardserve", "base_url": "http://h2/v1"},
                     {"id": "b", "type": "vllm", "base_url": "http://h3/v1", "timeout_s": 5}],
        "decisions": [{"id": "low", "algorithm": {"type": "static", "model": "a"}},
                      {"id": "high", "priority": 10, "algorithm": {"type": "static", "model": "b"},
                       "signals": [{"type": "context_length", "min_tokens": 100}]}],
        "default_model": "b"}})
    assert [e.base_url for e in cfg.backends["a"].endpoints] == ["http://h1/v1", "http://h2/v1"]
    assert [d.id for d in cfg.decisions] == ["high", "low"] and cfg.backends["b"].timeout_s == 5.0


BASE = {"backends": [{"id": "a", "type": "vllm", "base_url": "http://h/v1"}]}
FUSION = {"type": "fusion", "analysis_models": ["a"], "judge_model": "a"}


@pytest.mark.parametrize("router,message", [
    ({**BASE, "decisions": [{"id": "d", "algorithm": {**FUSION, "judge_model": "x"}}]},
     "decisions[0].algorithm.judge_model: unknown backend 'x'"),
    ({**BASE, "decisions": [{"id": "d", "algorithm": {**FUSION, "analysis_models": ["a", "zz"]}}]},
     "decisions[0].algorithm.analysis_models[1]: unknown backend 'zz'"),
    ({**BASE, "decisions": [{"id": "d", "algorithm": {**FUSION, "on_error": "retry"}}]},
     "decisions[0].algorithm.on_error: use skip or fail"),
    ({**BASE, "decisions": [{"id": "d", "algorithm": {**FUSION, "min_successful_responses": 3}}]},
     "decisions[0].algorithm.min_successful_responses: between 1 and 1"),
    ({**BASE, "decisions": [{"id": "d", "algorithm": FUSION, "signals": [{"type": "regex"}]}]},
     "decisions[0].signals[0].type: unknown signal type 'regex'"),
    ({**BASE, "decisions": [{"id": "d", "algorithm": FUSION, "signals": [{"type": "keyword", "keywords": "x"}]}]},
     "decisions[0].signals[0].keywords: expected list"),
    ({**BASE, "decisions": [{"id": "d", "algorithm": {"type": "static"}}]}, "decisions[0].algorithm.model: required"),
    ({**BASE, "decisions": [{"id": "d", "algorithm": FUSION}, {"id": "d", "algorithm": FUSION}]},
     "decisions[1].id: duplicate decision 'd'"),
    ({"backends": [{"id": "a", "type": "vllm"}]}, "router.backends[0].base_url: required"),
    ({"backends": [{"id": "a", "type": "tgi", "base_url": "http://h"}]}, "router.backends[0].type: unknown"),
    ({**BASE, "default_model": "nope"}, "router.default_model: unknown backend 'nope'"),
    ({"backends": []}, "router.backends: at least one backend"),
])
def test_faults_name_their_yaml_path(router, message):
    with pytest.raises(ConfigError) as e:
        parse_config({"router": router})
    assert message in str(e.value)


def test_cli_reports_config_errors(tmp_path, capsys):
    from shardserve.cli import main
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"router": {**BASE, "decisions": [{"id": "d", "algorithm": {
        **FUSION, "judge_model": "x"}}]}}))
    assert main(["router", "--config", str(path)]) == 2
    assert "decisions[0].algorithm.judge_model: unknown backend 'x'" in capsys.readouterr().err
    path.write_text(textwrap.dedent("router: [unclosed"))
    assert main(["router", "--config", str(path)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
