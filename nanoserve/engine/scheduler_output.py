from dataclasses import dataclass, field

import torch

from nanoserve.engine.sequence import Sequence


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
        end = seq.num_computed_tokens + num_tokens
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(num_tokens)
        self.num_computed_tokens.append(seq.num_computed_tokens)
        self.do_sample.append(end == len(seq))
        # n > 1: the prompt's first token is sampled n times, and the request's other sequences fork from this one.
        self.forks.append(seq.group[1:] if self.do_sample[-1] and end == seq.num_prompt_tokens else [])
        if seq.spec_token_ids:  # lookahead: its newest token and these k tokens, 1 + k in all
            self.scheduled_spec_decode_tokens[seq.seq_id] = list(seq.spec_token_ids)

    def is_decode(self, i: int) -> bool:
        """Row i computes only its newest generated token (and any lookahead drafts after it), no prefill work."""
        seq = self.seqs[i]
        num_drafts = len(self.scheduled_spec_decode_tokens.get(seq.seq_id, []))
        return self.num_scheduled_tokens[i] == 1 + num_drafts and self.num_computed_tokens[i] >= seq.num_prompt_tokens
