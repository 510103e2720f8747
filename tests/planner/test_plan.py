"""Layouts, fit, recommendation, decode-time model, advice and calibration of `shardserve plan`."""
from __future__ import annotations

import json
import math

import pytest

from shardserve.planner import plan_from_options
from shardserve.planner.catalog import model_config
from shardserve.planner.hardware import GPUS, H200X2_NVLINK_ALLREDUCE, LINKS, allreduce_seconds, fit_alpha_beta
from shardserve.planner.memory import ModelShape
from shardserve.planner.report import format_plan


def _layout(plan, tp, pp):
    return next(r for r in plan["layouts"] if (r["tp"], r["pp"]) == (tp, pp))


def test_70b_needs_two_h100s_and_recommends_tp2():
    plan = plan_from_options("llama-3.1-70b", gpu="h100-80gb", gpus_per_node=2, max_model_len=8192)
    assert plan["min_gpus"]["weights"] == {"gpus": 2, "nodes": 1, "tp": 2, "pp": 1}
    rows = sorted(plan["layouts"], key=lambda r: (r["tp"], r["pp"]))
    assert [(r["tp"], r["pp"], r["dp"], r["status"]) for r in rows] == \
        [(1, 1, 2, "weights"), (1, 2, 1, "fits"), (2, 1, 1, "fits")]
    rec = plan["recommended"]
    assert (rec["tp"], rec["pp"]) == (2, 1)
    # KV capacity by hand: usable memory minus weights minus the activation reserve, / KV per rank.
    from shardserve.planner.cost import activation_reserve
    m = ModelShape(model_config("llama-3.1-70b"))
    free = 80 * 2**30 * 0.9 - m.weight_bytes("bf16", 2, range(80), True, True) - activation_reserve(m, 2)
    assert rec["kv_tokens_per_replica"] == int(free // (160 * 2**10))
    assert rec["max_concurrency"] == rec["kv_tokens_per_replica"] // 8192


def test_at_full_128k_context_the_same_two_gpus_are_short_of_kv():
    plan = plan_from_options("llama-3.1-70b", gpu="h100-80gb", gpus_per_node=2)
    assert plan["settings"]["max_model_len"] == 131072
    assert plan["kv_cache"]["bytes_per_request"] == 40 * 2**30
    assert plan["recommended"] is None
    assert _layout(plan, 2, 1)["status"] == "kv" and "131,072 needed" in _layout(plan, 2, 1)["reason"]
    advice = "\n".join(plan["advice"])
    tokens = _layout(plan, 2, 1)["kv_tokens_per_replica"]
    assert f"--max-model-len {tokens:,} fits with TP=2 PP=1" in advice
    assert "--kv-cache-dtype fp8" in advice and f"{2 * tokens:,}" in advice
    assert "--dtype fp8: weights 72.7 GB" in advice and "fits these 2 x h100-80gb" in advice
    # Beyond one node the search counts whole nodes: 2 nodes of 2 (on one 8-GPU node, 3 GPUs with PP=3).
    assert plan["min_gpus"]["requests"] == {"gpus": 4, "nodes": 2, "tp": 2, "pp": 2}
    assert plan_from_options("llama-3.1-70b", gpu="h100-80gb")["min_gpus"]["requests"]["gpus"] == 3


def test_405b_does_not_fit_one_node_and_says_what_would():
    plan = plan_from_options("llama-3.1-405b", gpu="h100-80gb")
    assert round(plan["weights"]["bytes"] / 1e9) == 812
    assert plan["recommended"] is None and all(r["status"] == "weights" for r in plan["layouts"])
    advice = "\n".join(plan["advice"])
    assert "--dtype fp8: weights 410.1 GB instead of 811.7 GB; fits these 8 x h100-80gb with TP=8 PP=1" in advice
    assert "--dtype int4: weights 218.7 GB" in advice
    assert "more GPUs: 16 x h100-80gb (2 node(s) of 8) hold it at bf16 with TP=8 PP=2" in advice
    text = format_plan(plan)
    assert "Does not fit on 8 x h100-80gb" in text and "offloading" in text


def test_layouts_enumerate_tp_pp_dp_and_reject_bad_tp():
    # Qwen3-14B: 40 heads, 8 KV heads. On 2 nodes x 8 GPUs TP=16 does not divide the heads.
    plan = plan_from_options("qwen3-14b", gpu="a100-80gb", nodes=2, max_model_len=4096)
    pairs = {(r["tp"], r["pp"]) for r in plan["layouts"]} | {(r["tp"], r["pp"]) for r in plan["invalid_layouts"]}
    powers = (1, 2, 4, 8, 16)
    assert pairs == {(tp, pp) for tp in powers for pp in powers if tp * pp <= 16}
    assert all(r["tp"] * r["pp"] * r["dp"] == 16 for r in plan["layouts"])
    assert {r["tp"] for r in plan["invalid_layouts"]} == {16}
    assert "does not divide the 40 attention heads" in plan["invalid_layouts"][0]["reason"]
    rec = plan["recommended"]
    assert rec["tp"] <= 8 and not rec["tp_crosses_nodes"]


def test_tp_across_nodes_is_valid_but_not_recommended():
    plan = plan_from_options("llama-3.1-70b", gpu="h100-80gb", nodes=2, max_model_len=8192)
    tp16 = _layout(plan, 16, 1)                          # 16 % 8 KV heads == 0: replicated KV heads
    assert tp16["tp_crosses_nodes"] and tp16["fits"]
    assert _layout(plan, 8, 2)["pp_crosses_nodes"] and not _layout(plan, 8, 2)["tp_crosses_nodes"]
    assert not plan["recommended"]["tp_crosses_nodes"]


def test_pp_cannot_exceed_layers(tmp_path):
    cfg = dict(model_config("qwen3-0.6b"), num_hidden_layers=2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    plan = plan_from_options(str(path), gpus_per_node=4, max_model_len=1024)
    reasons = {(r["pp"], r["reason"]) for r in plan["invalid_layouts"] if r["tp"] == 1}
    assert reasons == {(4, "PP=4 exceeds the 2 layers")}


def test_decode_time_matches_the_roofline_by_hand():
    ctx = 1024
    plan = plan_from_options("llama-3.1-8b", gpu="h100-80gb", gpus_per_node=2, max_model_len=ctx)
    m = ModelShape(model_config("llama-3.1-8b"))
    counts = m.param_counts()
    read = (counts["total"] - counts["embed"]) * 2 + ctx * 128 * 2**10     # weights minus the lookup table, + KV
    tp1 = _layout(plan, 1, 1)
    assert tp1["breakdown"]["hbm_ms"] == pytest.approx(read / 3.00e12 * 1e3)
    assert tp1["breakdown"]["comm_ms"] == 0 and tp1["decode_ms"] == pytest.approx(tp1["breakdown"]["hbm_ms"])
    nv = LINKS["nvlink"]
    ar = nv.latency_s + 4096 * 2 / nv.bandwidth                     # ring factor 2(n-1)/n = 1 for n = 2
    gather = nv.latency_s + 0.5 * 128256 * 2 / nv.bandwidth         # logits all-gather
    assert _layout(plan, 2, 1)["breakdown"]["comm_ms"] == pytest.approx(((2 * 32 + 1) * ar + gather) * 1e3)
    pp2 = _layout(plan, 1, 2)
    assert pp2["breakdown"]["handoff_ms"] == pytest.approx((nv.latency_s + 2 * 4096 * 2 / nv.bandwidth) * 1e3)
    # Stages run one after another for one token: PP does not cut the HBM time of a single stream.
    assert pp2["breakdown"]["hbm_ms"] == pytest.approx(tp1["breakdown"]["hbm_ms"], rel=1e-3)


def test_nvlink_model_reproduces_the_h200_capture():
    lat, bw = fit_alpha_beta(H200X2_NVLINK_ALLREDUCE)
    assert lat == pytest.approx(39e-6, rel=0.01) and bw == pytest.approx(313.6e9, rel=0.01)
    for nbytes, measured in H200X2_NVLINK_ALLREDUCE:       # within 40% everywhere, exact at the ends
        assert allreduce_seconds(nbytes, 2, LINKS["nvlink"]) == pytest.approx(measured, rel=0.4)
    assert LINKS["tcp-10g"].latency_s > 130e-6           # the socket transport's loopback floor (443 us at 1 MiB)


def test_moe_and_one_bigger_gpu_baseline():
    plan = plan_from_options("qwen3-30b-a3b", gpu="rtx4090-24gb", gpus_per_node=4, max_model_len=8192)
    assert plan["model"]["params_active"] == 3_353_032_704 and plan["model"]["experts"] == 128
    assert plan["settings"]["interconnect"]["intra_node"]["name"] == "pcie4"   # no NVLink on an RTX 4090
    base = plan["baseline"]
    assert base["same_gpu"]["status"] == "weights" and base["same_gpu"]["offload_bytes"] > 0
    assert base["best_single_gpu"]["gpu"] in GPUS
    assert base["best_single_gpu"]["decode_ms"] < plan["recommended"]["decode_ms"]
    assert "(one bigger GPU wins)" in format_plan(plan)


def test_deepseek_v3_on_one_h200_node():
    """DeepSeek-V3 plans as its checkpoint is stored (block-scaled FP8, experts included, as
    quantization/fp8_block_moe.py serves them): one 8 x H200 node."""
    plan = plan_from_options("deepseek-v3", gpu="h200-141gb", max_model_len=32768)
    assert plan["settings"]["dtype"] == "fp8" and plan["model"]["mla"]
    assert plan["kv_cache"]["bytes_per_token"] == 70272
    assert plan["recommended"] is not None and plan["recommended"]["tp"] * plan["recommended"]["pp"] == 8


def test_profile_replaces_built_in_numbers(tmp_path):
    base = plan_from_options("llama-3.1-8b", gpus_per_node=2, max_model_len=4096)
    profile = {"profile": {"hbm_bandwidth": 1.5e12, "links": {"intra_node": {
        "latency_s": 1e-3, "bandwidth": 1e9, "source": "gloo, 2 ranks (doctor)"}}}}
    path = tmp_path / "doctor.json"
    path.write_text(json.dumps(profile))
    measured = plan_from_options("llama-3.1-8b", gpus_per_node=2, max_model_len=4096, profile=str(path))
    hbm = _layout(base, 1, 1)["breakdown"]["hbm_ms"]
    assert _layout(measured, 1, 1)["breakdown"]["hbm_ms"] == pytest.approx(2 * hbm)
    assert _layout(measured, 2, 1)["breakdown"]["comm_ms"] > 60               # 66 collectives x >= 1 ms
    assert measured["settings"]["interconnect"]["intra_node"]["latency_s"] == 1e-3
    assert any("measured" in n for n in measured["settings"]["profile"])
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="doctor --json"):
        plan_from_options("llama-3.1-8b", profile=str(bad))


def test_options_are_validated():
    with pytest.raises(ValueError, match="interconnect 'warp'"):
        plan_from_options("llama-3.1-8b", interconnect=["nvlink,warp"])
    with pytest.raises(ValueError, match="neither a file"):
        plan_from_options("no-such-model")
    custom = plan_from_options("llama-3.1-8b", gpu_memory="24GiB", interconnect=["pcie4,roce-100g"])
    assert custom["settings"]["gpu_memory_bytes"] == 24 * 2**30
    assert custom["settings"]["interconnect"]["inter_node"]["name"] == "roce-100g"
    assert math.isclose(custom["settings"]["interconnect"]["intra_node"]["bandwidth"], 24e9)
