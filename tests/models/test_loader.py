"""Checkpoint loading: the errors a user can hit (bad paths, architectures, shards, budgets)."""
from __future__ import annotations

import glob
import json
import os
import re

import pytest

from shardserve.llm import LLM
from shardserve.sampling_params import SamplingParams
from tests.models.gguf_files import random_prompt
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """A pristine tiny llama checkpoint; tests that break a checkpoint work on a copy."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt")), "llama")


@pytest.fixture
def broken_ckpt(ckpt, tmp_path) -> str:
    import shutil
    dst = str(tmp_path / "broken")
    shutil.copytree(ckpt, dst)
    return dst


def test_prompt_longer_than_max_model_len(ckpt):
    llm = LLM(ckpt, max_model_len=64, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    with pytest.raises(ValueError) as e:
        llm.generate([random_prompt(0, 65)], SamplingParams(max_tokens=1))
    assert "65" in str(e.value) and "64" in str(e.value)
    assert not llm.engine.has_unfinished_requests()
    # The limit itself is fine.
    out = llm.generate([random_prompt(0, 63)], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_unsupported_architecture(broken_ckpt):
    config_file = os.path.join(broken_ckpt, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["architectures"] = ["GPT2LMHeadModel"]
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError) as e:
        LLM(broken_ckpt, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_missing_weight_shard(broken_ckpt):
    with open(os.path.join(broken_ckpt, "model.safetensors.index.json")) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[1]
    os.remove(os.path.join(broken_ckpt, shard))
    with pytest.raises((FileNotFoundError, ValueError)) as e:
        LLM(broken_ckpt, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    assert shard in str(e.value)


@pytest.mark.parametrize("keep", [0.5, 0.002], ids=["truncated-data", "truncated-header"])
def test_corrupt_safetensors(broken_ckpt, keep):
    shard = sorted(glob.glob(os.path.join(broken_ckpt, "*.safetensors")))[2]
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(max(1, int(size * keep)))
    with pytest.raises(ValueError) as e:
        LLM(broken_ckpt, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    assert os.path.basename(shard) in str(e.value)


def test_kv_budget_too_small_says_how_much_is_needed(ckpt):
    with pytest.raises(ValueError) as e:
        LLM(ckpt, kv_cache_memory="64KiB", show_progress=False, max_logprobs=-1)
    msg = str(e.value)
    assert "1024" in msg   # the max_model_len that does not fit
    m = re.search(r"\((\d+) bytes\)", msg)
    assert m, f"the error should state the bytes needed: {msg}"
    need = int(m.group(1))
    # 2 (K, V) x 2 layers x 16 tokens x 2 kv heads x 24 dims x 4 bytes per block; 64 blocks + the null one.
    per_block = 2 * 2 * 16 * 2 * 24 * 4
    assert 64 * per_block <= need <= 65 * per_block
    # ... and that much is indeed enough.
    llm = LLM(ckpt, kv_cache_memory=need, show_progress=False, max_logprobs=-1)
    out = llm.generate([random_prompt(1, 1000)], SamplingParams(temperature=0, max_tokens=24))[0]
    assert len(out.outputs[0].token_ids) == 24


def test_max_model_len_above_max_position_embeddings(ckpt):
    with pytest.raises(ValueError) as e:
        LLM(ckpt, max_model_len=4096, kv_cache_memory="16MiB", show_progress=False, max_logprobs=-1)
    assert "4096" in str(e.value) and "1024" in str(e.value) and "max_position_embeddings" in str(e.value)


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        LLM(str(tmp_path / "nope"), show_progress=False, max_logprobs=-1)
