"""Speculative decoding's scheduler (docs/speculative.md, "Accounting"): the core's Scheduler with
the drafts' books.

A request with k draft tokens computes 1 + k tokens in one step: its newest token and the k drafts,
in the lookahead slots (Sequence.spec_token_ids, counted in len(seq) as vLLM V1's
num_tokens_with_spec, v0.8.2), so the core plans, reserves and builds them as any tokens. This
subclass proposes the drafts before each plan, drops those past the token budget, records who
verifies what in its own plan (SpecDecodeSchedulerOutput), and takes the verified run in: the
verification emits a + 1 tokens, the a drafts accepted and one more from the target. The KV of the
k - a rejected drafts was written but is wrong for what follows, so num_computed_tokens rolls back
over them and BlockManager.truncate gives their blocks back.
"""
from dataclasses import dataclass, field

from nanoserve.config import Config
from nanoserve.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.spec_decode.accounting import num_rejected_tokens
from nanoserve.spec_decode.proposer import propose_drafts
from nanoserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID


@dataclass
class SpecDecodeSchedulerOutput(SchedulerOutput):
    """A step's plan with its drafts (vLLM's scheduled_spec_decode_tokens): a sequence that verifies
    k drafts computes 1 + k tokens and samples 1 + k rows."""

    # seq_id -> the drafts it verifies this step
    scheduled_spec_decode_tokens: dict[int, list[int]] = field(default_factory=dict)
    # seq_id -> how many of them passed (the step's record shows it: nanoserve/step_records.py)
    num_accepted_tokens: dict[int, int] = field(default_factory=dict)

    def num_drafts(self, row: ScheduledSequence) -> int:
        return len(self.scheduled_spec_decode_tokens.get(row.seq.seq_id, ()))

    def is_decode(self, row: ScheduledSequence) -> bool:
        """A verification is a decode too: the newest token and its drafts."""
        return (row.num_tokens == 1 + self.num_drafts(row)
                and row.start >= row.seq.num_prompt_tokens)

    def num_sampled_tokens(self, row: ScheduledSequence) -> int:
        return super().num_sampled_tokens(row) + self.num_drafts(row)


class SpecDecodeScheduler(Scheduler):
    """The Scheduler with drafts to verify; the core's own unless speculative_config is set."""

    output_class = SpecDecodeSchedulerOutput

    def __init__(self, config: Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.speculative_config = config.speculative_config

    def schedule(self) -> SchedulerOutput:
        """Before the plan, each running sequence about to decode gets its drafts (proposer.py)."""
        if self.speculative_config is not None:
            self.propose_drafts()
        return super().schedule()

    def propose_drafts(self) -> None:
        """The drafts each running sequence about to decode verifies in the step (proposer.py)."""
        propose_drafts(self.running, self.speculative_config)

    def needs_newest_token(self, seq: Sequence) -> bool:
        """Async scheduling: a sequence whose newest token a step in flight is sampling sits the
        planned step out, so that its drafts are proposed from that token (and when that step
        verifies drafts, neither its tokens nor how many of its slots it keeps are known yet). It
        runs in the step after, drafts and all."""
        return self.speculative_config is not None or super().needs_newest_token(seq)

    def _schedule_chunk(self, seq: Sequence, budget: int, out: SpecDecodeSchedulerOutput) -> int:
        if self.speculative_config is None:
            return super()._schedule_chunk(seq, budget, out)
        del seq.spec_token_ids[max(budget - 1, 0) :]  # the drafts past the token budget are dropped
        num_tokens = super()._schedule_chunk(seq, budget, out)
        if seq.spec_token_ids:  # its newest token and these k drafts: 1 + k tokens
            out.scheduled_spec_decode_tokens[seq.seq_id] = list(seq.spec_token_ids)
        return num_tokens

    def _take_running(self, seq: Sequence, out: SchedulerOutput) -> list[Sequence]:
        group = super()._take_running(seq, out)
        for s in group:  # (drafts are proposed for running sequences only)
            s.spec_token_ids = []
        return group

    def accept_tokens(self, out: SpecDecodeSchedulerOutput, row: ScheduledSequence,
                      token_ids: list[int]) -> list[Sequence]:
        """seq computed its newest token and k drafts, and a + 1 tokens were emitted (token_ids,
        PLACEHOLDER_TOKEN_ID-padded). Roll num_computed_tokens back over the k - a rejected drafts,
        hash only blocks full of verified KV, give the blocks past them back. Returns seq once per
        token it got."""
        if self.speculative_config is None or not (
                drafts := out.scheduled_spec_decode_tokens.get(row.seq.seq_id)):
            return super().accept_tokens(out, row, token_ids)
        seq, emitted = row.seq, [t for t in token_ids if t != PLACEHOLDER_TOKEN_ID]
        # Preempted while the step ran (async scheduling): swapped, its blocks are in the host
        # pool; else it has none.
        pool = self.home(seq)[1]
        if pool is not None:
            seq.num_computed_tokens -= num_rejected_tokens(len(drafts), len(emitted))
        seq.spec_token_ids = []
        self.stats.spec_decoding.observe(len(drafts), len(emitted) - 1)
        out.num_accepted_tokens[seq.seq_id] = len(emitted) - 1
        self.append_tokens(seq, emitted)
        verified = min(seq.num_computed_tokens, len(seq.token_ids))  # (the last one has no KV yet)
        self.hash_blocks(row, verified)
        if seq.finish_reason is not None:
            self.finish(seq)
        elif pool is not None:
            pool.truncate(seq, verified)
        return [seq] * (len(seq.token_ids) - row.start - 1)
