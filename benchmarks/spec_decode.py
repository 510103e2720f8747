"""Speculative decoding, single stream (issue 26): tokens/s of greedy requests run one at a time,
with each `--spec` configuration against no speculation, in one run and one process (one engine at
a time). Also checks that every configuration produced the same tokens as no speculation.

    .venv/bin/python benchmarks/spec_decode.py --workload grounded            # embedded SmolLM2
    python3 benchmarks/spec_decode.py --random-weights llama-3-8b --workload open \\
        --spec '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'

Workloads: `grounded` asks the chat model to repeat, correct or reformat a passage its prompt holds
(the answer copies the input: what n-gram drafts are for); `open` asks for new text (chat model),
or with random weights feeds random token ids, so drafts are mostly rejected: the overhead case.
Each figure is the best of `--rounds` passes over the prompts (on a CPU the configurations take
turns, round by round); acceptance (accepted / proposed drafts) and mean acceptance length (tokens
per verification step) come from the engine's counters.
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


def build(ns, spec: str | None, path: str):
    from shardserve import LLM
    kw = dict(dtype=ns.dtype, device=ns.device, max_model_len=ns.max_model_len, show_progress=False,
              speculative_config=spec)
    if ns.random_weights:
        kw.update(load_format="dummy", skip_tokenizer_init=True)
    if ns.kv_cache_memory:
        kw["kv_cache_memory"] = ns.kv_cache_memory
    return LLM(path, **kw)


def one_pass(llm, prompts, params) -> tuple[float, int, list]:
    """The prompts one at a time (single stream): seconds, tokens, outputs."""
    n, outs = 0, []
    start = time.perf_counter()
    for prompt in prompts:
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        outs.append(out.token_ids)
        n += len(out.token_ids)
    return time.perf_counter() - start, n, outs


def spec_counts(llm) -> tuple[int, int, int]:
    stats = llm.engine.stats().spec_decoding
    return (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) if stats else (0, 0, 0)


def measure(ns, specs: list[str | None], path: str) -> list[dict]:
    """Best-of-rounds per configuration. On a CPU every engine stays built and the rounds alternate
    between them, so load from other processes falls on all alike; a GPU holds one engine at a time."""
    import torch

    from shardserve import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=ns.max_tokens, ignore_eos=bool(ns.random_weights))
    results = [{"spec": json.loads(s) if s else None} for s in specs]

    def timed(result: dict, llm) -> None:
        prompts = prompts_for(ns, llm)
        if "warm" not in result:
            llm.generate(prompts[:1], params, use_tqdm=False)
            result["warm"] = spec_counts(llm)
        elapsed, n, outs = one_pass(llm, prompts, params)
        if elapsed < result.get("seconds", float("inf")):
            result.update(seconds=round(elapsed, 3), tokens=n, tokens_per_s=round(n / elapsed, 2), outputs=outs)
        result["counts"] = spec_counts(llm)

    if ns.device == "cpu" or (ns.device == "auto" and not torch.cuda.is_available()):
        engines = [build(ns, spec, path) for spec in specs]
        for _ in range(ns.rounds):
            for result, llm in zip(results, engines):
                timed(result, llm)
        for result, llm in zip(results, engines):
            _finish(result)
            llm.engine.shutdown()
        return results
    for result, spec in zip(results, specs):
        llm = build(ns, spec, path)
        for _ in range(ns.rounds):
            timed(result, llm)
        _finish(result)
        llm.engine.shutdown()
        del llm
        gc.collect()   # free the device for the next engine
        torch.cuda.empty_cache()
    return results


def _finish(result: dict) -> None:
    """Acceptance over the measured passes (the warm-up's counts taken off)."""
    (d0, p0, a0), (d1, p1, a1) = result.pop("warm"), result.pop("counts")
    if result["spec"] is not None:
        drafts, proposed, accepted = d1 - d0, p1 - p0, a1 - a0
        result.update(acceptance_rate=round(accepted / proposed, 3) if proposed else 0.0,
                      mean_acceptance_length=round(1 + accepted / drafts, 2) if drafts else 1.0,
                      verification_steps=drafts)


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
    specs = [None] + [spec.replace("SELF", path) for spec in ns.spec or DEFAULT_SPECS]   # SELF: its own draft
    runs = measure(ns, specs, path)
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
