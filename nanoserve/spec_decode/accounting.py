"""Speculative decoding's counts (docs/speculative.md, "Accounting"): how many drafts a request may
verify, and how many of them a verification rejected (SpecDecodeScheduler rolls back over those).
"""


def num_spec_tokens_allowed(k: int, num_output_tokens: int, max_tokens: int) -> int:
    """How many drafts a request may verify: a step emits up to k + 1 tokens, and a draft past the
    request's last output token (max_tokens) would be computed for nothing."""
    return max(0, min(k, max_tokens - num_output_tokens - 1))


def num_rejected_tokens(num_draft_tokens: int, num_emitted_tokens: int) -> int:
    """Of num_draft_tokens drafts verified, how many were rejected, from how many tokens the step
    emitted (the accepted drafts and the target's own next token): num_computed_tokens rolls back by
    this much."""
    if not 1 <= num_emitted_tokens <= num_draft_tokens + 1:
        raise ValueError(f"a step verifying {num_draft_tokens} drafts emits 1 "
                         f"to {num_draft_tokens + 1} tokens, got {num_emitted_tokens}")
    return num_draft_tokens + 1 - num_emitted_tokens
