"""The counters a student can watch, `llm.stats` (vLLM's v1/metrics/stats.py): a record the
scheduler and the chapters add to."""
from dataclasses import dataclass, field

from nanoserve.speculative_config import SpecDecodingStats


@dataclass
class SchedulerStats:
    """Counters a student can watch: `llm.stats` (docs/scheduling.md shows them at work)."""

    num_steps: int = 0
    # steps that compute prompt tokens, alone or (chunked prefill) mixed with decodes
    num_prefill_steps: int = 0
    num_preemptions: int = 0  # recomputed or swapped out
    # tokens admitted by prefills, cached or not (a preempted request counts again)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache instead of computed
    num_generated_tokens: int = 0
    # prompt chunks that stopped short of the prompt's end (so sampled nothing)
    num_chunked_prefills: int = 0
    num_mixed_steps: int = 0  # steps whose batch mixed prefill work with decodes (chunked prefill)
    # running requests evicted for a more urgent waiting one (priority policy)
    num_priority_preemptions: int = 0
    num_swapped_out: int = 0  # preemptions that moved the KV to host memory (the others recompute)
    num_swapped_in: int = 0  # swapped-out requests whose KV was copied back
    # evicted cached blocks whose KV was copied to the host tier (kv_offload/)
    num_offloaded_blocks: int = 0
    # blocks copied back from the host tier for a prefix the device missed
    num_loaded_blocks: int = 0
    # the part of num_cached_tokens the host tier served (host hits)
    num_host_cached_tokens: int = 0
    # lookahead tokens verified
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)
