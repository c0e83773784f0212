"""nanoserve: a small, readable LLM inference engine (paged KV cache, continuous batching, prefix caching)."""
from nanoserve.llm import LLM
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
