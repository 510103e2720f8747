"""The offline API, shaped like vLLM's: `LLM(...).generate(...)` and `.chat(...)`."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Sequence

from tqdm.auto import tqdm

from shardserve.engine.args import EngineArgs
from shardserve.engine.create import create_engine
from shardserve.engine.engine import PromptType
from shardserve.outputs import RequestOutput
from shardserve.sampling_params import RequestOutputKind, SamplingParams
from shardserve.tokenizer.tokenizer import Tokenizer

Message = dict[str, Any]


def _setup_logging() -> None:
    log = logging.getLogger("shardserve")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


class LLM:
    """An engine for offline batched generation.

    LLM(model=None) serves the embedded SmolLM2-135M-Instruct. Other keyword arguments are
    EngineArgs fields (max_num_batched_tokens, kv_cache_memory, block_size, ...)."""

    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: str = "auto",
                 device: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 256, seed: int = 0,
                 show_progress: bool = True, **kwargs: Any) -> None:
        _setup_logging()
        args = EngineArgs(model=model, tokenizer=tokenizer, dtype=dtype, device=device, max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, seed=seed, **kwargs)
        self.engine = create_engine(args, show_progress=show_progress)
        self.show_progress = show_progress

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def start_profile(self) -> None:
        """Start torch.profiler on every worker (needs SHARDSERVE_TORCH_PROFILER_DIR or
        VLLM_TORCH_PROFILER_DIR set; worker/profiler.py)."""
        self.engine.start_profile()

    def stop_profile(self) -> list[str]:
        """Stop the workers' profilers; returns the trace files written, one per worker."""
        return self.engine.stop_profile()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """priority: one per prompt, lower first (needs scheduling_policy="priority", as in vLLM)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        return self._run(list(prompts), list(params), use_tqdm, list(priority or [0] * len(prompts)))

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None, use_tqdm: bool = True,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: each conversation through the chat template (with `tools`, OpenAI's
        function definitions, for templates that describe them), then generate."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; this LLM was built with skip_tokenizer_init")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = tokenizer.apply_chat_template(conv, add_generation_prompt, chat_template, tools=tools,
                                                 **(chat_template_kwargs or {}))
            # The template already wrote any BOS; do not let the tokenizer add another.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool,
             priority: list[int]) -> list[RequestOutput]:
        engine = self.engine
        # Only finished outputs are returned, so only those are built (as vLLM's LLM does). The
        # caller's params are left as they are: each distinct one is copied once.
        final = {id(p): replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        params = [final[id(p)] for p in params]
        ids = []
        try:
            for prompt, p, urgency in zip(prompts, params, priority):
                rid = engine.next_request_id()
                engine.add_request(rid, prompt, p, priority=urgency)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", unit="req",
                   disable=not (use_tqdm and self.show_progress), leave=False)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:   # leave no half-run requests behind for the next call
            engine.abort_request([rid for rid in ids if rid not in finished])
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in ids]
