"""nanoserve: a small, readable LLM inference engine (paged KV cache, continuous batching, prefix
caching)."""
from nanoserve.utils.threads import set_thread_defaults

set_thread_defaults()  # first: OpenMP reads its settings when the imports below load torch

from nanoserve.beam_search_params import BeamSearchParams  # noqa: E402
from nanoserve.chapters import LLM, AsyncLLM  # noqa: E402  (the core, its chapters composed)
from nanoserve.kv_transfer_config import KVTransferConfig  # noqa: E402
from nanoserve.lora_request import LoRARequest  # noqa: E402
from nanoserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from nanoserve.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "BeamSearchParams", "LoRARequest", "KVTransferConfig"]
