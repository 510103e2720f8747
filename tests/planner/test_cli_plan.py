"""`shardserve plan` as users run it: a real subprocess for the table and the errors, the same
entry point in-process (faster: no torch import per call) for JSON output and every kind of MODEL."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from shardserve.cli import main
from shardserve.planner.catalog import model_config


def _cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_plan_table_shows_the_seed_numbers():
    done = _cli("plan", "llama-3.1-70b", "--gpu", "h100-80gb", "--gpus-per-node", "2", "--max-model-len", "131072")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Weights (bf16): 141.1 GB" in out
    assert "320.0 KiB per token" in out and "40.0 GiB per 131,072-token request" in out
    assert "Needs at least: 2 x h100-80gb (TP=2 PP=1) for the weights" in out
    assert "What would make it fit" in out and "--max-model-len" in out
    assert "Single-GPU baseline: 1 x h100-80gb offloading" in out


def _plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_shape(capsys):
    plan = _plan_json(capsys, "qwen3-30b-a3b", "--gpu", "h200-141gb", "--gpus-per-node", "4", "--max-model-len",
                      "8192", "--concurrency", "8")
    assert set(plan) == {"model", "settings", "weights", "kv_cache", "min_gpus", "layouts", "invalid_layouts",
                         "recommended", "baseline", "advice"}
    assert plan["model"]["params_total"] == 30_532_122_624 and plan["model"]["experts"] == 128
    assert plan["settings"]["concurrency"] == 8 and plan["settings"]["total_gpus"] == 4
    row = plan["layouts"][0]
    assert {"tp", "pp", "dp", "status", "fits", "reason", "weight_bytes_per_rank", "kv_tokens_per_replica",
            "max_concurrency", "decode_ms", "breakdown", "tp_crosses_nodes"} <= set(row)
    assert set(row["breakdown"]) == {"hbm_ms", "comm_ms", "handoff_ms", "total_ms"}
    assert plan["recommended"]["fits"]


def test_plan_reads_config_json_checkpoint_dir_and_gguf(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(model_config("qwen3-8b")))
    flags = ("--gpu", "l40s-48gb", "--gpus-per-node", "2")
    models = (str(tmp_path), str(tmp_path / "config.json"), "Qwen/Qwen3-8B")
    plans = [_plan_json(capsys, model, *flags) for model in models]
    assert len({p["weights"]["bytes"] for p in plans}) == 1 and len({json.dumps(p["layouts"]) for p in plans}) == 1
    assert [p["model"]["source"] for p in plans] == ["checkpoint", "config.json", "catalog"]
    from shardserve.models.loader import default_model_path
    g = _plan_json(capsys, default_model_path(), "--gpu", "rtx4090-24gb", "--gpus-per-node", "4")
    assert g["model"]["source"] == "gguf" and g["model"]["file_bytes"] > 0 and "Q4_1" in g["model"]["tensor_types"]
    assert g["model"]["params_total"] == g["model"]["params"]          # config-derived count == GGUF tensors' count
    assert {r["tp"] for r in g["invalid_layouts"]} == {2, 4}             # SmolLM2: 9 heads, 3 KV heads


def test_plan_counts_gguf_weights_as_a_gpu_holds_them(tmp_path, capsys, monkeypatch):
    """A Q4_K_M-style file: its Q4_K linears and (untied) embedding at the W4A16 layout's bytes
    (gguf_layout.gpu_weight, computed here on the CPU), its Q6_K v / up rows, LM head and norms at
    --dtype."""
    import gguf
    import torch

    from shardserve.kernels.quant import gguf_layout
    from tests.models import gguf_files
    from tests.quantization.test_gguf_quant import _typed_add_tensor
    from tests.tiny_models import make_tiny_checkpoint
    ckpt = make_tiny_checkpoint(str(tmp_path / "ckpt"), "llama", hidden_size=256, intermediate_size=512)
    path = str(tmp_path / "tiny-Q4_K_M.gguf")
    monkeypatch.setattr(gguf_files, "_add_tensor", _typed_add_tensor(gguf_files._add_tensor, "Q4_K", "Q6_K"))
    gguf_files.write_gguf(ckpt, path, "Q8_0")
    linear = re.compile(r"blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight")
    want = 0
    for t in gguf.GGUFReader(path).tensors:
        kept = linear.fullmatch(t.name) or t.name == "token_embd.weight"
        if kept and t.tensor_type.name in gguf_layout.INT4_TYPES:
            k = int(t.shape[0])   # GGUF lists the row length first
            raw = torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(int(t.n_elements) // k, -1)
            held = gguf_layout.gpu_weight(raw, t.tensor_type.name, k).planes.values()
            want += sum(p.numel() * p.element_size() for p in held)
        else:   # dequantized to bf16
            want += int(t.n_elements) * 2
    plan = _plan_json(capsys, path, "--gpu", "h100-80gb", "--dtype", "bf16")
    assert plan["model"]["linear_elements_by_type"].keys() == {"Q4_K", "Q6_K"}
    assert plan["weights"]["bytes"] == want
    monkeypatch.setenv("SHARDSERVE_GGUF_DEQUANTIZE", "1")   # everything dequantized: every tensor at bf16
    dense = _plan_json(capsys, path, "--gpu", "h100-80gb", "--dtype", "bf16")
    assert dense["weights"]["bytes"] == 2 * sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)
    monkeypatch.delenv("SHARDSERVE_GGUF_DEQUANTIZE")
    capsys.readouterr()
    assert main(["plan", path, "--gpu", "h100-80gb"]) == 0
    assert "keeps Q4_0 / Q4_1 / Q4_K linears, MoE experts and an untied embedding" in capsys.readouterr().out


def test_plan_counts_gguf_moe_experts_as_a_gpu_holds_them(tmp_path, capsys, monkeypatch):
    """A MoE file with Q4_K experts, but for layer 0's down in Q6_K: layer 1's experts at the INT4
    experts' bytes (int4_experts.from_gguf_blocks, computed here on the CPU), layer 0's (a type CUDA
    does not keep among them) and everything else at --dtype."""
    import gguf
    import torch

    from shardserve.kernels.moe.int4_experts import from_gguf_blocks
    from tests.models import gguf_files
    from tests.tiny_models import make_tiny_checkpoint
    original = gguf_files._add_tensor

    def add(w, gname, data, qtype_name):
        if gname.endswith("_exps.weight"):
            qtype_name = "Q6_K" if gname == "blk.0.ffn_down_exps.weight" else "Q4_K"
        original(w, gname, data, qtype_name)
    monkeypatch.setattr(gguf_files, "_add_tensor", add)
    ckpt = make_tiny_checkpoint(str(tmp_path / "ckpt"), "qwen3_moe", hidden_size=256, moe_intermediate_size=256,
                                intermediate_size=512, mlp_only_layers=[])   # both layers sparse
    path = str(tmp_path / "tiny-moe.gguf")
    gguf_files.write_moe_gguf(ckpt, path, "Q8_0")
    want = 0
    for t in gguf.GGUFReader(path).tensors:
        if t.name.startswith("blk.1.ffn_") and t.name.endswith("_exps.weight"):
            k, n = int(t.shape[0]), int(t.shape[1])   # GGUF lists the row length first
            raw = torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(-1, n, t.data.shape[-1])
            held = from_gguf_blocks(raw, t.tensor_type.name, k, torch.device("cpu"))
            want += sum(p.numel() * p.element_size() for p in (held.qweight, held.scales, held.zeros))
        else:
            want += int(t.n_elements) * 2
    plan = _plan_json(capsys, path, "--gpu", "h100-80gb", "--dtype", "bf16")
    assert plan["model"]["expert_elements_by_types"].keys() == {"Q4_K,Q4_K,Q6_K", "Q4_K,Q4_K,Q4_K"}
    assert plan["weights"]["bytes"] == want
    fp32 = _plan_json(capsys, path, "--gpu", "h100-80gb", "--dtype", "fp32")   # fp32: experts dequantized
    assert fp32["weights"]["bytes"] == 4 * sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)


def test_plan_errors_are_one_line():
    bad = _cli("plan", "gpt-17")
    assert bad.returncode == 2 and "error: model 'gpt-17'" in bad.stderr and "Traceback" not in bad.stderr
    link = _cli("plan", "qwen3-8b", "--interconnect", "carrier-pigeon")
    assert link.returncode == 2 and "--interconnect 'carrier-pigeon'" in link.stderr
