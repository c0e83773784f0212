from dataclasses import dataclass, field

import torch

from nanoserve.engine.sequence import Sequence
from nanoserve.speculative_config import SpecDecodingStats


@dataclass
class SchedulerOutput:
    """One step's plan (vLLM's name): seqs[i] computes num_scheduled_tokens[i] tokens from num_computed_tokens[i],
    sampling if that reaches its end. Block copies run before the forward, reads of the device pool (swap-outs,
    offloads) first: a block they free may be a destination. Fields past blocks_to_copy are the chapters'."""

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # where each chunk starts
    do_sample: list[bool] = field(default_factory=list)
    forks: list[list[Sequence]] = field(default_factory=list)  # sampled from the same row as seqs[i], forked
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (source, destination)
    blocks_to_offload: list[tuple[int, int]] = field(default_factory=list)  # kv_offload/: evicted (device, host)
    blocks_to_load: list[tuple[int, int]] = field(default_factory=list)  # kv_offload/'s hits back (host, device)
    failed_offloads: dict[tuple[int, int], Exception] = field(default_factory=dict)  # the executor's, with why
    failed_loads: dict[tuple[int, int], Exception] = field(default_factory=dict)  # (a failed load's block has no KV)
    kv_connector_metadata: object = None  # kv_transfer/: the step's KV loads and saves for another engine
    is_prefill: bool = False  # computes prompt tokens (with chunked prefill: anything but decodes)
    scheduled_spec_decode_tokens: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> lookahead tokens
    # What the step's output did, for its record (nanoserve/step_records.py):
    num_accepted_tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> how many lookahead tokens passed
    raw_logits: torch.Tensor | None = None  # the logits rows of sequences with raw_logits (beam search), in order
    forked_beams: list[tuple[int, int]] = field(default_factory=list)  # beam search: (new beam, its parent)
    dropped_beams: list[int] = field(default_factory=list)  # beam search: beams without a child, freed

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(num_tokens)
        self.num_computed_tokens.append(seq.num_computed_tokens)
        self.do_sample.append(seq.num_computed_tokens + num_tokens == len(seq))
        # n > 1: the prompt's first token is sampled n times, and the request's other sequences fork from this one.
        self.forks.append(seq.group[1:] if self.do_sample[-1] and len(seq) == seq.num_prompt_tokens else [])
        if seq.spec_token_ids:  # lookahead: its newest token and these k tokens, 1 + k in all
            self.scheduled_spec_decode_tokens[seq.seq_id] = list(seq.spec_token_ids)

    def is_decode(self, i: int) -> bool:
        """Row i computes only its newest generated token (and any lookahead drafts after it), no prefill work."""
        seq = self.seqs[i]
        num_drafts = len(self.scheduled_spec_decode_tokens.get(seq.seq_id, []))
        return self.num_scheduled_tokens[i] == 1 + num_drafts and self.num_computed_tokens[i] >= seq.num_prompt_tokens


@dataclass
class SchedulerStats:
    """Counters a student can watch: `llm.stats` (docs/scheduling.md shows them at work)."""

    num_steps: int = 0
    num_prefill_steps: int = 0  # steps that compute prompt tokens, alone or (chunked prefill) mixed with decodes
    num_preemptions: int = 0  # recomputed or swapped out
    num_prompt_tokens: int = 0  # tokens admitted by prefills, cached or not (a preempted request counts again)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache instead of computed
    num_generated_tokens: int = 0
    num_chunked_prefills: int = 0  # prompt chunks that stopped short of the prompt's end (so sampled nothing)
    num_mixed_steps: int = 0  # steps whose batch mixed prefill work with decodes (chunked prefill)
    num_priority_preemptions: int = 0  # running requests evicted for a more urgent waiting one (priority policy)
    num_swapped_out: int = 0  # preemptions that moved the KV to host memory (the others recompute)
    num_swapped_in: int = 0  # swapped-out requests whose KV was copied back
    num_offloaded_blocks: int = 0  # evicted cached blocks whose KV was copied to the host tier (kv_offload/)
    num_loaded_blocks: int = 0  # blocks copied back from the host tier for a prefix the device missed
    num_host_cached_tokens: int = 0  # the part of num_cached_tokens the host tier served (host hits)
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)  # lookahead tokens verified
