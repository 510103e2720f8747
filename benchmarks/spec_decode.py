"""Speculative decoding, single stream (issue 26): tokens/s of greedy requests run one at a time,
with each `--spec` configuration against no speculation, in one run and one process (one engine at
a time). Also checks that every configuration produced the same tokens as no speculation.

    .venv/bin/python benchmarks/spec_decode.py --workload grounded            # embedded SmolLM2
    python3 benchmarks/spec_decode.py --random-weights llama-3-8b --workload open \\
        --spec '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'

Workloads: `grounded` asks the chat model to repeat, correct or reformat a passage its prompt holds
(the answer copies the input: what n-gram drafts are for); `open` asks for new text (chat model),
or with random weights feeds random token ids, so drafts are mostly rejected: the overhead case.
Each figure is the best of `--rounds` passes over the prompts; acceptance (accepted / proposed
drafts) and mean acceptance length (tokens per verification step) come from the engine's counters.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time

PASSAGES = [
    "Our team meets every Tuesday at ten in the small room on the third floor. Bring the weekly report, "
    "the list of open tickets and any questions about the release plan for the next quarter.",
    "To reset the router, unplug it for thirty seconds, plug it back in and wait until the green light "
    "stops blinking. Then open the settings page and check that the network name is still the same.",
    "The museum opens at nine in the morning and closes at six in the evening. Tickets cost twelve "
    "euros for adults and five euros for children; entry is free on the first Sunday of each month.",
    "Water the tomato plants twice a week, early in the morning, and keep the soil moist but not wet. "
    "Remove the small shoots between the main stem and the branches so the plant grows stronger fruit.",
]
TASKS = ["Repeat the following text exactly, word for word:\n\n{}",
         "Correct any mistakes in this text and return the whole corrected text:\n\n{}",
         "Rewrite this text as a bulleted list, keeping every detail:\n\n{}"]
OPEN = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works to a child.",
        "Describe your ideal weekend in a few sentences.", "Write a poem about winter mornings."]
DEFAULT_SPECS = ['{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}']


def prompts_for(ns, llm) -> list:
    if ns.random_weights:   # no tokenizer: random ids (nothing to copy; the overhead case)
        rng = random.Random(0)
        vocab = llm.engine.config.model_config.vocab_size
        return [[rng.randrange(vocab) for _ in range(ns.input_len)] for _ in range(ns.num_prompts)]
    texts = ([task.format(p) for p in PASSAGES for task in TASKS] if ns.workload == "grounded" else OPEN)
    tokenizer = llm.get_tokenizer()
    out = []
    for text in texts[:ns.num_prompts]:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], True)
        out.append({"prompt_token_ids": tokenizer.encode(chat, add_special_tokens=False)})
    return out


def run_config(ns, spec: str | None, path: str) -> dict:
    import torch

    from shardserve import LLM, SamplingParams
    kw = dict(dtype=ns.dtype, device=ns.device, max_model_len=ns.max_model_len, show_progress=False,
              speculative_config=spec)
    if ns.random_weights:
        kw.update(load_format="dummy", skip_tokenizer_init=True)
    if ns.kv_cache_memory:
        kw["kv_cache_memory"] = ns.kv_cache_memory
    llm = LLM(path, **kw)
    params = SamplingParams(temperature=0, max_tokens=ns.max_tokens, ignore_eos=bool(ns.random_weights))
    prompts = prompts_for(ns, llm)
    llm.generate(prompts[:1], params, use_tqdm=False)   # warm-up
    best, tokens = None, None
    stats0 = llm.engine.stats().spec_decoding
    for _ in range(ns.rounds):
        n, outs = 0, []
        start = time.perf_counter()
        for prompt in prompts:   # one at a time: single stream
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            outs.append(out.token_ids)
            n += len(out.token_ids)
        elapsed = time.perf_counter() - start
        best = elapsed if best is None or elapsed < best else best
        tokens = (n, outs)
    result = {"spec": json.loads(spec) if spec else None, "tokens": tokens[0], "seconds": round(best, 3),
              "tokens_per_s": round(tokens[0] / best, 2), "outputs": tokens[1]}
    stats = llm.engine.stats().spec_decoding
    if stats is not None:
        drafts = stats.num_drafts - (stats0.num_drafts if stats0 else 0)
        proposed = stats.num_draft_tokens - (stats0.num_draft_tokens if stats0 else 0)
        accepted = stats.num_accepted_tokens - (stats0.num_accepted_tokens if stats0 else 0)
        result.update(acceptance_rate=round(accepted / proposed, 3) if proposed else 0.0,
                      mean_acceptance_length=round(1 + accepted / drafts, 2) if drafts else 1.0,
                      verification_steps=drafts)
    llm.engine.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--random-weights", default=None, metavar="SHAPE", help="a bench shape (llama-3-8b, ...)")
    p.add_argument("--workload", choices=["grounded", "open"], default="grounded")
    p.add_argument("--spec", action="append", default=None, help="a --speculative-config JSON (repeatable)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--input-len", type=int, default=128, help="random-weights prompts (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    from shardserve.bench.report import report
    from shardserve.bench.shapes import shape_config, write_shape_dir
    from shardserve.models.loader import resolve_model_path
    path = (write_shape_dir(shape_config(ns.random_weights), ns.random_weights) if ns.random_weights
            else resolve_model_path(ns.model))
    runs = [run_config(ns, None, path)]
    for spec in ns.spec or DEFAULT_SPECS:
        spec = spec.replace("SELF", path)   # {"model": "SELF"}: the target as its own draft
        runs.append(run_config(ns, spec, path))
    base = runs[0]
    for run in runs[1:]:
        run["speedup"] = round(run["tokens_per_s"] / base["tokens_per_s"], 3)
        run["identical_to_no_speculation"] = run["outputs"] == base["outputs"]
    for run in runs:
        del run["outputs"]
    report({"workload": ns.workload, "model": ns.random_weights or ns.model or "embedded SmolLM2-135M (GGUF)",
            "device": ns.device, "max_tokens": ns.max_tokens, "runs": runs}, ns.json)


if __name__ == "__main__":
    sys.exit(main())
