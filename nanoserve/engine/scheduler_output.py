from dataclasses import dataclass, field

import torch

from nanoserve.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledSequence:
    """One row of a step's plan: seq computes num_tokens tokens from position start (its
    num_computed_tokens before the step), and samples if that reaches its end."""

    seq: Sequence
    start: int
    num_tokens: int
    do_sample: bool
    # n > 1: the request's other sequences, sampled from seq's row, then forked from it
    forks: list[Sequence]


@dataclass
class SchedulerOutput:
    """One step's plan (vLLM's name): a row per scheduled sequence, in batch order. Block copies run
    before the forward, reads of the device pool (swap-outs, offloads) first: a block they free may
    be a destination. Fields past blocks_to_copy are the chapters'."""

    rows: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Block moves, each a pair: copy-on-write copies (source, destination).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    is_prefill: bool = False  # computes prompt tokens (with chunked prefill: anything but decodes)
    # seq_id -> lookahead tokens
    scheduled_spec_decode_tokens: dict[int, list[int]] = field(default_factory=dict)
    # What the step's output did, for its record (nanoserve/step_records.py): seq_id -> how many
    # lookahead tokens passed; the logits rows of sequences with raw_logits (beam search), in order;
    # beam search's forked beams (new beam, its parent) and dropped ones (without a child, freed).
    num_accepted_tokens: dict[int, int] = field(default_factory=dict)
    raw_logits: torch.Tensor | None = None
    forked_beams: list[tuple[int, int]] = field(default_factory=list)
    dropped_beams: list[int] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        return [row.seq for row in self.rows]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        start = seq.num_computed_tokens
        end = start + num_tokens
        do_sample = end == len(seq)
        # n > 1: the prompt's first token is sampled n times, and the request's other sequences fork
        # from this one.
        forks = seq.group[1:] if do_sample and end == seq.num_prompt_tokens else []
        self.rows.append(ScheduledSequence(seq, start, num_tokens, do_sample, forks))
        if seq.spec_token_ids:  # lookahead: its newest token and these k tokens, 1 + k in all
            self.scheduled_spec_decode_tokens[seq.seq_id] = list(seq.spec_token_ids)

    def is_decode(self, row: ScheduledSequence) -> bool:
        """row computes only its newest generated token (and any lookahead drafts after it), no
        prefill work."""
        num_drafts = len(self.scheduled_spec_decode_tokens.get(row.seq.seq_id, []))
        return row.num_tokens == 1 + num_drafts and row.start >= row.seq.num_prompt_tokens
