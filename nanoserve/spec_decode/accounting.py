"""Speculative decoding's books (docs/speculative.md, "Accounting").

A request with k draft tokens computes 1 + k tokens in one step: its newest token and the k drafts, in the core's
lookahead slots (Sequence.spec_token_ids, counted in len(seq) as vLLM V1's num_tokens_with_spec, v0.8.2). The
verification emits a + 1 tokens: the a drafts accepted and one more from the target. The KV of the k - a rejected
drafts was written but is wrong for what follows, so the scheduler rolls num_computed_tokens back over them and
BlockManager.truncate gives their blocks back (accept_run, the scheduler's accept_lookahead seam).
"""
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID


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


def waits_for_drafts(seq: Sequence) -> bool:
    """The scheduler's needs_newest_token seam, with async scheduling: a sequence whose newest token a step in
    flight is sampling sits the planned step out, so that its drafts are proposed from that token (and when that
    step verifies drafts, neither its tokens nor how many of its slots it keeps are known yet). It runs in the
    step after, drafts and all."""
    return True


def accept_run(scheduler: Scheduler, out: SchedulerOutput, seq: Sequence, start: int, row: list[int]) -> list[Sequence]:
    """The accept_lookahead seam (Scheduler.postprocess): seq computed its newest token and k lookahead tokens, and
    a + 1 tokens were emitted (row, PLACEHOLDER_TOKEN_ID-padded). The KV of the k - a rejected ones is wrong for
    what follows: roll num_computed_tokens back over it, hash only blocks full of verified KV, give the blocks past
    them back. Returns seq once per token it got."""
    lookahead = out.scheduled_spec_decode_tokens[seq.seq_id]
    emitted = [t for t in row if t != PLACEHOLDER_TOKEN_ID]
    # Preempted while the step ran (async scheduling): swapped, its blocks are in the host pool; else it has none.
    pool = scheduler.home(seq)[1]
    seq.num_computed_tokens -= num_rejected_tokens(len(lookahead), len(emitted)) if pool is not None else 0
    seq.spec_token_ids = []
    scheduler.stats.spec_decoding.observe(len(lookahead), len(emitted) - 1)
    out.num_accepted_tokens[seq.seq_id] = len(emitted) - 1  # (the step's record shows it)
    scheduler.append_tokens(seq, emitted)
    verified = min(seq.num_computed_tokens, len(seq.token_ids))  # (the last emitted token has no KV yet)
    if pool is scheduler.block_manager:
        pool.hash_blocks(seq, start, verified)
    if seq.finish_reason is not None:
        scheduler.finish(seq)
    elif pool is not None:
        pool.truncate(seq, verified)
    return [seq] * (len(seq.token_ids) - start - 1)
