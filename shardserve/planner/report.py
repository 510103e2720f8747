"""`shardserve plan`'s human-readable output: a summary, the layout table, the recommendation,
baselines and advice. Decimal GB for model sizes (as model cards quote them), binary units for
memory (as GPUs are built)."""
from __future__ import annotations

from typing import Any

from shardserve.planner.plan import layout_name


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def kv_size(n: float) -> str:
    return f"{n / 2**10:,.1f} KiB" if n < 2**20 else f"{n / 2**20:,.1f} MiB" if n < 2**30 else gib(n)


def _billions(n: int) -> str:
    return f"{n / 1e9:,.2f}B"


def _where(need: dict[str, Any] | None, gpu: str) -> str:
    if need is None:
        return "more than 4096 GPUs"
    return f"{need['gpus']} x {gpu} ({layout_name(need)})"


def _status(row: dict[str, Any]) -> str:
    if row["fits"]:
        note = "fits"
    else:
        note = ("no: " if row["status"] == "weights" else "short: ") + row["reason"]
    if row["tp_crosses_nodes"]:
        note += "; TP crosses nodes"
    return note


def format_plan(plan: dict[str, Any]) -> str:
    m, s, w, kv = plan["model"], plan["settings"], plan["weights"], plan["kv_cache"]
    lines = []
    params = f"{_billions(m['params_total'])} parameters"
    if m["experts"]:
        params += (f" ({_billions(m['params_active'])} active per token: {m['experts_per_token']} of "
                   f"{m['experts']} experts)")
    attn = "MLA" if m["mla"] else f"{m['attention_heads']} heads / {m['kv_heads']} KV heads x {m['head_dim']}"
    lines.append(f"Model: {m['name']} ({m['source']}, {m['architecture']}): {params}, {m['layers']} layers, {attn}")
    if m.get("source") == "gguf":
        lines.append(f"  GGUF file: {m['file_bytes'] / 1e9:,.2f} GB ({', '.join(m['tensor_types'])}); "
                     "on GPUs shardserve keeps Q4_0 / Q4_1 / Q4_K linears, MoE experts and an untied embedding of "
                     "those types in their blocks (4.75-5 bits a weight) and dequantizes the rest (LM head, other "
                     "types) to --dtype: the weights below count them so")
    others = ", ".join(f"{d} {b / 1e9:,.1f} GB" for d, b in w["bytes_by_dtype"].items() if d != s["dtype"])
    lines.append(f"Weights ({s['dtype']}): {w['bytes'] / 1e9:,.1f} GB ({gib(w['bytes'])}); {others}")
    lines.append(f"KV cache ({s['kv_cache_dtype']}): {kv_size(kv['bytes_per_token_per_layer'])} per token per layer, "
                 f"{kv_size(kv['bytes_per_token'])} per token, {kv_size(kv['bytes_per_request'])} per "
                 f"{s['max_model_len']:,}-token request")
    links = s["interconnect"]
    lines.append(f"Cluster: {s['total_gpus']} x {s['gpu']} ({s['nodes']} node(s) of {s['gpus_per_node']}, "
                 f"{gib(s['gpu_memory_bytes'])}, {s['hbm_bandwidth'] / 1e12:.2f} TB/s); links: "
                 f"{links['intra_node']['name']} inside a node, {links['inter_node']['name']} between nodes; "
                 f"--gpu-memory-utilization {s['gpu_memory_utilization']}")
    for note in s["profile"]:
        lines.append(f"  measured (--profile): {note}")
    need = plan["min_gpus"]
    lines.append(f"Needs at least: {_where(need['weights'], s['gpu'])} for the weights; "
                 f"{_where(need['requests'], s['gpu'])} for {s['concurrency']} request(s) of "
                 f"{s['max_model_len']:,} tokens")
    lines.append("")
    moe = bool(m["experts"])
    lines.append(f"Layouts (decode ms/token with {s['concurrency']} request(s) at {s['max_model_len']:,} tokens "
                 "of context; = HBM + all-reduce + PP hand-off)")
    if moe:
        lines.append("  EP: experts split whole over EP ranks (--enable-expert-parallel): the TP group, or DP x TP "
                     "ranks with DP > 1 (then comm also holds each MoE layer's token all-gather and reduce-scatter "
                     "over DP); -: every rank holds every expert, sliced over TP")
    header = ("TP", "PP", "DP") + (("EP",) if moe else ()) + (
        "weights/rank", "KV tokens/replica", "max conc.", "ms/token", "hbm+comm+handoff", "status")
    table = [header]
    for r in sorted(plan["layouts"], key=lambda r: (r["tp"] * r["pp"], r["tp"], r.get("expert_parallel", False))):
        b = r["breakdown"]
        ep = ((str(r["ep"]) if r["expert_parallel"] else "-"),) if moe else ()
        table.append((str(r["tp"]), str(r["pp"]), str(r["dp"])) + ep + (gib(r["weight_bytes_per_rank"]),
                      f"{r['kv_tokens_per_replica']:,}" if r["status"] != "weights" else "-",
                      str(r["max_concurrency"]) if r["status"] != "weights" else "-", f"{r['decode_ms']:.2f}",
                      f"{b['hbm_ms']:.2f}+{b['comm_ms']:.2f}+{b['handoff_ms']:.2f}", _status(r)))
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        lines.append("  " + "  ".join(c.rjust(wd) for c, wd in zip(row, widths)) + "  " + row[-1])
    if plan["invalid_layouts"]:
        reasons = sorted({r["reason"] for r in plan["invalid_layouts"]})
        lines.append("  not valid: " + "; ".join(reasons))
    lines.append("")
    rec = plan["recommended"]
    if rec:
        flags = "".join(f" -{k} {rec[k]}" for k in ("tp", "pp", "dp") if rec[k] > 1)
        name = f"TP={rec['tp']} PP={rec['pp']} DP={rec['dp']}"
        if rec.get("expert_parallel"):
            flags += " --enable-expert-parallel"
            name += f" EP={rec['ep']}"
        lines.append(f"Recommended: {name}: {rec['decode_ms']:.2f} ms/token, "
                     f"up to {rec['max_concurrency']} concurrent {s['max_model_len']:,}-token requests"
                     f"  (shardserve serve {m.get('path', 'MODEL')}{flags})")
    else:
        lines.append(f"Does not fit on {s['total_gpus']} x {s['gpu']} at --max-model-len {s['max_model_len']:,}. "
                     "What would make it fit:")
        lines.extend(f"  - {a}" for a in plan["advice"])
    same, best = plan["baseline"]["same_gpu"], plan["baseline"]["best_single_gpu"]
    if same["status"] == "weights":
        base = (f"1 x {same['gpu']} offloading {same['offload_bytes'] / 1e9:,.1f} GB of weights to CPU memory "
                f"(over {same['host_link']}): {same['decode_ms']:,.1f} ms/token")
    else:
        base = f"1 x {same['gpu']}: {same['decode_ms']:.2f} ms/token" + ("" if same["status"] == "fits" else
                                                                        f" ({same['reason']})")
    if best:
        base += f"; fastest single GPU that holds it: {best['gpu']}, {best['decode_ms']:.2f} ms/token"
        if rec and best["decode_ms"] < rec["decode_ms"]:
            base += " (one bigger GPU wins)"
    lines.append(f"Single-GPU baseline: {base}")
    return "\n".join(lines)
