"""Structured outputs' cost (issue 26): time per output token at batch 32 with a JSON schema against
the same batch without one, in one run (one engine, the passes alternating).

    .venv/bin/python benchmarks/structured_overhead.py [--model PATH] [--batch 32] [--max-tokens 128]

Both passes keep all `--batch` requests running for `--max-tokens` tokens: the unconstrained ones
ignore EOS; the constrained ones follow a schema that needs a long array of integers, so none
finishes before the length limit. TPOT per request = (finished - first token) / (tokens - 1), the
first token from the engine's timestamps (the last step ends them all); the figure is the mean over
requests, best of `--rounds`. The constrained pass pays for the per-step bitmask (xgrammar fills it
on the host while the device runs the forward, then it is applied to the logits) and the matchers'
bookkeeping.
"""
from __future__ import annotations

import argparse
import sys
import time

SCHEMA = {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer"},
                                                      "minItems": 200}},
          "required": ["values"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    from shardserve import LLM, SamplingParams
    from shardserve.bench.report import report
    from shardserve.sampling_params import StructuredOutputsParams
    kw = {"kv_cache_memory": ns.kv_cache_memory} if ns.kv_cache_memory else {}
    llm = LLM(ns.model, device=ns.device, max_model_len=1024, max_num_seqs=ns.batch, show_progress=False, **kw)
    tokenizer = llm.get_tokenizer()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "List many numbers as JSON."}], True)
    prompt = {"prompt_token_ids": tokenizer.encode(chat, add_special_tokens=False)}
    passes = {
        "plain": SamplingParams(temperature=0, max_tokens=ns.max_tokens, ignore_eos=True),
        "json_schema": SamplingParams(temperature=0, max_tokens=ns.max_tokens,
                                      structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    }
    for params in passes.values():   # warm-up: compiles the grammar, Triton kernels, graphs
        llm.generate([prompt] * ns.batch, params, use_tqdm=False)
    best: dict[str, float] = {}
    for _ in range(ns.rounds):
        for name, params in passes.items():
            outs = llm.generate([prompt] * ns.batch, params, use_tqdm=False)
            finished = time.monotonic()   # all end at the same step, at the length limit
            assert all(len(o.outputs[0].token_ids) == ns.max_tokens for o in outs), "a request ended early"
            tpots = [(finished - o.metrics["first_token_time"]) / (ns.max_tokens - 1) for o in outs]
            best[name] = min(best.get(name, float("inf")), sum(tpots) / len(tpots))
    assert outs[0].outputs[0].text.replace(" ", "").startswith('{"values":['), outs[0].outputs[0].text[:40]
    result = {"model": ns.model or "embedded SmolLM2-135M (GGUF)", "device": ns.device, "batch": ns.batch,
              "max_tokens": ns.max_tokens, "tpot_ms": {k: round(v * 1e3, 4) for k, v in best.items()},
              "overhead": round(best["json_schema"] / best["plain"] - 1, 4),
              "sample": outs[0].outputs[0].text[:80]}
    report(result, ns.json)


if __name__ == "__main__":
    sys.exit(main())
