"""Expert-parallel (EP) layouts in `shardserve plan`: which are offered, what a rank holds and reads,
the token exchange of EP across replicas, the report, and the per-rank bytes against a real
loaded tiny MoE model."""
from __future__ import annotations

import json
import math

import pytest

from shardserve.cli import main
from shardserve.planner import plan_from_options, predict_layout
from shardserve.planner.catalog import model_config
from shardserve.planner.hardware import LINKS
from shardserve.planner.memory import ModelShape
from shardserve.planner.report import format_plan


def _rows(plan, ep):
    return {(r["tp"], r["pp"], r["dp"]): r for r in plan["layouts"] if r["expert_parallel"] == ep}


@pytest.mark.parametrize("model,experts", [("qwen3-30b-a3b", 128), ("mixtral-8x7b", 8)])
def test_ep_rows_hold_expert_bytes_over_ep_plus_the_rest(model, experts):
    plan = plan_from_options(model, gpu="h100-80gb", max_model_len=8192, concurrency=8)
    expert_bytes = ModelShape(model_config(model)).param_counts()["experts"] * 2          # bf16
    sliced, whole = _rows(plan, False), _rows(plan, True)
    # Every (TP, PP, DP) with an EP group > 1: the TP group, or DP x TP with DP > 1 (then PP=1 only).
    assert set(whole) == {k for k in sliced if k[0] * k[2] > 1 and (k[2] == 1 or k[1] == 1)}
    for (tp, pp, dp), row in whole.items():
        ep = tp * dp if dp > 1 else tp
        assert row["ep"] == ep and experts % ep == 0
        rest = sliced[tp, pp, dp]["weight_bytes_per_rank"] - expert_bytes / tp     # attention, router, embeddings
        assert row["weight_bytes_per_rank"] == pytest.approx(expert_bytes / ep + rest, rel=1e-12)
    assert all(r["ep"] == 1 for r in sliced.values())


def test_qwen3_30b_ep8_by_hand():
    plan = plan_from_options("qwen3-30b-a3b", gpu="h100-80gb", max_model_len=4096, concurrency=256)
    experts = 48 * 128 * 3 * 2048 * 768                         # routed expert parameters
    assert ModelShape(model_config("qwen3-30b-a3b")).param_counts()["experts"] == experts == 28_991_029_248
    row = _rows(plan, True)[1, 1, 8]
    rest = plan["weights"]["bytes"] - 2 * experts                 # everything else, replicated per replica
    assert row["weight_bytes_per_rank"] == 2 * experts / 8 + rest == 10_329_944_064
    # A rank reads its 16 experts' expected share for all 256 tokens, and each MoE layer exchanges tokens:
    # counts, then 32 tokens per replica all-gathered and reduce-scattered over the 8 ranks.
    b, nv = row["breakdown"], LINKS["nvlink"]
    picked = 1 - (1 - 8 / 128) ** 256
    embed = 151936 * 2048 * 2
    read = rest - embed + 2 * experts / 8 * picked + 32 * 4096 * 96 * 2**10
    assert b["hbm_ms"] == pytest.approx(read / 3.00e12 * 1e3)
    gather = nv.latency_s + 7 / 8 * 8 * 32 * 2048 * 2 / nv.bandwidth
    exchange = 48 * (nv.latency_s + 7 / 8 * 64 / nv.bandwidth + 2 * gather)
    assert b["ep_exchange_ms"] == pytest.approx(exchange * 1e3) and b["comm_ms"] == b["ep_exchange_ms"]
    # The recommendation: far less expert reading beats the exchange, and the command line says so.
    rec = plan["recommended"]
    assert (rec["tp"], rec["dp"], rec["expert_parallel"], rec["ep"]) == (1, 8, True, 8)
    assert rec["decode_ms"] < _rows(plan, False)[1, 1, 8]["decode_ms"]
    text = format_plan(plan)
    assert "Recommended: TP=1 PP=1 DP=8 EP=8" in text
    assert "(shardserve serve MODEL -dp 8 --enable-expert-parallel)" in text


def cfg_path(cfg, tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_invalid_ep_sizes_are_not_offered(tmp_path):
    # Mixtral's 8 experts do not split over 16 ranks; EP across replicas needs PP=1 and one node.
    plan = plan_from_options("mixtral-8x7b", gpu="h100-80gb", gpus_per_node=16, max_model_len=4096)
    assert all(8 % r["ep"] == 0 for r in plan["layouts"])
    assert {(r["tp"], r["pp"], r["dp"]) for r in _rows(plan, True).values()} == {(2, 8, 1), (4, 4, 1), (8, 2, 1)}
    bad = [r for r in plan["invalid_layouts"] if r["expert_parallel"]]
    assert {r["reason"] for r in bad if r["ep"] == 16} >= {"EP=16 does not divide the 8 experts"}
    assert any(r["reason"] == "EP over DP x TP ranks needs PP=1 (PP=2)" for r in bad)
    assert "EP=16 does not divide the 8 experts" in format_plan(plan)
    two_nodes = plan_from_options("qwen3-30b-a3b", gpu="h100-80gb", nodes=2, max_model_len=4096)
    assert all(r["dp"] == 1 for r in _rows(two_nodes, True).values())
    assert any(r["reason"] == "EP over DP x TP ranks runs on one node" for r in two_nodes["invalid_layouts"])
    # EP makes a TP size valid that slicing each expert's width does not (a width of 100 over TP=8).
    cfg = dict(model_config("qwen3-30b-a3b"), moe_intermediate_size=100)
    shape = ModelShape(cfg)
    assert "expert MLP width 100" in shape.tp_problem(8) and shape.tp_problem(8, 8) is None
    odd = plan_from_options(cfg_path(cfg, tmp_path), gpu="h100-80gb", max_model_len=4096)
    assert (8, 1, 1) in _rows(odd, True) and (8, 1, 1) not in _rows(odd, False)
    assert shape.tp_problem(4, 3) == "EP=3 does not divide the 128 experts"


def test_dense_models_get_no_ep():
    plan = plan_from_options("llama-3.1-70b", gpu="h100-80gb", max_model_len=8192)
    assert not any("expert_parallel" in r or "ep" in r for r in plan["layouts"] + plan["invalid_layouts"])
    text = format_plan(plan)
    assert "EP" not in text and "--enable-expert-parallel" not in text
    assert "  TP  PP  DP  weights/rank" in text


def test_json_carries_the_ep_fields(capsys):
    assert main(["plan", "mixtral-8x7b", "--gpu", "h100-80gb", "--max-model-len", "8192", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert all({"expert_parallel", "ep"} <= set(r) for r in plan["layouts"] + plan["invalid_layouts"])
    assert {r["expert_parallel"] for r in plan["layouts"]} == {False, True}
    assert {"expert_parallel", "ep"} <= set(plan["recommended"])
    ep_dp = next(r for r in plan["layouts"] if r["expert_parallel"] and r["dp"] > 1)
    assert ep_dp["breakdown"]["ep_exchange_ms"] > 0


def test_predict_layout_is_the_plan_row():
    one = predict_layout("qwen3-30b-a3b", context=1024)
    plan = plan_from_options("qwen3-30b-a3b", gpu="h100-80gb", gpus_per_node=1, max_model_len=1024)
    assert one["decode_ms"] == pytest.approx(plan["layouts"][0]["decode_ms"]) and one["ep"] == 1
    ep = predict_layout("qwen3-30b-a3b", tp=2, expert_parallel=True)
    assert ep["ep"] == 2 and ep["weight_bytes_per_rank"] == pytest.approx(
        predict_layout("qwen3-30b-a3b", tp=2)["weight_bytes_per_rank"])        # EP = TP: the same bytes
    with pytest.raises(ValueError, match="EP=16 does not divide the 8 experts"):
        predict_layout("mixtral-8x7b", tp=2, dp=8, expert_parallel=True)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    from tests.tiny_models import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3_moe")), "qwen3_moe")


@pytest.mark.slow
@pytest.mark.parametrize("tp,dp,ep", [(2, 1, False), (2, 1, True), (2, 2, True)])
def test_predicted_weight_bytes_per_rank_match_a_loaded_model(tiny_moe, tp, dp, ep):
    """The plan's bytes per rank against the parameters real ranks load (fp32 tiny Qwen3-MoE: 8
    experts of width 64, layer 1 dense): experts sliced over TP=2, whole over EP=TP=2, and whole
    over EP = DP x TP = 4 ranks of two replicas."""
    from shardserve import LLM
    from shardserve.config import ParallelConfig
    if dp > 1 and not hasattr(ParallelConfig, "experts_span_replicas"):
        pytest.skip("this engine has no expert parallelism across data-parallel replicas")
    predicted = predict_layout(tiny_moe, tp=tp, dp=dp, expert_parallel=ep, dtype="fp32")
    llm = LLM(tiny_moe, tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep,
              kv_cache_memory="16MiB", show_progress=False)
    try:
        replicas = llm.engine.replicas if dp > 1 else [llm.engine]
        ranks = [shapes for r in replicas for shapes in r.executor.collective_rpc("weight_shapes")]
    finally:
        llm.engine.shutdown()
    assert len(ranks) == tp * dp and predicted["ep"] == (tp * dp if ep else 1)
    for shapes in ranks:
        # Exact: 4 bytes per parameter, the vocabulary (320) splits evenly, nothing else is padded.
        assert sum(4 * math.prod(s) for s in shapes.values()) == predicted["weight_bytes_per_rank"]
        experts = [s for n, s in shapes.items() if n.endswith("experts.w13_weight")]
        assert experts == ([(8 // predicted["ep"], 128, 96)] if ep else [(8, 64, 96)])   # whole, or sliced
