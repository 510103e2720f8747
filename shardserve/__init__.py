"""shardserve: serve large language models across many accelerators."""
from shardserve.llm import LLM
from shardserve.outputs import CompletionOutput, Logprob, RequestOutput
from shardserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
