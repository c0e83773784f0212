"""nanoserve: a small, readable LLM inference engine (paged KV cache, continuous batching, prefix caching)."""
from nanoserve.async_llm import AsyncLLM
from nanoserve.beam_search_params import BeamSearchParams
from nanoserve.llm import LLM
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "BeamSearchParams"]
