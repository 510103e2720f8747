"""GGUF mixture-of-experts on the CPU (issue 25): the experts kept in their blocks
(quantization/gguf_moe.py) against the same file's experts dequantized at load, in one run.

    .venv/bin/python benchmarks/gguf_moe_cpu.py [--rounds 2] [--experts-type Q4_0] [--json out.json]

No MoE GGUF ships with the repository, so the file is a random-weight Qwen3-MoE-shaped model written
here (cached under ~/.cache/shardserve/bench): hidden 1024, 8 layers, 16 heads (4 KV) of 64, 32
experts of width 512, top-8, vocabulary 32000; attention and the LM head Q8_0, the experts
`--experts-type` (Q4_0 by default; any type kept in blocks by default).

Contenders: the experts kept in blocks, with the decoder layers in the one native call (the default)
and one kernel call at a time (`SHARDSERVE_CPU_DECODER_STACK=0`); the file dequantized at load;
llama.cpp. Per contender (benchmarks/gguf_kquant_cpu.py's `measure`, as benchmarks/gguf_cpu.py
measures): weights held, a fresh 128-token prompt's prefill (best of 2) and single-stream decode
(128 new tokens after a fresh 128-token prompt less a 1-token request on another; best of 3), 2
threads, `--dtype bfloat16`; llama.cpp's `llama-bench -t 2 -p 128 -n 128` on the same file
(benchmarks/llama_cpp_bench.py builds it). The contenders alternate over `--rounds`, ours each in a
fresh process; the best round of each is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gguf_bench  # noqa: E402  (benchmarks/, the script's folder)

THREADS = "2"
SHAPE = dict(hidden=1024, layers=8, heads=16, kv_heads=4, head_dim=64, experts=32, top_k=8, inter=512, vocab=32000)


def write_file(experts_type: str) -> str:
    """The random-weight Qwen3-MoE GGUF (cached)."""
    import gguf

    from tests.models import gguf_files
    path = gguf_bench.cached_file(f"qwen3moe-{'-'.join(str(v) for v in SHAPE.values())}-{experts_type}.gguf")
    if os.path.exists(path):
        return path
    h, hd, e, inter, vocab = SHAPE["hidden"], SHAPE["head_dim"], SHAPE["experts"], SHAPE["inter"], SHAPE["vocab"]
    cfg = {"num_attention_heads": SHAPE["heads"], "num_key_value_heads": SHAPE["kv_heads"], "hidden_size": h,
           "head_dim": hd, "intermediate_size": inter, "num_hidden_layers": SHAPE["layers"],
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1000000.0},
           "vocab_size": vocab, "bos_token_id": 256, "eos_token_id": 257}
    gguf_files.VOCAB = vocab   # the token list padded to this vocabulary
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path + ".tmp", "qwen3moe")
    w.add_name(f"random-qwen3moe-{experts_type}")
    gguf_files._write_metadata(w, cfg, "Q8_0")
    w.add_expert_count(e)
    w.add_expert_used_count(SHAPE["top_k"])
    w.add_expert_feed_forward_length(inter)

    def add(name: str, shape: tuple[int, ...], qtype: str) -> None:
        data = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)
        if qtype == "F32":
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf_files.quantize(data, qtype), raw_dtype=gguf.GGMLQuantizationType[qtype])

    add("token_embd.weight", (vocab, h), "Q8_0")
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    add("output.weight", (vocab, h), "Q8_0")
    q, kv = SHAPE["heads"] * hd, SHAPE["kv_heads"] * hd
    for i in range(SHAPE["layers"]):
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(h, dtype=np.float32))
        for name in ("attn_q_norm", "attn_k_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(hd, dtype=np.float32))
        add(f"blk.{i}.attn_q.weight", (q, h), "Q8_0")
        add(f"blk.{i}.attn_k.weight", (kv, h), "Q8_0")
        add(f"blk.{i}.attn_v.weight", (kv, h), "Q8_0")
        add(f"blk.{i}.attn_output.weight", (h, q), "Q8_0")
        add(f"blk.{i}.ffn_gate_inp.weight", (e, h), "F32")
        add(f"blk.{i}.ffn_gate_exps.weight", (e, inter, h), experts_type)
        add(f"blk.{i}.ffn_up_exps.weight", (e, inter, h), experts_type)
        add(f"blk.{i}.ffn_down_exps.weight", (e, h, inter), experts_type)
    gguf_files._finish(w)
    os.replace(path + ".tmp", path)
    return path


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":   # measured as gguf_kquant_cpu.py measures (same vocabulary)
        import gguf_kquant_cpu
        print("RESULT " + json.dumps(gguf_kquant_cpu.measure(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--experts-type", default="Q4_0")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    path = write_file(args.experts_type)
    # Dequantizing only the experts: their type taken out of the kept ones would need a switch of its
    # own, so the peer dequantizes the whole file (its Q8_0 attention too, a few percent of the bytes).
    # Kept experts twice: in the one-call decoder stack (the default: models/cpu_stack.py) and with the
    # modules called one kernel at a time, so the stack's share shows in the same run.
    paths = {f"experts kept in blocks ({args.experts_type})": {},
             f"experts kept in blocks ({args.experts_type}), decoder stack off": {"SHARDSERVE_CPU_DECODER_STACK": "0"},
             "dequantized at load (bf16)": {"SHARDSERVE_GGUF_DEQUANTIZE": "1"}}
    names = list(paths) + ([] if args.no_llama_cpp else ["llama.cpp (llama-bench), same file"])
    results: dict[str, list[dict]] = {name: [] for name in names}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name in names:
            if name not in paths:
                sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
                import llama_cpp_bench
                got = llama_cpp_bench.run(int(THREADS), 128, 128, reps=3, model=path)
                results[name].append({"weights_gib": os.path.getsize(path) / (1 << 30),
                                      "prefill_tok_s": got["pp_tok_s"], "decode_tok_s": got["tg_tok_s"]})
                continue
            results[name].append(gguf_bench.run_child(__file__, [path, args.dtype, str(r)], THREADS, paths[name]))
    print(f"{args.dtype}, {THREADS} threads, best of {args.rounds} rounds; 1-minute load average at each round's "
          f"start: {', '.join(f'{x:.2f}' for x in loads)}")
    print("| contender | weights GiB | 128-token prefill tok/s | decode tok/s |")
    print("| --- | --- | --- | --- |")
    best = {name: rounds[0] | {key: max(x[key] for x in rounds) for key in ("prefill_tok_s", "decode_tok_s")}
            for name, rounds in results.items()}
    for name, x in best.items():
        print(f"| {name} | {x['weights_gib']:.3f} | {x['prefill_tok_s']:.0f} | {x['decode_tok_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": SHAPE, "rounds": results, "best": best, "load_average": loads}, f, indent=2)


if __name__ == "__main__":
    main()
