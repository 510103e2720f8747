"""On a GPU: the engine in bf16 gives HF transformers' greedy tokens on a random-weight model with
Llama-3-8B's exact shapes (16 GB of bf16 weights), for the first 32 tokens.

Random weights give nearly flat next-token distributions, so two correct bf16 implementations
(different GEMM tilings, fused vs separate projections, attention kernels) can pick different
tokens where the top two are within bf16 rounding of each other, after which the continuations
legitimately differ. So both continuations are judged step by step by the same weights run in
fp32 (teacher-forced): at each of the 32 steps our greedy token must be fp32's argmax up to a
near-tie, no worse than HF bf16's own tokens are, and our reported log-probs must agree with
fp32's. The length of the prefix identical to HF's generate() is printed for the record."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import _prompts

pytestmark = pytest.mark.gpu

# Near-tie tolerance in nats. Measured on an H100: HF's own cached generate() and a full forward over
# the same tokens rank two candidates 0.094 nats apart in opposite orders on this model; HF bf16's
# worst step is 0.126 nats; our batched run (a CUDA graph, 3 requests padded to 4, Triton attention)
# reached 0.266. A wrong kernel is off by whole nats, far outside this band.
TIE_TOL = 0.3


def _teacher_forced(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Next-token log-probs (fp32, on CPU) at each step of `continuation`."""
    ids = torch.tensor([prompt + continuation], device="cuda")
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).cpu()


def _chosen(lp: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return lp[torch.arange(len(tokens)), torch.tensor(tokens)]


def test_greedy_matches_hf_bf16(checkpoint):
    import gc

    from transformers import AutoModelForCausalLM

    from shardserve import LLM, SamplingParams
    prompts = _prompts()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map="cuda").eval()
    with torch.inference_mode():
        hf_tokens = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, min_new_tokens=32,
                                 do_sample=False)[0, len(p):].tolist() for p in prompts]
    del hf
    gc.collect()
    torch.cuda.empty_cache()

    llm = LLM(checkpoint, dtype="bfloat16", device="cuda", skip_tokenizer_init=True, max_model_len=2048,
              gpu_memory_utilization=0.5, show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    # bf16 GEMMs round differently at other batch sizes, so a batched run is judged like the rest
    # (exact batch invariance is a CPU fp32 test).
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()

    # The judge: the same bf16 weights evaluated in fp32.
    ref = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, device_map="cuda").eval()
    for i, (prompt, theirs, out) in enumerate(zip(prompts, hf_tokens, outs)):
        ours = out.token_ids
        same = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), 32)
        lp_ours, lp_theirs = _teacher_forced(ref, prompt, ours), _teacher_forced(ref, prompt, theirs)
        gap_ours = (lp_ours.max(-1).values - _chosen(lp_ours, ours)).max().item()
        gap_theirs = (lp_theirs.max(-1).values - _chosen(lp_theirs, theirs)).max().item()
        ours_reported = torch.tensor([out.logprobs[j][t].logprob for j, t in enumerate(ours)])
        err = (ours_reported - _chosen(lp_ours, ours)).abs().mean().item()
        print(f"prompt {i} ({len(prompt)} tokens): identical to HF bf16 generate() for {same}/32 tokens; "
              f"worst step vs fp32 argmax: ours {gap_ours:.4f}, HF bf16 {gap_theirs:.4f} nats; "
              f"our mean |logprob - fp32| {err:.4f}")
        assert gap_ours <= max(TIE_TOL, gap_theirs), f"prompt {i}: a greedy token is {gap_ours:.3f} nats off"
        assert err <= 0.1, f"prompt {i}: log-probs differ from fp32 by {err:.3f} on average"
        lp_batched = _teacher_forced(ref, prompt, batched[i])
        gap_batched = (lp_batched.max(-1).values - _chosen(lp_batched, batched[i])).max().item()
        assert gap_batched <= max(TIE_TOL, gap_theirs), f"prompt {i} in a batch: a token is {gap_batched:.3f} nats off"
