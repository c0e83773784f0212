"""The scheduler's books for speculative decoding (docs/speculative.md, "Accounting").

A request with k draft tokens computes 1 + k tokens in one step: its newest token and the k drafts (vLLM V1
counts them in num_tokens_with_spec = prompt + output + spec_token_ids, seed 000). The verification emits
a + 1 tokens: the a drafts accepted and one more from the target. The KV of the k - a rejected drafts was
written but is wrong for what follows, so num_computed_tokens rolls back over them.
"""
from dataclasses import dataclass, field

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.layers.rejection_sampler import PLACEHOLDER_TOKEN_ID
from nanoserve.utils.math import cdiv


def num_spec_tokens_allowed(k: int, num_output_tokens: int, max_tokens: int) -> int:
    """How many drafts a request may verify: a step emits up to k + 1 tokens, and a draft past the request's
    last output token (max_tokens) would be computed for nothing."""
    return max(0, min(k, max_tokens - num_output_tokens - 1))


def num_rejected_tokens(num_draft_tokens: int, num_emitted_tokens: int) -> int:
    """Of num_draft_tokens drafts verified, how many were rejected, from how many tokens the step emitted
    (the accepted drafts and the target's own next token): num_computed_tokens rolls back by this much."""
    if not 1 <= num_emitted_tokens <= num_draft_tokens + 1:
        raise ValueError(f"a step verifying {num_draft_tokens} drafts emits 1 to {num_draft_tokens + 1} tokens, "
                         f"got {num_emitted_tokens}")
    return num_draft_tokens + 1 - num_emitted_tokens


@dataclass
class SpecDecodingStats:
    """vLLM's speculative decoding counters: how often the guesses pay off."""

    num_drafts: int = 0  # verifications of one request's drafts (requests x steps that speculated)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification: its first num_accepted_tokens drafts were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        missing = num_draft_tokens - len(self.num_accepted_tokens_per_pos)
        self.num_accepted_tokens_per_pos += [0] * max(0, missing)
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts per draft proposed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """[i]: the share of verifications whose draft i was accepted (so all drafts before it too)."""
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: the accepted drafts plus the target's own token (1: no gain)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def free_tail(block_manager: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """Give back seq's blocks past its first num_tokens tokens: after a verification, those that held only
    rejected drafts. Never hashed (nothing in them was verified), they go to the front of the free queue, to
    be reused before any block the prefix cache can still hit."""
    keep = cdiv(num_tokens, block_manager.block_size)
    tail, seq.block_table = seq.block_table[keep:], seq.block_table[:keep]
    for block_id in tail:
        block_manager.blocks[block_id].ref_count -= 1
    block_manager.free_block_ids.extendleft(reversed([b for b in tail if block_manager.blocks[b].ref_count == 0]))


def accept_tokens(scheduler, out: SchedulerOutput, seq: Sequence, start: int, drafts: list[int],
                  row: list[int]) -> list[Sequence]:
    """Take in seq's verification in step `out` for the Scheduler (its postprocess, which imports this module,
    so untyped): row holds the rejection sampler's 1 + k outputs, the emitted tokens then PLACEHOLDER_TOKEN_IDs.
    num_computed_tokens rolls back over the rejected drafts; the emitted tokens are appended one at a time,
    each checked for EOS, stop tokens and max_tokens (the rest dropped); only blocks full of verified tokens
    are hashed; the blocks past them go back. Returns seq once per token appended."""
    emitted = [t for t in row if t != PLACEHOLDER_TOKEN_ID]
    seq.num_output_placeholders -= 1
    num_rejected = num_rejected_tokens(len(drafts), len(emitted))
    # Async scheduling may have preempted seq while this step ran: swapped, its blocks are in the host pool;
    # recomputed, it has none left to roll back.
    pool = {SequenceStatus.RUNNING: scheduler.block_manager,
            SequenceStatus.SWAPPED: scheduler.host_block_manager}.get(seq.status)
    seq.num_computed_tokens -= num_rejected if pool is not None else 0
    seq.spec_token_ids = []
    scheduler.stats.spec_decoding.observe(len(drafts), len(emitted) - 1)
    out.num_accepted_tokens[seq.seq_id] = len(emitted) - 1  # (the step's record shows it: engine/trace.py)
    for token_id in emitted:
        seq.append_token(token_id)
        scheduler.stats.num_generated_tokens += 1
        seq.finish_reason = scheduler._finish_reason(seq, token_id)
        if seq.finish_reason is not None:
            break
    # Verified KV: the newest token and the accepted drafts (the last emitted token has none yet).
    verified = min(seq.num_computed_tokens, len(seq.token_ids))
    if pool is scheduler.block_manager:
        pool.hash_blocks(seq, start, verified)
    if seq.finish_reason is not None:
        scheduler.finish(seq)
    elif pool is not None:
        free_tail(pool, seq, verified)
    return [seq] * (len(seq.token_ids) - start - 1)


def waits_for_drafts(group: list[Sequence], speculative_config) -> bool:
    """Async scheduling with speculation: a request whose newest token a step in flight is sampling sits the
    planned step out, so that its drafts are proposed from that token (and when that step verifies drafts,
    neither its tokens nor how many of its slots it keeps are known yet). It runs in the step after, drafts and all."""
    return speculative_config is not None and any(seq.num_output_placeholders > 0 for seq in group)


class DraftRow:
    """Row j of a verification, as the sampler sees it: seq with its first j drafts counted as output tokens
    already (for penalties and min_tokens); everything else is seq's."""

    def __init__(self, seq: Sequence, j: int):
        self.seq, self.j = seq, j

    def __getattr__(self, name: str):
        return getattr(self.seq, name)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.seq.completion_token_ids + self.seq.spec_token_ids[: self.j]

    @property
    def num_completion_tokens(self) -> int:
        return self.seq.num_completion_tokens + self.j


def draft_rows(seq: Sequence) -> list:
    """The sampling rows of seq: one, or with k drafts 1 + k (row j after the first j drafts)."""
    return [DraftRow(seq, j) for j in range(len(seq.spec_token_ids) + 1)] if seq.spec_token_ids else [seq]
