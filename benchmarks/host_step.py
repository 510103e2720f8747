"""The engine's host work per decode step, on the CPU with a tiny random model (so the model's own
time is small): a large batch of long outputs, each step's time split into scheduling, the worker
(input preparation, the model, sampling), the scheduler's update and output processing.

    python3 benchmarks/host_step.py [--requests 256] [--output-len 512] [--json out.json]

On a GPU the same Python runs beside the device's steps (async scheduling): once it takes longer
than a step, the GPU waits. Figures are per step and per request-step, over the steps in which
every request decodes.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardserve import LLM, SamplingParams  # noqa: E402
from shardserve.sampling_params import RequestOutputKind  # noqa: E402

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
        "tie_word_embeddings": False}


def _timed(totals: dict[str, float], name: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--output-kind", choices=("final_only", "cumulative"), default="final_only",
                    help="final_only: LLM.generate's (outputs built once a request finishes); cumulative: "
                         "the server's (an output every step)")
    ap.add_argument("--json")
    args = ap.parse_args()
    path = tempfile.mkdtemp(prefix="shardserve-host-step-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY, f)
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, max_num_seqs=args.requests,
              max_num_batched_tokens=max(2048, args.requests * args.input_len), show_progress=False)
    engine = llm.engine
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(TINY["vocab_size"]) for _ in range(args.input_len)] for _ in range(args.requests)]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind[args.output_kind.upper()])
        llm.generate(prompts[:2], params, use_tqdm=False)   # warm-up
        totals: dict[str, float] = defaultdict(float)
        scheduler, executor = engine.scheduler, engine.executor
        scheduler.schedule = _timed(totals, "schedule", scheduler.schedule)
        scheduler.update_from_output = _timed(totals, "update", scheduler.update_from_output)
        engine.output_processor.process = _timed(totals, "outputs", engine.output_processor.process)
        executor.submit_execute = _timed(totals, "worker", executor.submit_execute)   # in process: runs the step
        executor.collect_execute = _timed(totals, "worker", executor.collect_execute)
        # Time only the steps where every request decodes: from the first such step to the end.
        for prompt in prompts:
            engine.add_request(engine.next_request_id(), prompt, params)
        while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in scheduler.running) or scheduler.waiting:
            engine.step()
        totals.clear()
        steps, start = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        elapsed = time.perf_counter() - start
    finally:
        engine.shutdown()
    request_steps = args.requests * steps
    result = {"requests": args.requests, "output_len": args.output_len, "output_kind": args.output_kind, "steps": steps,
              "step_ms": 1e3 * elapsed / steps, "us_per_request_step": 1e6 * elapsed / request_steps,
              "parts_us_per_request_step": {k: 1e6 * v / request_steps for k, v in totals.items()}}
    print(f"{steps} decode steps of up to {args.requests} requests: {result['step_ms']:.2f} ms a step, "
          f"{result['us_per_request_step']:.1f} us per request-step")
    for name, us in result["parts_us_per_request_step"].items():
        print(f"  {name:9s} {us:6.1f} us per request-step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
